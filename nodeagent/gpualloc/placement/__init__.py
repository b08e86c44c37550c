"""Which GPUs a job gets now, and why. Pure: the node's GPUs and what is taken go in,
a placement (or the reason there is none) comes out.

Filter, then score. The filter keeps healthy GPUs with enough free memory that nobody
holds exclusively and, for a request of whole GPUs held alone, that no compute process
outside every hold is using (busy: a container started without a reservation, a job of
another scheduler). A request this node could never satisfy, whatever is held or running,
is `impossible`, so that it is refused at once rather than left waiting.

The score of a set is the sum of its pairs' scores, with go-gpuallocator's best-effort
weights (PCIe path from 10 across sockets to 50 under one switch, plus 100 per NVLink),
plus a bonus for each GPU on the NUMA nodes of the job's CPUs. NVSwitch peers count as
NVLink-connected, as the topology says they are.

The search is exact (every set, with a branch-and-bound cut) and looks past the request
itself. A multi-GPU set is the best of itself plus the best partition of the other
eligible GPUs into sets of its size (go-gpuallocator's idea, on up to PARTITION_MAX
GPUs), and of those the best-scoring one: on a DGX-1 with one quad free, two pairs of
NV1 and NV2 (220 each) rather than the NV2 pair under one switch (250) that leaves an NV1
pair (150) for the next job; never a worse set than go-gpuallocator's best effort, which
takes the best set of such a partition. A single GPU is the one that leaves the best
pairs (the best partition of the free GPUs into pairs), so it never splits an NVLink pair
while a GPU whose partner is taken is free and never leaves worse pairs than
go-gpuallocator, which takes the first GPU; but when its expected duration is known, of
the GPUs that leave pairs at least as good as that first one, the one whose hold delays
least the moments the node's best blocks are wholly free (it joins a quad busy past its end
rather than break a free one). Ties then go to the set whose holding for the job's
expected duration delays those moments least (when durations are known), that breaks the
fewest NVLinks to GPUs that stay free, that leaves the best sets of 16, 8, 4 and 2 GPUs,
that is taken from the most broken-up part of the PCIe tree, then to the lowest indices.

Durations: a request may carry its expected duration and a patience, and the holdings
when each held GPU is expected back (from the jobs' deadlines and work, or their classes'
recent holds; the caller's estimates, never read from a clock here). A request with
patience waits, rather than take a set now, when a set scoring at least PATIENCE_GAIN of
the node's best for its size more is expected free within that patience.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from itertools import combinations

from nodeagent.gpu.model import Device, GpuState, Link, PcieLevel, Topology

PCIE_SCORE: Mapping[PcieLevel, int] = {
    PcieLevel.PIX: 50,
    PcieLevel.PXB: 40,
    PcieLevel.PHB: 30,
    PcieLevel.NODE: 20,
    PcieLevel.SYS: 10,
}
"""go-gpuallocator's P2P link weights (besteffort_policy.go, calculateGPUPairScore)."""
NVLINK_SCORE = 100
"""go-gpuallocator's weight per NVLink between two GPUs."""
NUMA_SCORE = 10
"""Per GPU on a NUMA node of the job's CPUs: worth a PCIe level, never an NVLink."""
LEFTOVER_SIZES = (16, 8, 4, 2)
"""The set sizes whose best score on what is left breaks ties, largest first: big jobs
are the ones that fragmentation starves."""
MAX_LEFTOVER_CHECKS = 64
"""Tied sets whose leftovers are compared; past that (a node with no structure at all,
where every set scores alike) the lowest indices win."""
PARTITION_MAX = 8
"""Eligible GPUs up to which a multi-GPU set is chosen with the best partition of the rest
in view; past that (a 16-GPU NVSwitch node, where every partition scores alike) by its
own score."""
PATIENCE_GAIN = 0.1
"""How much more (a share of the node's best for the size) a set expected free within a
request's patience must score than the best set now for the request to wait for it."""
BLOCK_SHARE = 0.85
"""Sets of 2, 4, 8 and 16 GPUs that score at least this share of the best for their size
are the blocks whose free moments the duration-aware tie-break keeps early."""
MAX_BLOCKS = 32
"""Blocks kept per size, the best first: a fabric where every set scores alike has
thousands."""


