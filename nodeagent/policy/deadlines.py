"""Deadlines: jobs that declared their work and a deadline, scheduled earliest deadline first.

Each tick, for each deadline job: remaining work W = declared work - CPU used since its
cgroup was made (cpu.stat), window D = deadline - now, parallelism p = the fewest of its
declared CPUs, its threads and the node's CPUs, times the share of a CPU a thread gets
beside what the rest of the node uses (`thread_speed`). The capacity is what the node really has
(`cpu.capacity`: its CPUs less the reservations and less what the rest of the node was
measured to use). `edf.admit` keeps, by priority then earliest deadline, the jobs that can
all finish on it; the others are predicted to miss.

The admitted jobs share a budget: while other managed workloads are busy, the rates that
finish each by its deadline less its reserve (`deadlines.reserve` of its window on its
first running tick, kept) times `deadlines.headroom`, at most the capacity, so deadline
jobs take what they need and fair share keeps the rest; with nobody else busy, the whole
capacity.
Inside the budget the order is EDF, not a proportional split (`edf.allot`): the earliest
deadline gets all it can use, then the next, down to what each later job needs now to stay
feasible; a job with slack may get nothing now. Each job's part is an exclusive floor,
which `CpuWeights` turns into weight: the earliest run at full speed, a job that is not
due yet gets the least weight. When the kernel still gives a job less than its part while
it waits for CPU (measured: `cpu.stat` and `cpu.pressure`), its weight is raised step by
step until it gets it, and the later deadline jobs are capped (`cpu.max`) at their parts
for a few ticks, so they cannot take what it needs. The caps stay work-conserving: a
shortfall while the node left CPU idle was not the later jobs' doing (the kernel placed the
earlier job's tasks badly), so it caps nobody; and while the node had CPU idle, the capped
jobs' caps rise by what was idle, earliest deadline first, falling back to the parts at the
next shortfall on a full node (an earlier job that cannot use its part, throttled by its own
cap or ending, otherwise left a CPU idle beside jobs capped at 0.01 cores).

Jobs that cannot fit are planned with the admitted ones, their deadlines later by the
least common delay that lets the admitted still finish early (`edf.allot_late`), so a late
job comes before an admitted one that can wait; a job past its deadline with work left is
due now, the most late first. A job past its declared work is planned as if one more tick
at full speed were left, until its deadline; then it falls back to fair share. Re-planned
every tick from what was measured, so a job that runs faster or slower than declared is
followed.

Whose deadline: a rule's own, or root's through `nodeagent exec`, is the operator's word, and
its floor is defended (the protection controller throttles and freezes lower classes while
the job stalls short of it). One the workload's side declared (another caller's `exec
--deadline`, a pod's annotations: `Assignment.declared`) gets what its class's
`declared_deadlines` says: `defended` as above; `scheduled`, planned here the same but its
floor not defended (`Floor.defended`); `refused`, not planned (refused where it was
declared; one left from before a reload is noted and left to fair share). A note of kind
`deadline-grant` says why, on every job whose deadline is not defended.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from nodeagent.cgroupfs.values import Attribute, CpuMax
from nodeagent.policy.base import (
    Assignment,
    Carry,
    Decision,
    Floor,
    Note,
    Output,
    Policy,
    PolicyInput,
)
from nodeagent.policy.cpu import Capacity, capacity, idle_cores
from nodeagent.policy.edf import Demand, admit, allot_late, rank
from nodeagent.policy.fairshare import is_active
from nodeagent.policy.notes import DeadlineGrantNote, DeadlineProgress
from nodeagent.policy.notes import DeadlineStatus as Status
from nodeagent.policy.reads import Reads
from nodeagent.policyfile.model import DeadlineGrant, PolicySpec
from nodeagent.snapshot import NO_NEEDS, Needs, WorkloadState

SHORT = 0.95
"""An earlier job that got less than this part of its rate, while it waited for CPU, was
shorted by a later one."""
WAITED = 0.02
"""The share of a tick with some of its tasks waiting for a CPU that counts as wanting more."""
CAP_TICKS = 5
"""Ticks the later jobs stay capped after a shortfall was last seen."""
GAIN_MAX = 4.0
"""The most a shorted job's weight is raised above its part."""
SPREAD_LEAST = 0.02
"""Cores: a multi-threaded job's part below this is the least weight, and is not capped for
its spread."""
SPEED_LEAST = 0.9
"""The least share of a CPU a job's thread is planned to get (`thread_speed`)."""
IDLE_MIN = 0.1
"""Cores idle on the node last tick from which it counts as not full: the caps give it back,
and a shortfall beside it caps nobody (a full node read 0.00-0.06 idle in the VM)."""


