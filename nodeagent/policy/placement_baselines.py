"""The allocators scripts/bench gpu-alloc compares placement with; the daemon uses neither.

first_fit takes the lowest indices that pass the filter. best_effort is NVIDIA
go-gpuallocator's best-effort policy (gpuallocator/besteffort_policy.go): it splits all
available GPUs into sets of the requested size (the remainder padded), keeps the split
with the highest total score, and returns the best set in it; for one GPU it returns
the first available. It sees the topology as go-gpuallocator does: an NVLink counts
only when its far end is the peer GPU, so NVSwitch peers get no NVLink credit.
"""

from __future__ import annotations

from functools import cache
from itertools import combinations

from nodeagent.policy.placement import (
    NVLINK_SCORE,
    PCIE_SCORE,
    GpuRequest,
    Holdings,
    NodeGpus,
    Placement,
    Refusal,
    describe,
    eligible,
    place,
)


def first_fit(request: GpuRequest, node: NodeGpus, held: Holdings) -> Placement | Refusal:
    if request.mig_profile is not None:
        return place(request, node, held)
    pool, refusal = eligible(request, node, held)
    if refusal is not None:
        return refusal
    return describe(request, node, pool[: request.count], "first fit: the lowest indices")


def best_effort(request: GpuRequest, node: NodeGpus, held: Holdings) -> Placement | Refusal:
    if request.mig_profile is not None:
        return place(request, node, held)
    pool, refusal = eligible(request, node, held)
    if refusal is not None:
        return refusal
    k = request.count
    if k == 1:
        return describe(request, node, pool[:1], "best effort: the first available GPU")
    seen = [[_reference_weight(node, a, b) for b in pool] for a in pool]
    chosen = _best_set_of_best_partition(len(pool), k, seen)
    return describe(
        request, node, [pool[i] for i in chosen], "best effort: best set of the best partition"
    )


def _reference_weight(node: NodeGpus, a: int, b: int) -> int:
    if a == b:
        return 0
    link = node.topology.link(node.devices[a].index, node.devices[b].index)
    return PCIE_SCORE[link.pcie] + (0 if link.nvswitch else NVLINK_SCORE * link.nvlinks)


def _best_set_of_best_partition(n: int, k: int, w: list[list[int]]) -> tuple[int, ...]:
    """go-gpuallocator's search, as a memoised recursion instead of its enumeration: the
    lowest GPU left goes into a full set, or into the one padded set of n % k GPUs."""
    remainder = n % k

    def score(s: tuple[int, ...]) -> int:
        return sum(w[a][b] for i, a in enumerate(s) for b in s[i + 1 :])

    @cache
    def best(mask: int, padded: bool) -> tuple[int, tuple[tuple[int, ...], ...]]:
        if mask == 0:
            return (0, ()) if padded or remainder == 0 else (-1, ())
        members = [i for i in range(n) if mask >> i & 1]
        first, rest = members[0], members[1:]
        top: tuple[int, tuple[tuple[int, ...], ...]] = (-1, ())
        sizes = [(k, padded)] + ([(remainder, True)] if remainder and not padded else [])
        for size, pad in sizes:
            for others in combinations(rest, size - 1):
                s = (first, *others)
                sub_score, sub_sets = best(mask & ~sum(1 << i for i in s), pad)
                if sub_score < 0:
                    continue
                total = score(s) + sub_score
                if total > top[0]:
                    top = (total, ((s,) if size == k else ()) + sub_sets)
        return top

    _, sets = best((1 << n) - 1, False)
    return max(sets, key=score)