def pair_score(link: Link) -> int:
    return PCIE_SCORE[link.pcie] + NVLINK_SCORE * link.nvlinks


@dataclass(frozen=True)
class GpuRequest:
    count: int = 1
    memory: int | None = None
    """Free memory each GPU must have, in bytes."""
    shared: bool = False
    """Share GPUs with other shared jobs, packed by memory, rather than hold them alone."""
    mig_profile: str | None = None
    """Take MIG instances of this profile (such as 1g.10gb) instead of whole GPUs."""
    cpu_numa_nodes: frozenset[int] = frozenset()
    """NUMA nodes of the job's CPUs; GPUs there score NUMA_SCORE more. Empty: unknown."""
    expected_duration: float | None = None
    """Seconds the job is expected to hold its GPUs; None: unknown."""
    patience: float = 0.0
    """Seconds it may still wait for a better set expected free by then (0: none)."""


@dataclass(frozen=True)
class Holdings:
    """What is taken now: by UUID (GPU or MIG device)."""

    exclusive: frozenset[str] = frozenset()
    shared: Mapping[str, int] = field(default_factory=dict)
    """Bytes promised to shared jobs, per GPU UUID."""
    release: Mapping[str, float] = field(default_factory=dict)
    """Seconds until each held GPU is expected back (its last holder's expected end); a
    held GPU not listed: unknown."""


@dataclass(frozen=True)
class NodeGpus:
    """The node as placement sees it: devices, how they connect, and memory in use."""

    devices: tuple[Device, ...]
    topology: Topology
    memory_used: Mapping[str, int] = field(default_factory=dict)
    """Bytes in use per GPU UUID, from telemetry."""
    busy: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """PIDs of the compute processes no hold covers, per GPU or MIG device UUID."""

    @cached_property
    def _position(self) -> dict[int, int]:
        return {d.index: p for p, d in enumerate(self.devices)}

    @cached_property
    def weights(self) -> list[list[int]]:
        """Pair scores by position in `devices`."""
        return self._matrix(pair_score)

    @cached_property
    def nvlinks(self) -> list[list[int]]:
        return self._matrix(lambda link: link.nvlinks)

    @cached_property
    def pcie_affinity(self) -> list[list[int]]:
        return self._matrix(lambda link: PCIE_SCORE[link.pcie])

    def _matrix(self, of: Callable[[Link], int]) -> list[list[int]]:
        d = self.devices
        return [[0 if a is b else of(self.topology.link(a.index, b.index)) for b in d] for a in d]

    @cached_property
    def _best(self) -> dict[int, int]:
        return {}

    def best_possible(self, k: int) -> int:
        """The best pair score of k whole GPUs on this node when nothing is taken."""
        if k not in self._best:
            pool = [p for p, d in enumerate(self.devices) if not d.mig_enabled]
            self._best[k] = _search(pool, k, self.weights, [0] * len(self.devices), False)[0]
        return self._best[k]

    def partitions(self, k: int) -> Partitions:
        """Best partitions into sets of k by this node's weights, memoised for its life."""
        if k not in self._partitions:
            self._partitions[k] = Partitions(self.weights, k)
        return self._partitions[k]

    @cached_property
    def _partitions(self) -> dict[int, Partitions]:
        return {}

    @cached_property
    def blocks(self) -> tuple[tuple[frozenset[int], float], ...]:
        """The node's best sets of 2, 4, 8 and 16 whole GPUs (positions), each with its
        score as a share of the best for its size: at least BLOCK_SHARE, at most
        MAX_BLOCKS per size, the whole node as one block at its own size."""
        whole = [p for p, d in enumerate(self.devices) if not d.mig_enabled]
        out: list[tuple[frozenset[int], float]] = []
        for k in LEFTOVER_SIZES:
            best = self.best_possible(k)
            if k > len(whole) or best <= 0 or math.comb(len(whole), k) > 2_000:
                continue
            scored = sorted(
                ((set_score(c, self.weights), c) for c in combinations(whole, k)),
                key=lambda sc: -sc[0],
            )
            out += [
                (frozenset(c), v / best) for v, c in scored[:MAX_BLOCKS] if v >= BLOCK_SHARE * best
            ]
        return tuple(out)