def parallelism(w: WorkloadState, a: Assignment, cpus: int) -> float:
    limits = [float(cpus)]
    if a.cpus is not None:
        limits.append(a.cpus)
    if w.sample.threads is not None and w.sample.threads > 0:
        limits.append(float(w.sample.threads))
    return min(limits)


def thread_speed(cap: Capacity, cpus: int) -> float:
    """The share of a CPU one of a job's threads gets at most: what the rest of the node (the
    agent, the system) uses is spread over its CPUs, so a thread never has a whole one. A
    job's parallelism in cores is its threads times this; planned at 1.0 per thread, a
    single-threaded job that had to run flat out to its deadline got 0.96 cores at most in
    the VM and missed by 0.3-0.7 s (set 1 of --sets 8 --seed 1). At least SPEED_LEAST: use
    beyond that is not spread over every CPU (a busy service outside on a few), and a thread
    runs beside it."""
    return max(SPEED_LEAST, 1.0 - cap.other / cpus) if cpus > 0 else 1.0


@dataclass(frozen=True, slots=True)
class _Job:
    w: WorkloadState
    a: Assignment
    remaining: float
    window: float
    p: float
    """Cores it can use: its threads (`width`) at `thread_speed`."""
    width: float
    """Its threads, declared CPUs or the node's CPUs, the fewest."""
    defended: bool = True
    """Its floor is defended by protection (`DeadlineGrant.DEFENDED`)."""


