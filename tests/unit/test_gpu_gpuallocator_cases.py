"""go-gpuallocator's own best-effort test cases, as data, against nodeagent's placement.

Ported from NVIDIA/go-gpuallocator at commit 876e7b7 (gpuallocator/common_test.go: the
DGX-1 Volta, DGX-1 Pascal and 4x RTX 8000 test nodes; gpuallocator/besteffort_test.go:
TestBestEffortAllocate and the TestBestEffort*GPUAlloc* sequences). Each case is a state
(the GPUs available, every other one held) and a size, with the set go-gpuallocator's best
effort returns. From that same state nodeagent must never take a worse set (scored with
go-gpuallocator's own weights), and for one GPU must never leave worse pairs for the next
jobs (the best split of the GPUs still available into pairs, by the same weights). Our
port of best effort (placement_baselines.best_effort) must return the reference's set.

Left out: TestBestEffortAllocate's seven "must include" cases, which pass a set of GPUs
the answer has to contain (the device plugin's GetPreferredAllocation); a nodeagent request
has no such set. The iterate* tests check go-gpuallocator's enumeration helpers, not a
placement.
"""

from __future__ import annotations

from itertools import combinations

import pytest
from benchref.placement_baselines import best_effort
from test_gpu_placement import device, shipped

from nodeagent.gpu.model import Link, PcieLevel, Topology
from nodeagent.gpualloc.placement import GpuRequest, Holdings, NodeGpus, Placement, Refusal, place

P2P = {
    "CrossCPU": (PcieLevel.SYS, 10),
    "SameCPU": (PcieLevel.NODE, 20),
    "HostBridge": (PcieLevel.PHB, 30),
    "MultiSwitch": (PcieLevel.PXB, 40),
    "SingleSwitch": (PcieLevel.PIX, 50),
}
"""go-gpuallocator's P2P link types: nvidia-smi's level and the type's score."""