def set_score(s: Iterable[int], weights: Sequence[Sequence[int]]) -> int:
    """The sum of the pair scores of a set of positions."""
    members = tuple(s)
    return sum(weights[a][b] for i, a in enumerate(members) for b in members[i + 1 :])


def node_gpus(state: GpuState) -> NodeGpus:
    """The node as one tick saw it: memory in use from telemetry, and busy wherever a
    compute process runs on a GPU (or MIG device) that none of the tick's holds covers."""
    used = {t.uuid: t.memory_used for t in state.telemetry if t.memory_used is not None}
    parents = state.parents()
    busy: dict[str, set[int]] = {}
    for p in state.processes:
        if not any(h.covers(p.device_uuid, parents) for h in state.holds):
            busy.setdefault(p.device_uuid, set()).add(p.pid)
    pids = {uuid: tuple(sorted(found)) for uuid, found in busy.items()}
    return NodeGpus(state.devices, state.topology, used, pids)


@dataclass(frozen=True)
class PairScore:
    a: int
    b: int
    link: Link
    score: int


@dataclass(frozen=True)
class Placement:
    """The devices a request would get, and how they were chosen."""

    uuids: tuple[str, ...]
    """For CUDA_VISIBLE_DEVICES: GPU UUIDs, or MIG UUIDs for MIG instances."""
    indices: tuple[int, ...]
    """GPU indices (the parent GPUs of MIG instances)."""
    score: int
    pair_score: int
    numa_bonus: int
    best_possible: int
    """The best pair score for as many whole GPUs on this node when nothing is taken."""
    pairs: tuple[PairScore, ...]
    numa_nodes: tuple[int, ...]
    reason: str

    @property
    def fraction(self) -> float:
        """Pair score as a fraction of the best possible; 1.0 when there are no pairs."""
        return self.pair_score / self.best_possible if self.best_possible else 1.0


@dataclass(frozen=True)
class Refusal:
    """No set fits now, or a better one is expected soon: the request waits."""

    reason: str
    better_in: float | None = None
    """Seconds until the better set it waits for is expected free; None: no set fits."""


def place(request: GpuRequest, node: NodeGpus, held: Holdings) -> Placement | Refusal:
    """The devices the request would get now, chosen as the module describes."""
    if request.mig_profile is not None:
        return _place_mig(request, node, held)
    pool, refusal = eligible(request, node, held)
    if refusal is not None:
        return refusal
    bonus = numa_bonus(request, node)
    best, score, ties, partition = _candidates(request, node, pool, bonus)
    waiting = _worth_waiting(request, node, held, pool, bonus=bonus, best=best)
    if waiting is not None:
        return waiting
    chosen, why = _break_ties(request, node, held, ties, whole_free(node, held))
    now = f"score {best}, the best now" if score == best else f"score {score}{partition}"
    return describe(request, node, chosen, f"{now}{why}{_passed(request, node, held)}")


def _candidates(
    request: GpuRequest, node: NodeGpus, pool: list[int], bonus: list[int]
) -> tuple[int, int, list[tuple[int, ...]], str]:
    """The best score now; the sets to choose from and their score; why, if that is less.

    For several whole GPUs out of at most PARTITION_MAX, the sets that score best with the
    best partition of the rest of the pool into sets of the same size, and of those the
    best-scoring ones; otherwise the best-scoring sets."""
    k = request.count
    best, ties = _search(pool, k, node.weights, bonus, True)
    if k < 2 or request.shared or not k < len(pool) <= PARTITION_MAX:
        return best, best, ties, ""
    partitions = node.partitions(k)
    everyone = _mask(pool)
    scored = []
    for s in combinations(pool, k):
        own = set_score(s, node.weights) + sum(bonus[p] for p in s)
        scored.append((own + partitions.best(everyone & ~_mask(s))[0], own, s))
    top = max(total for total, _, _ in scored)
    score = max(own for total, own, _ in scored if total == top)
    sets = [s for total, own, s in scored if total == top and own == score]
    if score == best:
        return best, score, sets, ""
    greedy = partitions.best(everyone & ~_mask(ties[0]))[0]
    return (
        best,
        score,
        sets,
        (
            f": the best set now scores {best}, but the other eligible GPUs split as best into "
            f"sets of {k} would score {greedy} after it and {top - score} after this one"
        ),
    )