class Deadlines(Policy):
    name = "deadlines"
    writes = frozenset({Attribute.CPU_MAX})
    reads = Reads(
        settings=frozenset({"deadlines", "agent", "classes", "fair_share", "node"}),
        snapshot=frozenset({"wall_time", "node"}),
        workload=frozenset(
            {"cpu_usage_us", "populated", "cpu_rate", "threads", "cpu_stall", "settings"}
        ),
        carry=True,
    )
    """The wall clock against each job's deadline: a new plan every tick while it has a
    job it reads every tick (`needs`)."""

    def needs(self, assignment: Assignment, spec: PolicySpec) -> Needs:
        """A deadline job's processes and threads, every tick: one that starts or ends is
        seen at once (not at its next full read), and it gets no more CPUs than threads."""
        if assignment.deadline_grant(spec) in (None, DeadlineGrant.REFUSED):
            return NO_NEEDS
        return Needs(events=True, threads=True)

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        settings = given.spec.deadlines
        if not settings.enabled:
            return []
        carried = given.carried.get(self.name, {})
        now = given.snapshot.wall_time
        interval = given.spec.agent.interval
        out: list[Output] = []
        cap = capacity(given, _number(carried.get("other")))
        jobs, demands, overdue, noted = self._jobs(given, out, cap)
        admitted, missed = admit(list(demands.values()), cap.cores)
        missed += overdue
        others = [
            w
            for w in given.snapshot.workloads
            if w.path not in jobs
            and w.path in given.assignments
            and is_active(w, given.spec.fair_share)
        ]
        reserves = _reserves(jobs, demands, carried.get("reserves"), settings.reserve)
        need = settings.headroom * sum(d.rate for d in _aimed(admitted, reserves))
        # a set that cannot all finish takes the whole capacity: the late jobs are late by
        # the least only when they may come before an admitted job that can wait
        budget = min(cap.cores, need) if others and not missed else cap.cores
        # planned as if the next re-plan came half a tick sooner: a job that can finish
        # before it gets the rate to finish in half a tick, so one the kernel gives less still
        # finishes this tick (paced to end just at the next, it drags on, a part a tick)
        parts, late = allot_late(admitted, missed, budget, interval / 2)
        order = {d.name: i for i, d in enumerate(rank([*demands.values(), *overdue]), start=1)}
        last = carried.get("parts")
        last_parts = {
            p: float(v)
            for p, v in (last.items() if isinstance(last, dict) else ())
            if p in jobs and isinstance(v, int | float)
        }
        gains = _gains(jobs, last_parts, carried.get("gains"))
        for d in admitted:
            out.append(
                self._floor(
                    d,
                    jobs[d.name],
                    parts[d.name],
                    gains.get(d.name, 1.0),
                    order=order,
                    budget=budget,
                    source=(
                        "the whole capacity: a deadline job is predicted to miss"
                        if missed
                        else f"sized for each to finish by its reserve"
                        f" ({reserves.get(d.name, 0.0):.1f} s before this deadline) times the"
                        " headroom, beside busy fair-share work"
                        if others
                        else "the whole capacity: nothing else managed is busy"
                    ),
                    cap=cap,
                )
            )
            if d.name not in noted:
                out.append(
                    self._note(
                        jobs[d.name], Status.ON_TRACK, parts[d.name], now, order=order, cap=cap
                    )
                )
        for d in missed:
            due = d in overdue
            if parts[d.name] > 0:
                out.append(
                    self._late_floor(
                        d, jobs[d.name], parts[d.name], due, late, order=order, cap=cap
                    )
                )
            if not due and d.name not in noted:
                out.append(
                    self._note(
                        jobs[d.name],
                        Status.PREDICTED_MISS,
                        parts[d.name],
                        now,
                        order=order,
                        cap=cap,
                    )
                )
        spread = _spread(jobs, parts, budget, bool(others))
        idle = idle_cores(given.snapshot.node)
        # a shortfall beside idle CPU was the kernel's placement, not a later job's taking
        taken = _shorted_rank(jobs, last_parts, order) if idle < IDLE_MIN else None
        caps = _caps(parts, order, taken, carried.get("caps"))
        caps |= {p: max(caps.get(p, 0), 1) for p in spread}
        uncap = _uncap(jobs, caps, carried.get("caps"), carried.get("uncap"))
        lift = _lift(
            jobs, parts, caps=caps, order=order, idle=idle, taken=taken, held=carried.get("lift")
        )
        out.extend(_cap_decisions(jobs, parts, caps, spread=spread, uncap=uncap, lift=lift))
        out.append(
            Carry(
                self.name,
                {
                    "other": cap.other,
                    "parts": dict(sorted(parts.items())),
                    "caps": caps,
                    "uncap": uncap,
                    "lift": lift,
                    "gains": {p: g for p, g in sorted(gains.items()) if g > 1.0},
                    "reserves": reserves,
                },
            )
        )
        return out

    def _jobs(
        self, given: PolicyInput, out: list[Output], cap: Capacity
    ) -> tuple[dict[str, _Job], dict[str, Demand], list[Demand], set[str]]:
        """(every deadline job, the demands of those that run before their deadlines, those
        past it with work left: due now, by one interval, and the demands whose note is in
        `out` already); notes for the rest go to `out`. A job past its declared work before
        its deadline (its runtime's start-up, a last write: most are about to end) is planned
        as if one more tick at full speed were left; left to fair share beside floors that
        fill the node, it got nothing (seen in the VM: 0.7 CPU-s took 13 s at weight 1)."""
        now = given.snapshot.wall_time
        cpus = given.snapshot.node.cpu_count
        speed = thread_speed(cap, cpus)
        noted: set[str] = set()
        demands: dict[str, Demand] = {}
        overdue: list[Demand] = []
        jobs: dict[str, _Job] = {}
        for w in given.snapshot.workloads:
            a = given.assignments.get(w.path)
            grant = None if a is None else a.deadline_grant(given.spec)
            if a is None or grant is None or a.deadline is None or a.work is None:
                continue
            if grant is not DeadlineGrant.DEFENDED:
                out.append(_grant_note(w.path, a, grant))
            if grant is DeadlineGrant.REFUSED:
                continue  # declared before a reload refused it: fair share plans it
            if w.sample.cpu_usage_us is None:
                continue  # no cpu.stat: nothing to measure progress with
            remaining = a.work - w.sample.cpu_usage_us / 1e6
            window = a.deadline - now
            width = parallelism(w, a, cpus)
            job = jobs[w.path] = _Job(
                w, a, remaining, window, width * speed, width, grant is DeadlineGrant.DEFENDED
            )
            priority = given.spec.classes[a.workload_class].priority
            if remaining <= 0:
                status = Status.OVERRUN if w.sample.populated else Status.DONE
                out.append(self._note(job, status, None, now))
                if w.sample.populated and window > 0:  # about to end: one more tick's work
                    tick = job.p * given.spec.agent.interval
                    demands[w.path] = Demand(w.path, tick, window, job.p, priority)
                    noted.add(w.path)
            elif window <= 0:
                out.append(self._note(job, Status.MISSED, None, now))
                if w.sample.populated is not False:  # the most late first
                    overdue.append(
                        Demand(w.path, remaining, given.spec.agent.interval, job.p, priority)
                    )
            elif w.sample.populated is False:
                out.append(self._note(job, Status.WAITING, None, now))
            else:
                demands[w.path] = Demand(w.path, remaining, window, job.p, priority)
        return jobs, demands, overdue, noted

    def _floor(
        self,
        d: Demand,
        job: _Job,
        part: float,
        gain: float,
        *,
        order: Mapping[str, int],
        budget: float,
        source: str,
        cap: Capacity,
    ) -> Floor:
        """`source`: how the budget was sized."""
        why = (
            "all it can use (its parallelism)"
            if part >= job.p - 1e-6
            else "what is left after earlier deadlines"
            if part > d.rate
            else "nothing now: earlier deadlines come first and it can still finish later"
            if part <= 1e-6
            else "what it needs now to stay on time"
        )
        cores = min(job.p, part * gain)
        trace = [
            f"admitted by EDF on {cap.describe()}",
            f"needs {d.rate:.3f} cores on average ({d.work:.1f} CPU-s in {d.window:.1f} s);"
            f" the deadline jobs' budget is {budget:.2f} cores ({source}),"
            f" handed out earliest deadline first: {part:.2f}, {why} (parallelism {job.p:g})",
        ]
        if cores > part:
            trace.append(
                f"weighted as {cores:.2f} cores (x{gain:.2f}): the kernel gave it less than"
                " its part while it waited for CPU"
            )
        return Floor(
            d.name,
            cores,
            self.name,
            f"EDF rank {order[d.name]} of {len(order)}, deadline in {d.window:.0f} s:"
            f" floor {cores:.2f} cores",
            tuple(trace),
            exclusive=True,
            defended=job.defended,
        )

    def _late_floor(
        self,
        d: Demand,
        job: _Job,
        part: float,
        due: bool,
        late: float | None,
        *,
        order: Mapping[str, int],
        cap: Capacity,
    ) -> Floor:
        """The floor of a job predicted to miss (or past its deadline: `due`); `late`, the
        delay its deadline was planned with (None: it got what the admitted left)."""
        return Floor(
            d.name,
            part,
            self.name,
            f"{'past its deadline' if due else 'predicted to miss'}: floor {part:.2f} cores"
            " so it is late by the least",
            (
                f"EDF rank {order[d.name]} of {len(order)}; needs {d.rate:.3f} cores,"
                f" {cap.describe()}",
                "planned earliest deadline first with the admitted jobs, every late deadline"
                f" {late:.1f} s later (the least that lets the admitted still finish early)"
                if late is not None
                else "given what the admitted jobs leave: even late, the set does not fit",
            ),
            exclusive=True,
            defended=job.defended,
        )

    def _note(
        self,
        job: _Job,
        status: Status,
        rate: float | None,
        now: float,
        *,
        order: Mapping[str, int] | None = None,
        cap: Capacity | None = None,
    ) -> Note:
        w, a, remaining, window, p = job.w, job.a, job.remaining, job.window, job.p
        assert a.deadline is not None
        required = remaining / window if window > 0 and remaining > 0 else None
        pace = rate if rate else w.cpu_rate
        finish = now + remaining / pace if remaining > 0 and pace else None
        slack = window - max(0.0, remaining) / p
        message = {
            Status.ON_TRACK: f"on track: {remaining:.1f} CPU-s left, {window:.0f} s to the"
            " deadline",
            Status.PREDICTED_MISS: f"predicted to miss: {remaining:.1f} CPU-s left cannot fit"
            f" in {window:.0f} s with the other deadlines; given what is left",
            Status.MISSED: f"missed its deadline {-window:.0f} s ago with {remaining:.1f} CPU-s"
            " left; planned first among the late jobs while it runs",
            Status.OVERRUN: f"used {-remaining:.1f} CPU-s more than it declared and still runs;"
            " planned as if one more tick at full speed were left, until its deadline",
            Status.DONE: "its declared work is done",
            Status.WAITING: "holds no process yet",
        }[status]
        progress = DeadlineProgress(
            status, a.deadline, a.work, remaining, required, rate, w.cpu_rate, p, slack, finish
        )
        if order is not None and cap is not None:
            rank = order.get(w.path)
            progress = replace(progress, rank=rank, capacity=cap.cores, capacity_source=cap.source)
        return Note(w.path, self.name, str(status), message, progress)


