"""Deadline scheduling on several CPUs, as a fluid model: feasibility, admission, rates.

A job j has remaining work W_j (CPU-seconds), a window D_j (seconds until its deadline)
and a parallelism p_j (it cannot use more than p_j CPUs at once); the node has C CPUs.
Global EDF is not optimal on several CPUs (Dhall's effect: two short jobs with early
deadlines take both CPUs, and a long single-threaded one that needed one CPU throughout
misses), so feasibility is decided exactly, as a flow: the time until the last deadline
is cut at every deadline into intervals; job j may receive up to p_j·|I| of work in each
interval I that ends by its deadline, and each interval offers C·|I|. The set is feasible
iff the maximum flow carries every job's W_j (Horn, 1974). Sizes are a handful to a few
hundred jobs, so a plain augmenting-path max flow is fast enough.

Admission goes in priority order, then earliest deadline first: a job is admitted when
the set stays feasible with it; the others are predicted to miss. The rates now (`allot`)
are EDF as priority, not a fluid share: the time until the next re-plan is one more
interval, and the flow is seeded by handing each job, earliest deadline first, all it can
use (its parallelism) while CPU lasts; augmenting paths then move only what a later job
cannot do without (Dhall's case) back to it. So a job with slack gets nothing now while
earlier deadlines can use the CPU, and the earliest run at full speed, with the margin
for the kernel's and the measurement's noise that a steady pace at W_j/D_j lacks. Plain
EDF would leave a job that waits for earlier ones with no slack at all when its turn
comes, so the plan aims at windows shrunk by a common factor (`margin`): every job is
planned to finish early by the same part of its window, as much as the set allows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Demand:
    name: str
    work: float
    """Remaining CPU-seconds, > 0."""
    window: float
    """Seconds until the deadline, > 0."""
    parallelism: float
    """Most CPUs it can use at once, > 0."""
    priority: int = 0

    @property
    def rate(self) -> float:
        """The constant rate that finishes exactly at the deadline."""
        return self.work / self.window


class _Flow:
    """A small max-flow graph (Edmonds-Karp on float capacities)."""

    def __init__(self, n: int) -> None:
        self.cap: list[dict[int, float]] = [{} for _ in range(n)]

    def edge(self, u: int, v: int, c: float) -> None:
        self.cap[u][v] = self.cap[u].get(v, 0.0) + c
        self.cap[v].setdefault(u, 0.0)

    def push(self, u: int, v: int, amount: float) -> None:
        self.cap[u][v] -= amount
        self.cap[v][u] += amount

    def augment(self, s: int, t: int) -> float:
        total = 0.0
        while True:
            back = {s: s}
            queue = deque([s])
            while queue and t not in back:
                u = queue.popleft()
                for v, c in self.cap[u].items():
                    if c > EPS and v not in back:
                        back[v] = u
                        queue.append(v)
            if t not in back:
                return total
            amount, v = float("inf"), t
            while v != s:
                amount = min(amount, self.cap[back[v]][v])
                v = back[v]
            v = t
            while v != s:
                self.push(back[v], v, amount)
                v = back[v]
            total += amount


def rank(demands: Sequence[Demand]) -> list[Demand]:
    """The EDF order: priority first, then the earliest deadline."""
    return sorted(demands, key=lambda d: (-d.priority, d.window, d.name))


def schedule(
    demands: Sequence[Demand], capacity: float, horizon: float | None = None
) -> tuple[bool, dict[str, float]]:
    """(feasible, each job's work in the first interval / its length): a flow seeded with
    EDF front-loading, then completed by augmenting paths. With `horizon` (the time until
    the next re-plan), the first interval ends there, so its rates are the ones to run now."""
    jobs = rank(demands)
    if not jobs:
        return True, {}
    if capacity <= EPS or any(d.rate > d.parallelism * (1 + EPS) for d in jobs):
        return False, {}
    cuts = {d.window for d in jobs}
    if horizon is not None and EPS < horizon < min(cuts) - EPS:
        cuts.add(horizon)
    ends = sorted(cuts)
    starts = [0.0, *ends[:-1]]
    n_j, n_i = len(jobs), len(ends)
    s, t = n_j + n_i, n_j + n_i + 1
    g = _Flow(n_j + n_i + 2)
    room = [capacity * (e - b) for b, e in zip(starts, ends, strict=True)]
    for i, r in enumerate(room):
        g.edge(n_j + i, t, r)
    for j, d in enumerate(jobs):
        g.edge(s, j, d.work)
        left = d.work
        for i, (b, e) in enumerate(zip(starts, ends, strict=True)):
            if e > d.window + EPS:
                break
            g.edge(j, n_j + i, d.parallelism * (e - b))
            take = min(left, d.parallelism * (e - b), room[i])  # EDF, as early as possible
            if take > EPS:
                g.push(s, j, take)
                g.push(j, n_j + i, take)
                g.push(n_j + i, t, take)
                room[i] -= take
                left -= take
    g.augment(s, t)
    feasible = all(g.cap[s][j] <= EPS * max(1.0, d.work) * 1e3 for j, d in enumerate(jobs))
    first = ends[0]
    rates = {d.name: g.cap[n_j][j] / first for j, d in enumerate(jobs)}
    return feasible, rates


def feasible(demands: Sequence[Demand], capacity: float) -> bool:
    return schedule(demands, capacity)[0]


def admit(demands: Sequence[Demand], capacity: float) -> tuple[list[Demand], list[Demand]]:
    """(admitted, predicted to miss): by priority, then earliest deadline, each kept when
    the set stays feasible with it."""
    admitted: list[Demand] = []
    missed: list[Demand] = []
    for d in rank(demands):
        if feasible([*admitted, d], capacity):
            admitted.append(d)
        else:
            missed.append(d)
    return admitted, missed


def allot(admitted: Sequence[Demand], capacity: float, horizon: float) -> dict[str, float]:
    """Rates for the next `horizon` seconds of a feasible set, by EDF priority: the earliest
    deadline gets all it can use, then the next, down to what each later job needs now to
    stay feasible. Planned to finish early: every window is shrunk by the same factor, as
    far as the set stays feasible (`margin`), so a job that waits for earlier deadlines is
    not left with no slack for the kernel's and the measurement's noise when its turn
    comes. A set that no longer fits (a job behind already, by the kernel's noise or a
    planned rate it did not get) is planned as if every deadline were later by the least
    common delay that makes it fit (`lateness`): the lateness is shared and stays that
    small, where `best_effort`'s greedy order would leave a long single-threaded job what
    is left (Dhall's case again) and make it late by far more. Only a set that does not
    fit even a window later gets `best_effort`."""
    ok, first = schedule(_shrunk(admitted, margin(admitted, capacity)), capacity, horizon)
    if ok:
        return first
    late = lateness(admitted, capacity)
    if late is not None:
        ok, first = schedule(_delayed(admitted, late), capacity, horizon)
        if ok:
            return first
    return best_effort(admitted, capacity)


AIM = 0.9
"""Beside jobs predicted to miss, the admitted ones aim at this part of their windows (or
less, when they have less slack): room for the kernel's noise, the rest of their slack for
the late jobs."""


def allot_late(
    admitted: Sequence[Demand], missed: Sequence[Demand], capacity: float, horizon: float
) -> tuple[dict[str, float], float | None]:
    """Rates for a set where `missed` cannot all finish: planned together with the admitted
    ones, each missed deadline later by the least common delay that lets the admitted still
    finish by `AIM` of their windows. So EDF puts a late job before an admitted one that can
    wait (handing the late jobs only what the admitted leave front-loads a job with slack
    while one already late starves, and makes it later still), and the lateness is shared.
    Returns the rates and that delay: None without a missed job (`allot`), or when even
    the bound does not fit (then `best_effort` with what the admitted leave)."""
    if not missed:
        return allot(admitted, capacity, horizon), None
    aimed = _shrunk(admitted, max(AIM, margin(admitted, capacity)))

    def fits(delay: float) -> bool:
        return feasible([*aimed, *_delayed(missed, delay)], capacity)

    # a bound that fits: the admitted by their windows, then each late job alone
    most = max(d.window for d in (*admitted, *missed)) + sum(
        d.work / max(EPS, min(d.parallelism, capacity)) for d in missed
    )
    if capacity <= EPS or not fits(most):
        parts = allot(admitted, capacity, horizon)
        parts.update(best_effort(missed, max(0.0, capacity - sum(parts.values()))))
        return parts, None
    delay = _least(fits, 0.0, most, most * 1e-6)
    ok, first = schedule([*aimed, *_delayed(missed, delay)], capacity, horizon)
    assert ok, "a delay that fits gives a feasible schedule"
    return first, delay


def margin(demands: Sequence[Demand], capacity: float, least: float = 0.5) -> float:
    """The least factor, from `least` up to 1 (to 1%), that every window can be shrunk by
    with the set still feasible: 1 when the set has no time to spare."""
    return _least(lambda f: feasible(_shrunk(demands, f), capacity), least, 1.0, 0.01)


def lateness(demands: Sequence[Demand], capacity: float) -> float | None:
    """The least delay, up to the longest window (to 1e-6 of it: coarser, and each tick's
    rounding up adds up), that every deadline must move by for the set to be feasible; None
    when even that is not enough. A delay, not a factor: the remaining flow of a plan stays
    feasible with the same delay, so re-planning each tick keeps it, where a factor of the
    time left would be re-granted every tick."""
    most = max((d.window for d in demands), default=0.0)
    if most <= 0 or not feasible(_delayed(demands, most), capacity):
        return None
    return _least(lambda s: feasible(_delayed(demands, s), capacity), 0.0, most, most * 1e-6)


def _least(fits: Callable[[float], bool], low: float, high: float, tolerance: float) -> float:
    """The least x in [low, high], to `tolerance`, that `fits` (monotonic, and true at
    `high`), by bisection: `low` when it fits already."""
    if fits(low):
        return low
    while high - low > tolerance:
        mid = (low + high) / 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def _delayed(demands: Sequence[Demand], seconds: float) -> list[Demand]:
    return [replace(d, window=d.window + seconds) for d in demands]


def _shrunk(demands: Sequence[Demand], factor: float) -> list[Demand]:
    return [replace(d, window=d.window * factor) for d in demands]


def best_effort(demands: Sequence[Demand], capacity: float) -> dict[str, float]:
    """For jobs that cannot all finish: each gets the rate it needs (at most its
    parallelism), in priority then deadline order while CPU lasts, so the fewest miss and
    the late ones are late by the least; CPU left over goes to them in the same order."""
    out, left = {}, capacity
    for d in rank(demands):
        out[d.name] = max(0.0, min(d.rate, d.parallelism, left))
        left -= out[d.name]
    for d in rank(demands):
        extra = max(0.0, min(d.parallelism - out[d.name], left))
        out[d.name] += extra
        left -= extra
    return out