def _worth_waiting(
    request: GpuRequest,
    node: NodeGpus,
    held: Holdings,
    pool: list[int],
    *,
    bonus: list[int],
    best: int,
) -> Refusal | None:
    """A refusal when a set expected free within the request's patience would score
    PATIENCE_GAIN of the node's best for its size more than the best set now."""
    k = request.count
    if request.patience <= 0 or k < 2 or request.shared:
        return None
    soon = [
        p for p, d in enumerate(node.devices) if p in pool or _back_within(request, node, held, d)
    ]
    if len(soon) == len(pool):
        return None
    later, sets = _search(soon, k, node.weights, bonus, False)
    if later < best + PATIENCE_GAIN * node.best_possible(k):
        return None
    back = max(held.release[node.devices[p].uuid] for p in sets[0] if p not in pool)
    return Refusal(
        f"waits for GPUs {', '.join(str(i) for i in _indices(node, sets[0]))}: expected free "
        f"within {back:.0f}s, they score {later} against {best} for the best set now "
        f"(patience left {request.patience:.0f}s)",
        better_in=back,
    )


def _back_within(request: GpuRequest, node: NodeGpus, held: Holdings, d: Device) -> bool:
    """Held now, expected back within the request's patience, and fit for it then."""
    back = held.release.get(d.uuid)
    return (
        back is not None
        and back <= request.patience
        and d.healthy
        and not d.mig_enabled
        and d.uuid not in node.busy
        and (request.memory is None or (d.memory_total or 0) >= request.memory)
    )


def _passed(request: GpuRequest, node: NodeGpus, held: Holdings) -> str:
    """The why of the busy GPUs the request was kept off, if any."""
    busy = [d for d in node.devices if _excluded(request, node, held, d) == BUSY]
    if not busy:
        return ""
    listed = ", ".join(f"GPU {d.index} (pid {_pids(node.busy[d.uuid])})" for d in busy)
    return f"; passed over busy {listed}: compute processes outside any hold"


def _pids(pids: Sequence[int]) -> str:
    return ", ".join(map(str, pids[:3])) + (f" and {len(pids) - 3} more" if len(pids) > 3 else "")


def eligible(
    request: GpuRequest, node: NodeGpus, held: Holdings
) -> tuple[list[int], Refusal | None]:
    """Positions of the whole GPUs that pass the filter, or why too few do."""
    if request.count < 1:
        return [], Refusal("a request needs at least one GPU")
    if request.shared and request.memory is None:
        return [], Refusal("a shared request needs a memory size, to pack it")
    pool: list[int] = []
    excluded: dict[str, int] = {}
    for p, d in enumerate(node.devices):
        why = _excluded(request, node, held, d)
        if why:
            excluded[why] = excluded.get(why, 0) + 1
        else:
            pool.append(p)
    if len(pool) >= request.count:
        return pool, None
    detail = ", ".join(f"{n} {why}" for why, n in excluded.items())
    kind = "shared " if request.shared else ""
    return pool, Refusal(
        f"no {request.count} {kind}GPU{'s' if request.count > 1 else ''} free now: "
        f"{len(pool)} of {len(node.devices)} eligible" + (f" ({detail})" if detail else "")
    )


BUSY = "busy with compute processes outside any hold"


def _excluded(request: GpuRequest, node: NodeGpus, held: Holdings, d: Device) -> str:
    """Why a whole GPU cannot take the request; empty when it can."""
    if not d.healthy:
        return "unhealthy"
    if d.mig_enabled:
        return "in MIG mode"
    if d.uuid in held.exclusive:
        return "held"
    if not request.shared and held.shared.get(d.uuid, 0) > 0:
        return "shared"
    if not request.shared and d.uuid in node.busy:
        return BUSY
    if request.memory is not None and free_memory(node, held, d) < request.memory:
        return f"with less than {_gib(request.memory)} free"
    return ""