def _grant_note(path: str, a: Assignment, grant: DeadlineGrant) -> Note:
    """Why a deadline the workload's side declared is not defended (or not planned)."""
    setting = f"classes.{a.workload_class}.declared_deadlines is {grant}"
    message = (
        f"its deadline was declared by {a.declared} and {setting}: planned by EDF, but not"
        " defended: while it stalls short of its floor the protection controller throttles"
        " and freezes nobody for it, and its caps do not spare that floor"
        if grant is DeadlineGrant.SCHEDULED
        else f"its deadline, declared by {a.declared}, is not planned: {setting} (a reload set"
        " it so after the deadline was taken); fair share plans it as any workload"
    )
    payload = DeadlineGrantNote(a.declared, str(grant))
    return Note(path, Deadlines.name, str(grant), message, payload)


def _reserves(
    jobs: Mapping[str, _Job], demands: Mapping[str, Demand], held: object, part: float
) -> dict[str, float]:
    """Seconds each job aims to finish before its deadline: `part` of its window on the first
    tick it runs (not while its cgroup waits for a process: a window seen long before the
    start would make the reserve too large), then kept (carried, so a restart keeps it too).
    Re-planning from the time left every tick would otherwise shrink the margin with the
    window: a job given just its rate each tick finishes at its deadline, one given 5% less
    misses it."""
    before = held if isinstance(held, dict) else {}
    out = {}
    for path in jobs:
        r = _number(before.get(path))
        if r is not None and r >= 0:
            out[path] = r
        elif path in demands:
            out[path] = part * demands[path].window
    return dict(sorted(out.items()))


