"""The allocators scripts/bench gpu-alloc compares placement with; the daemon uses neither.

first_fit takes the lowest indices that pass the filter. best_effort is NVIDIA
go-gpuallocator's best-effort policy (gpuallocator/besteffort_policy.go): it splits all
available GPUs into sets of the requested size (the remainder padded), keeps the split
with the highest total score, and returns the best set in it; for one GPU it returns
the first available. It sees the topology as go-gpuallocator does: an NVLink counts
only when its far end is the peer GPU, so NVSwitch peers get no NVLink credit.
"""

from __future__ import annotations

from nodeagent.gpualloc.placement import (
    NVLINK_SCORE,
    PCIE_SCORE,
    GpuRequest,
    Holdings,
    NodeGpus,
    Partitions,
    Placement,
    Refusal,
    describe,
    eligible,
    place,
    set_score,
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
    best partition into sets of k (and one padded set), then its best set."""
    _, sets = Partitions(w, k).best((1 << n) - 1)
    return max(sets, key=lambda s: set_score(s, w))