def free_memory(node: NodeGpus, held: Holdings, d: Device) -> int:
    """What is free on a GPU: its memory less what is in use or promised, whichever is more."""
    taken = max(node.memory_used.get(d.uuid, 0), held.shared.get(d.uuid, 0))
    return max((d.memory_total or 0) - taken, 0)


def whole_free(node: NodeGpus, held: Holdings) -> list[int]:
    """Positions of the GPUs a whole-GPU request could take (nothing on them of ours)."""
    return [p for p, d in enumerate(node.devices) if not _excluded(GpuRequest(), node, held, d)]


def numa_bonus(request: GpuRequest, node: NodeGpus) -> list[int]:
    return [
        NUMA_SCORE if d.numa_node is not None and d.numa_node in request.cpu_numa_nodes else 0
        for d in node.devices
    ]


def describe(
    request: GpuRequest, node: NodeGpus, positions: Iterable[int], reason: str
) -> Placement:
    """A placement of whole GPUs at `positions`, scored, with `reason` as the why."""
    chosen = sorted(positions, key=lambda p: node.devices[p].index)
    devices = [node.devices[p] for p in chosen]
    pairs = tuple(
        PairScore(a.index, b.index, link := node.topology.link(a.index, b.index), pair_score(link))
        for i, a in enumerate(devices)
        for b in devices[i + 1 :]
    )
    bonus = numa_bonus(request, node)
    pairs_total = sum(p.score for p in pairs)
    extra = sum(bonus[p] for p in chosen)
    return Placement(
        uuids=tuple(d.uuid for d in devices),
        indices=tuple(d.index for d in devices),
        score=pairs_total + extra,
        pair_score=pairs_total,
        numa_bonus=extra,
        best_possible=node.best_possible(len(chosen)),
        pairs=pairs,
        numa_nodes=tuple(sorted({d.numa_node for d in devices if d.numa_node is not None})),
        reason=reason,
    )


def _break_ties(
    request: GpuRequest,
    node: NodeGpus,
    held: Holdings,
    ties: list[tuple[int, ...]],
    free: list[int],
) -> tuple[tuple[int, ...], str]:
    """The tied set to take, and why it beat the others (empty when it had no rival).

    In order: for shared jobs, fewer GPUs opened that held no shared work; for one GPU,
    pairs left (the best partition of the GPUs left free into pairs) no worse than the
    first tied GPU's; with an expected duration, the least delay to the moments the node's
    blocks are wholly free; for one GPU, the best pairs left; fewer NVLinks cut between the
    GPUs taken from the free pool and those left in it; the best sets left for 16, 8, 4 and
    2 GPUs; the least PCIe affinity cut (taking GPUs from a part of the node that is already
    broken up); for shared jobs, the least memory left over (best fit); the lowest indices.
    """
    if len(ties) == 1:
        return ties[0], ""
    free_set = set(free)
    pairs = node.partitions(2)
    everyone = _mask(free)

    def cut(s: tuple[int, ...], matrix: list[list[int]]) -> int:
        left = free_set.difference(s)
        return sum(matrix[a][b] for a in free_set.intersection(s) for b in left)

    def fresh(s: tuple[int, ...]) -> int:
        return sum(1 for p in s if held.shared.get(node.devices[p].uuid, 0) == 0)

    def slack(s: tuple[int, ...]) -> int:
        return sum(free_memory(node, held, node.devices[p]) for p in s)

    def pairs_left(s: tuple[int, ...]) -> int:
        return pairs.best(everyone & ~_mask(s))[0] if request.count == 1 else 0

    delay = _Delay(request, node, held)
    floor = pairs_left(ties[0])

    def first(s: tuple[int, ...]) -> tuple[float, bool, float, int]:
        # never worse pairs left than the first tied GPU, go-gpuallocator's choice
        left = pairs_left(s)
        return (fresh(s) if request.shared else 0, left < floor, delay(s), -left)

    keyed = sorted(ties, key=lambda s: (first(s), cut(s, node.nvlinks), _indices(node, s)))
    rivals = [s for s in keyed if first(s) == first(keyed[0])][:MAX_LEFTOVER_CHECKS]
    leftovers = _Leftovers(node, free)

    def rest(s: tuple[int, ...]) -> tuple[object, ...]:
        # A size no longer possible scores -1, so that a set leaving more GPUs free (a
        # shared job beside a busy GPU's process) is not taken for one leaving better ones.
        left = dict(leftovers.after(s))
        return (
            cut(s, node.nvlinks),
            tuple(-left.get(k, -1) for k in LEFTOVER_SIZES),
            cut(s, node.pcie_affinity),
            slack(s) if request.shared else 0,
            _indices(node, s),
        )

    best = min(rivals, key=rest)
    parts = [f"{len(ties)} sets tie on score"]
    if request.shared:
        parts.append(f"{fresh(best)} GPU(s) opened for shared work")
    if request.count == 1 and len(free_set.difference(best)) >= 2:
        parts.append(f"leaves pairs {pairs_left(best)}")
    if request.expected_duration is not None and len({delay(s) for s in ties}) > 1:
        parts.append(
            f"its {request.expected_duration:.0f}s expected hold delays the node's best "
            "blocks least"
        )
    parts.append(f"{cut(best, node.nvlinks)} NVLinks to free GPUs cut")
    left = leftovers.after(best)
    if left:
        parts.append("leaves best " + ", ".join(f"{k}-GPU set {score}" for k, score in left))
    return best, "; " + "; ".join(parts)