def _aimed(admitted: Sequence[Demand], reserves: Mapping[str, float]) -> list[Demand]:
    """The admitted jobs with their windows ending at their reserves (a job behind its aim
    at full speed: its work over its parallelism), for the budget they take from fair share
    only: the parts inside it go by the deadlines themselves, earliest first (a reserve in
    the order would make a later job with a long window critical, and squeeze an earlier
    one)."""
    return [
        replace(
            d,
            window=max(d.window - reserves.get(d.name, 0.0), min(d.window, d.work / d.parallelism)),
        )
        for d in admitted
    ]


def _shorted(job: _Job, part: float | None) -> bool:
    """It got less than its part last tick while some of its tasks waited for a CPU."""
    rate = job.w.cpu_rate
    return (
        part is not None
        and part > 0.05
        and rate is not None
        and rate < SHORT * part
        and (job.w.cpu_stall or 0.0) >= WAITED
    )


def _gains(jobs: Mapping[str, _Job], last: Mapping[str, float], held: object) -> dict[str, float]:
    """How much more weight each job needs than its part, for what the kernel really gives:
    raised while a job is shorted (by the shortfall, at most x1.25 a tick, x4 in all),
    eased back 5% a tick once it gets its part."""
    before = held if isinstance(held, dict) else {}
    out = {}
    for path, job in jobs.items():
        g = before.get(path)
        gain = float(g) if isinstance(g, int | float) and 1.0 <= g <= GAIN_MAX else 1.0
        part = last.get(path)
        if _shorted(job, part):
            assert part is not None and job.w.cpu_rate is not None
            gain *= min(1.25, part / max(job.w.cpu_rate, 0.01))
        else:
            gain *= 0.95
        out[path] = min(GAIN_MAX, max(1.0, gain))
    return out