# common_test.go, pairs as (a, b): NVLinks (SingleNVLINKLink 1, TwoNVLINKLinks 2) and the
# P2P link type; the Go node adds each link in both directions.
DGX1_VOLTA_NVLINKS = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2,
    (2, 3): 2, (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2,
    (5, 7): 1, (6, 7): 2,
}  # fmt: skip
DGX1_VOLTA_P2P = {
    (0, 1): "SingleSwitch", (0, 2): "HostBridge", (0, 3): "HostBridge",
    (1, 2): "HostBridge", (1, 3): "HostBridge", (2, 3): "SingleSwitch",
    (4, 5): "SingleSwitch", (4, 6): "HostBridge", (4, 7): "HostBridge",
    (5, 6): "HostBridge", (5, 7): "HostBridge", (6, 7): "SingleSwitch",
}  # fmt: skip
DGX1_PASCAL_NVLINKS = {
    (0, 1): 1, (0, 2): 1, (0, 3): 1, (0, 4): 1, (1, 2): 1, (1, 3): 1, (1, 5): 1,
    (2, 3): 1, (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 1, (5, 6): 1,
    (5, 7): 1, (6, 7): 1,
}  # fmt: skip
DGX1_PASCAL_P2P = {
    (0, 1): "HostBridge", (0, 2): "SingleSwitch", (0, 3): "HostBridge",
    (1, 2): "HostBridge", (1, 3): "SingleSwitch", (2, 3): "HostBridge",
    (4, 5): "HostBridge", (4, 6): "SingleSwitch", (4, 7): "HostBridge",
    (5, 6): "HostBridge", (5, 7): "SingleSwitch", (6, 7): "HostBridge",
}  # fmt: skip
RTX8000_NVLINKS = {(0, 3): 2, (1, 2): 2}
RTX8000_P2P = {(0, 1): "SameCPU", (0, 2): "CrossCPU", (1, 3): "CrossCPU", (2, 3): "SameCPU"}


class GoNode:
    """A go-gpuallocator test node: nodeagent's view of it, and the reference's weights.
    Pairs the Go node leaves without a P2P link type are across sockets (CrossCPU) on the
    DGX-1s; on the RTX 8000 node only its NVLink pairs lack one, and the reference scores
    them by their NVLinks alone (nodeagent's model gives every pair a PCIe level: SYS)."""

    def __init__(
        self,
        n: int,
        nvlinks: dict[tuple[int, int], int],
        p2p: dict[tuple[int, int], str],
        default: str | None,
    ) -> None:
        self.n = n
        self.weight: dict[tuple[int, int], int] = {}
        links: dict[tuple[int, int], Link] = {}
        for pair in combinations(range(n), 2):
            kind = p2p.get(pair, default)
            level, points = P2P[kind] if kind else (PcieLevel.SYS, 0)
            links[pair] = Link(level, nvlinks.get(pair, 0))
            self.weight[pair] = points + 100 * nvlinks.get(pair, 0)
        devices = tuple(device(i) for i in range(n))
        self.node = NodeGpus(devices, Topology(links))

    def score(self, gpus: tuple[int, ...]) -> int:
        return sum(self.weight[pair] for pair in combinations(sorted(gpus), 2))

    def pairs_left(self, available: tuple[int, ...]) -> int:
        """The best split of `available` into pairs (one GPU left alone when odd)."""
        if len(available) < 2:
            return 0
        first, rest = available[0], available[1:]
        best = self.pairs_left(rest) if len(available) % 2 else -1
        for other in rest:
            left = tuple(g for g in rest if g != other)
            best = max(best, self.score((first, other)) + self.pairs_left(left))
        return best

    def held(self, available: tuple[int, ...]) -> Holdings:
        return Holdings(frozenset(f"GPU-{i}" for i in range(self.n) if i not in available))


NODES = {
    "dgx1-volta": GoNode(8, DGX1_VOLTA_NVLINKS, DGX1_VOLTA_P2P, "CrossCPU"),
    "dgx1-pascal": GoNode(8, DGX1_PASCAL_NVLINKS, DGX1_PASCAL_P2P, "CrossCPU"),
    "4x-rtx8000": GoNode(4, RTX8000_NVLINKS, RTX8000_P2P, None),
}

# TestBestEffortAllocate, the cases without required GPUs: (name, available, size, result).
POLICY_CASES: list[tuple[str, tuple[int, ...], int, tuple[int, ...]]] = [
    ("Single NVLINK, prefer same switch", (0, 2, 4, 5), 2, (4, 5)),
    ("Single NVLINK, prefer same socket", (0, 4, 5, 6), 2, (5, 6)),
    ("Prefer dual NVLINK same socket", (0, 3, 1), 2, (0, 3)),
    ("Prefer dual NVLINK cross socket", (0, 1, 4), 2, (0, 4)),
]

# TestBestEffort<Node>GPUAlloc<Size>: from a whole node, each size asked in turn gets the
# result, and keeps it; an empty result is a refusal.
SEQUENCES: dict[tuple[str, int], list[tuple[int, tuple[int, ...]]]] = {
    ("4x-rtx8000", 1): [(1, (0,)), (1, (1,)), (1, (2,)), (1, (3,)), (1, ())],
    ("4x-rtx8000", 2): [(2, (0, 3)), (2, (1, 2)), (1, ())],
    ("4x-rtx8000", 4): [(4, (0, 1, 2, 3)), (1, ())],
    ("dgx1-pascal", 1): [(1, (i,)) for i in range(8)] + [(1, ())],
    ("dgx1-pascal", 2): [(2, (0, 2)), (2, (1, 3)), (2, (4, 6)), (2, (5, 7)), (1, ())],
    ("dgx1-pascal", 4): [(4, (0, 1, 2, 3)), (4, (4, 5, 6, 7)), (1, ())],
    ("dgx1-pascal", 8): [(8, tuple(range(8))), (1, ())],
    ("dgx1-volta", 1): [(1, (i,)) for i in range(8)] + [(1, ())],
    ("dgx1-volta", 2): [(2, (0, 3)), (2, (1, 2)), (2, (4, 7)), (2, (5, 6)), (1, ())],
    ("dgx1-volta", 4): [(4, (0, 1, 2, 3)), (4, (4, 5, 6, 7)), (1, ())],
    ("dgx1-volta", 8): [(8, tuple(range(8))), (1, ())],
}


def cases() -> list[tuple[str, str, tuple[int, ...], int, tuple[int, ...]]]:
    """Every case as (id, node, available, size, the reference's result)."""
    out = [
        (name, "dgx1-volta", available, size, result)
        for name, available, size, result in POLICY_CASES
    ]
    for (node, size), steps in SEQUENCES.items():
        available = tuple(range(NODES[node].n))
        for i, (asked, result) in enumerate(steps):
            out.append((f"{node} alloc {size}, step {i + 1}", node, available, asked, result))
            available = tuple(g for g in available if g not in result)
    return out


@pytest.mark.parametrize(
    ("node_name", "available", "size", "result"),
    [case[1:] for case in cases()],
    ids=[case[0] for case in cases()],
)
def test_never_a_worse_set_nor_worse_pairs_left(
    node_name: str, available: tuple[int, ...], size: int, result: tuple[int, ...]
) -> None:
    go = NODES[node_name]
    ours = place(GpuRequest(count=size), go.node, go.held(available))
    theirs = best_effort(GpuRequest(count=size), go.node, go.held(available))
    if not result:
        assert isinstance(ours, Refusal) and isinstance(theirs, Refusal)
        return
    assert isinstance(ours, Placement) and isinstance(theirs, Placement)
    assert theirs.indices == result, "our port of best effort answers as go-gpuallocator does"
    assert set(ours.indices) <= set(available)
    assert go.score(ours.indices) >= go.score(result)
    if size == 1:
        left = tuple(g for g in available if g not in ours.indices)
        reference_left = tuple(g for g in available if g not in result)
        assert go.pairs_left(left) >= go.pairs_left(reference_left), (ours.indices, result)


def test_the_shipped_dgx1_with_gpus_1_to_7_free_keeps_the_better_pairs() -> None:
    """Regression: on the shipped DGX-1, GPU 0 held, one GPU asked. nodeagent took GPU 3
    (fewest NVLinks cut), leaving pairs worth 660 ({1,2}, {4,7}, {5,6}); go-gpuallocator
    takes GPU 1 and leaves 690 ({2,3}, {4,7}, {5,6}); GPU 4 leaves 710 ({2,3}, {6,7},
    {1,5})."""
    node = shipped("dgx1-v100-hybrid-cube-mesh.yaml")
    held = Holdings(frozenset({node.devices[0].uuid}))

    def pairs_left(taken: int) -> int:
        free = [p for p in range(1, 8) if p != taken]
        return max(sum(node.weights[a][b] for a, b in split) for split in _pairings(free))

    ours = place(GpuRequest(), node, held)
    theirs = best_effort(GpuRequest(), node, held)
    assert isinstance(ours, Placement) and isinstance(theirs, Placement)
    assert theirs.indices == (1,) and pairs_left(1) == 690
    assert pairs_left(ours.indices[0]) >= pairs_left(theirs.indices[0])
    assert ours.indices == (4,) and pairs_left(4) == 710
    assert "leaves pairs 710" in ours.reason


def _pairings(gpus: list[int]) -> list[list[tuple[int, int]]]:
    """Every way to split an even number of GPUs into pairs."""
    if not gpus:
        return [[]]
    first, rest = gpus[0], gpus[1:]
    return [
        [(first, other), *more]
        for other in rest
        for more in _pairings([g for g in rest if g != other])
    ]