class _Delay:
    """How much holding a set for the request's expected duration e delays the node's
    blocks: for each block it touches, exp(-F/e) - exp(-F'/e), where F is when the block is
    expected to be wholly free (now if it is, never if a holder's end is unknown or a GPU
    is lost) and F' the same with the set held for e, weighted by the block's score share.
    A block busy much longer than e costs next to nothing to join; a free one costs most;
    so a job goes where its end lines up with its neighbours' and blocks free together."""

    def __init__(self, request: GpuRequest, node: NodeGpus, held: Holdings) -> None:
        self._e = request.expected_duration
        self._blocks = node.blocks if self._e is not None and self._e > 0 else ()
        self._until = [_until(node, held, d) for d in node.devices]

    def __call__(self, s: tuple[int, ...]) -> float:
        e = self._e
        if not self._blocks or e is None:
            return 0.0
        taken = set(s)
        cost = 0.0
        for block, share in self._blocks:
            if taken.isdisjoint(block):
                continue
            before = max(self._until[p] for p in block)
            if before < e:
                cost += share * (math.exp(-before / e) - math.exp(-1.0))
        return round(cost, 9)


def _until(node: NodeGpus, held: Holdings, d: Device) -> float:
    """Seconds until a GPU is expected free for whole-GPU work: 0 if it is, its release if
    held and known, infinity when unknown or when it is lost, in MIG mode or busy."""
    if not d.healthy or d.mig_enabled or d.uuid in node.busy:
        return math.inf
    if d.uuid not in held.exclusive and held.shared.get(d.uuid, 0) == 0:
        return 0.0
    return held.release.get(d.uuid, math.inf)


def _mask(positions: Iterable[int]) -> int:
    out = 0
    for p in positions:
        out |= 1 << p
    return out


class Partitions:
    """Best partitions of sets of positions (bitmasks) into sets of k and at most one
    smaller set of what is left over (go-gpuallocator's padding), scored by their pairs;
    memoised, so that the many rests one decision compares share their work. Ties go to
    the first found, the lowest position always in the next set (go-gpuallocator's
    enumeration order)."""

    def __init__(self, weights: Sequence[Sequence[int]], k: int) -> None:
        self._w = weights
        self._k = k
        self._best = cache(self._search)

    def best(self, mask: int) -> tuple[int, tuple[tuple[int, ...], ...]]:
        """The best total score of such a partition of `mask`, and its full-size sets."""
        return self._best(mask, False)

    def _search(self, mask: int, padded: bool) -> tuple[int, tuple[tuple[int, ...], ...]]:
        members = [p for p in range(mask.bit_length()) if mask >> p & 1]
        if not members:
            return 0, ()
        first, others = members[0], members[1:]
        remainder = len(members) % self._k
        sizes = [(self._k, padded)] + ([(remainder, True)] if remainder and not padded else [])
        top: tuple[int, tuple[tuple[int, ...], ...]] = (-1, ())
        for size, pad in sizes:
            for more in combinations(others, size - 1):
                s = (first, *more)
                below, sets = self._best(mask & ~_mask(s), pad)
                if below < 0:
                    continue
                total = set_score(s, self._w) + below
                if total > top[0]:
                    top = (total, ((s,) if size == self._k else ()) + sets)
        return top