def _uncap(
    jobs: Mapping[str, _Job], caps: Mapping[str, int], held: object, lifting: object
) -> list[str]:
    """Jobs whose cap lapsed, to set back to `max` until the kernel shows it: a cap nobody
    decides any more would otherwise stay in the file (a job capped at 0.01 cores while an
    earlier one ran kept that cap after it ended)."""
    was = [
        *(held if isinstance(held, dict) else ()),
        *(lifting if isinstance(lifting, list) else ()),
    ]
    return sorted(
        p
        for p in {str(p) for p in was}
        if p in jobs
        and p not in caps
        and jobs[p].w.sample.settings.get(Attribute.CPU_MAX) != CpuMax(None)
    )


def _cap_decisions(
    jobs: Mapping[str, _Job],
    parts: Mapping[str, float],
    caps: Mapping[str, int],
    *,
    spread: Sequence[str],
    uncap: Sequence[str],
    lift: Mapping[str, float],
) -> list[Decision]:
    """cpu.max at the part for each capped job (`spread`: by its threads, this tick; the
    others: held after a shortfall) plus its lift, and back to `max` for each cap lifted."""
    out = []
    for path, ticks in sorted(caps.items()):
        part = parts.get(path, 0.0)
        extra = lift.get(path, 0.0)
        threads = path in spread and ticks <= 1
        # all it can use: its threads, whole (a thread may get more than it was planned)
        cores = jobs[path].width if part + extra >= jobs[path].p - 1e-6 else part + extra
        out.append(
            Decision(
                path,
                Attribute.CPU_MAX,
                CpuMax.from_cores(max(cores, 0.01)),
                "deadlines",
                f"capped at its EDF part {part:.2f} cores"
                + (f" + {extra:.2f} the node left idle" if extra else "")
                + ": "
                + (
                    "its threads would take more"
                    if threads
                    else "an earlier deadline got less than its own"
                ),
                (
                    f"parallelism {jobs[path].p:g} and the parts fill the budget: a group's"
                    " weight is spread over the CPUs its threads run on, so by weight alone a"
                    " single-threaded job beside it gets less than its part"
                    if threads
                    else f"held {ticks} more tick(s) after the last shortfall",
                    *(
                        (
                            f"raised by what the node left idle while capped ({extra:.2f}"
                            " cores, earliest capped first), until a shortfall on a full node",
                        )
                        if extra
                        else ()
                    ),
                ),
            )
        )
    out.extend(
        Decision(
            path,
            Attribute.CPU_MAX,
            CpuMax(None),
            "deadlines",
            "cap lifted: no earlier deadline is shorted now",
            ("a rule's or the job's own cpu.max binds still, the lowest cap winning",),
        )
        for path in uncap
    )
    return out