def _indices(node: NodeGpus, s: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(node.devices[p].index for p in s))


class _Leftovers:
    """The best scores of sets of LEFTOVER_SIZES that stay possible after taking a set.

    A best set of the whole free pool that the taken set does not touch is still there,
    so most answers need no search.
    """

    def __init__(self, node: NodeGpus, free: list[int]) -> None:
        self._node = node
        self._free = free
        self._zero = [0] * len(node.devices)
        self._whole: dict[int, tuple[int, list[tuple[int, ...]]]] = {}

    def after(self, taken: Sequence[int]) -> tuple[tuple[int, int], ...]:
        rest = [p for p in self._free if p not in taken]
        out = []
        for k in LEFTOVER_SIZES:
            if not 2 <= k <= len(rest):
                continue
            if k not in self._whole:
                self._whole[k] = _search(self._free, k, self._node.weights, self._zero, True)
            score, best_sets = self._whole[k]
            if not any(set(s).isdisjoint(taken) for s in best_sets):
                score = _search(rest, k, self._node.weights, self._zero, False)[0]
            out.append((k, score))
        return tuple(out)


def _search(
    pool: Sequence[int],
    k: int,
    weights: Sequence[Sequence[int]],
    bonus: Sequence[int],
    all_ties: bool,
) -> tuple[int, list[tuple[int, ...]]]:
    """The best score of a k-set from `pool` (positions) and the sets that reach it: all of
    them in pool order with `all_ties`, else the first. Exact: branch and bound, where the
    bound adds the r best gains still open and r(r-1)/2 times the heaviest pair."""
    n = len(pool)
    if not 0 <= k <= n:
        return -1, []
    w = [[weights[a][b] for b in pool] for a in pool]
    heaviest = max((w[i][j] for i in range(n) for j in range(i + 1, n)), default=0)
    gain = [bonus[a] for a in pool]
    chosen: list[int] = []
    best = -1
    found: list[tuple[int, ...]] = []

    def dfs(start: int, score: int) -> None:
        nonlocal best
        r = k - len(chosen)
        if r == 0:
            if score > best:
                best = score
                found.clear()
            if score == best and (all_ties or not found):
                found.append(tuple(pool[i] for i in chosen))
            return
        open_gains = sorted(gain[start:], reverse=True)[:r]
        bound = score + sum(open_gains) + heaviest * r * (r - 1) // 2
        if bound < best or (bound == best and found and not all_ties):
            return
        for v in range(start, n - r + 1):
            row = w[v]
            chosen.append(v)
            for u in range(v + 1, n):
                gain[u] += row[u]
            dfs(v + 1, score + gain[v])
            for u in range(v + 1, n):
                gain[u] -= row[u]
            chosen.pop()

    dfs(0, 0)
    return best, found


def _place_mig(request: GpuRequest, node: NodeGpus, held: Holdings) -> Placement | Refusal:
    """MIG instances of the profile: packed onto the GPUs whose instances are already in
    use, so that whole MIG GPUs stay free for the next big instance."""
    in_use: dict[str, int] = {}
    open_: list[tuple[int, int, int, Device, str]] = []
    busy = 0
    for d in node.devices:
        if not d.mig_enabled:
            continue
        in_use[d.uuid] = sum(1 for m in d.mig_devices if m.uuid in held.exclusive)
        for m in d.mig_devices:
            if (
                m.profile == request.mig_profile
                and m.healthy
                and d.healthy
                and m.uuid not in held.exclusive
                and d.uuid not in held.exclusive
                and (request.memory is None or (m.memory_total or 0) >= request.memory)
            ):
                if m.uuid in node.busy:
                    busy += 1
                else:
                    open_.append((-in_use[d.uuid], d.index, m.index, d, m.uuid))
    if len(open_) < request.count:
        profiles = sorted({m.profile for d in node.devices for m in d.mig_devices})
        have = f"; this node's MIG profiles: {', '.join(profiles)}" if profiles else ""
        also = f" ({busy} {BUSY})" if busy else ""
        return Refusal(
            f"no {request.count} free MIG instance(s) of profile {request.mig_profile}: "
            f"{len(open_)} free{also}{have}"
        )
    picked = sorted(open_)[: request.count]
    return Placement(
        uuids=tuple(uuid for *_, uuid in picked),
        indices=tuple(d.index for _, _, _, d, _ in picked),
        score=0,
        pair_score=0,
        numa_bonus=0,
        best_possible=0,
        pairs=(),
        numa_nodes=tuple(
            sorted({d.numa_node for _, _, _, d, _ in picked if d.numa_node is not None})
        ),
        reason=f"MIG {request.mig_profile}: packed onto the GPU with the most instances in use",
    )


@dataclass(frozen=True)
class Impossible:
    """A request this node can never satisfy, whatever is held or running."""

    what: str
    """What makes it so: 'count', 'memory', 'shared' or 'mig'."""
    reason: str


def impossible(request: GpuRequest, node: NodeGpus) -> Impossible | None:
    """Why the request could never be placed here, even with nothing held or running (its
    size, its memory, its MIG profile, or GPUs lost for good); None when it could be.
    Unhealthy counts as lost: a lost GPU comes back only after a reset and a restart."""
    if request.count < 1:
        return Impossible("count", "a request needs at least one GPU")
    if request.shared and request.memory is None:
        return Impossible("shared", "a shared request needs a memory size, to pack it")
    if request.mig_profile is not None:
        return _impossible_mig(request, node)
    n = len(node.devices)
    have = f"this node has {n} GPU{'s' if n != 1 else ''}"
    whole = [d for d in node.devices if not d.mig_enabled]
    healthy = [d for d in whole if d.healthy]
    if request.count > n:
        return Impossible("count", have)
    if request.count > len(whole):
        return Impossible(
            "count",
            f"{have}, {n - len(whole)} in MIG mode (given out only as MIG instances)",
        )
    if request.count > len(healthy):
        lost = "; ".join(
            f"GPU {d.index}: {d.reason or 'unhealthy'}" for d in whole if not d.healthy
        )
        return Impossible("count", f"{have}, {len(whole) - len(healthy)} unhealthy ({lost})")
    return _too_small(request, [d.memory_total for d in healthy], "GPU")


def _impossible_mig(request: GpuRequest, node: NodeGpus) -> Impossible | None:
    profile = request.mig_profile
    instances = [
        (d, m) for d in node.devices if d.mig_enabled for m in d.mig_devices if m.profile == profile
    ]
    if not instances:
        profiles = sorted({m.profile for d in node.devices if d.mig_enabled for m in d.mig_devices})
        has = f"its profiles: {', '.join(profiles)}" if profiles else "no GPU here is in MIG mode"
        return Impossible("mig", f"this node has no MIG instances of profile {profile} ({has})")
    healthy = [m for d, m in instances if d.healthy and m.healthy]
    if request.count > len(healthy):
        lost = len(instances) - len(healthy)
        return Impossible(
            "count",
            f"this node has {len(instances)} MIG instance(s) of profile {profile}"
            + (f", {lost} unhealthy" if lost else ""),
        )
    return _too_small(request, [m.memory_total for m in healthy], f"{profile} MIG instance")


def _too_small(request: GpuRequest, sizes: Sequence[int | None], what: str) -> Impossible | None:
    """Too few of the devices (by memory size) have the memory each one must have free."""
    want = request.memory
    if want is None:
        return None
    fits = sum(1 for size in sizes if (size or 0) >= want)
    if fits >= request.count:
        return None
    largest = max((size or 0 for size in sizes), default=0)
    if not fits:
        return Impossible(
            "memory", f"no {what} on this node has {_gib(want)}: the largest has {_gib(largest)}"
        )
    return Impossible("memory", f"only {fits} {what}(s) on this node have {_gib(want)}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}Gi"