def _spread(
    jobs: Mapping[str, _Job], parts: Mapping[str, float], budget: float, others: bool
) -> list[str]:
    """Multi-threaded jobs to cap at their parts from the start, while the parts fill the
    budget and something else runs beside them: the kernel spreads a group's weight over
    the CPUs its threads run on, so weights in proportion to the parts give a
    single-threaded job on a CPU it shares with one less than its part (the 8-set bench of
    stop 22, set 5: the earliest job, one thread, got 0.71 cores under the policy beside a
    two-threaded one, 0.92 under the kernel's default). Not a job with nothing now: the
    kernel gives a group at the least weight next to nothing on a CPU it shares (its share
    on each CPU, however spread, is at most its weight), so a cap would only keep it off the
    CPUs the others leave idle (in the VM: two such jobs capped at 0.01 cores beside a CPU
    idle for over a second while an earlier job ended)."""
    running = [p for p, part in parts.items() if part > 1e-6]
    if sum(parts.values()) < budget - 0.05 or (len(running) < 2 and not others):
        return []
    return sorted(
        p
        for p, part in parts.items()
        if jobs[p].p > 1.0 and SPREAD_LEAST <= part < jobs[p].p - 1e-6
    )


def _caps(
    parts: Mapping[str, float], order: Mapping[str, int], taken: int | None, held: object
) -> dict[str, int]:
    """Later jobs to cap at their part: each held CAP_TICKS ticks after the last tick an
    earlier job (EDF rank `taken`) was shorted on a full node (got less than its last part
    while it waited)."""
    caps = {
        p: int(t) - 1
        for p, t in (held.items() if isinstance(held, dict) else ())
        if p in parts and isinstance(t, int) and t > 1
    }
    if taken is not None:
        for p, r in order.items():
            if r > taken and p in parts:
                caps[p] = CAP_TICKS
    return dict(sorted(caps.items()))


def _shorted_rank(
    jobs: Mapping[str, _Job], last: Mapping[str, float], order: Mapping[str, int]
) -> int | None:
    """The EDF rank of the earliest job shorted last tick, if one was."""
    ranks = [order[p] for p, part in last.items() if p in order and _shorted(jobs[p], part)]
    return min(ranks) if ranks else None


def _lift(
    jobs: Mapping[str, _Job],
    parts: Mapping[str, float],
    *,
    caps: Mapping[str, int],
    order: Mapping[str, int],
    idle: float,
    taken: int | None,
    held: object,
) -> dict[str, float]:
    """Cores each capped job may take above its part: what the node left idle last tick,
    added tick by tick, to the earliest capped job first (each up to its parallelism); all
    dropped at a shortfall on a full node (`taken`). Capped at their parts alone, the later
    jobs could not use a CPU an earlier one left, throttled by its own cap or ending
    (probed in the VM: 0.2-1.0 cores idle for ticks beside jobs capped at 0.01 cores, 4.1
    core-seconds idle while the set ran against 0.7 under the kernel's default, and its
    last job late)."""
    before = {  # each within its room, as its part moves
        p: min(float(v), max(0.0, jobs[p].p - parts.get(p, 0.0)))
        for p, v in (held.items() if isinstance(held, dict) else ())
        if p in caps and isinstance(v, int | float) and v > 0
    }
    if taken is not None:
        return {}
    if idle < IDLE_MIN:
        return dict(sorted(before.items()))
    for path in sorted(caps, key=lambda p: order.get(p, len(order) + 1)):
        room = max(0.0, jobs[path].p - parts.get(path, 0.0) - before.get(path, 0.0))
        give = min(room, idle)
        if give > 0:
            before[path] = before.get(path, 0.0) + give
            idle -= give
        if idle <= 0:
            break
    return {p: round(v, 3) for p, v in sorted(before.items())}


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
