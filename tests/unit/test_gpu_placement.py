"""GPU placement: exact, never worse than go-gpuallocator's best effort, leftover-aware,
NVSwitch-aware, and MIG and shared packing; pure (its imports are a lint error otherwise)."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import pytest
from benchref.placement_baselines import best_effort, first_fit
from hypothesis import given, settings
from hypothesis import strategies as st
from test_policy_purity import unflagged

from nodeagent.gpu.model import (
    Device,
    GpuProcess,
    GpuState,
    Hold,
    HoldKind,
    Link,
    MigDevice,
    PcieLevel,
    Topology,
)
from nodeagent.gpu.simulated import load_simulated
from nodeagent.gpualloc.placement import (
    NUMA_SCORE,
    PARTITION_MAX,
    GpuRequest,
    Holdings,
    NodeGpus,
    Placement,
    Refusal,
    impossible,
    pair_score,
    place,
)
from nodeagent.gpualloc.service import node_of

GPUS = Path(__file__).resolve().parents[2] / "config" / "gpus"
GIB = 1024**3


def shipped(name: str) -> NodeGpus:
    b = load_simulated(GPUS / name)
    return NodeGpus(b.inventory(), b.topology())


def placed(result: Placement | Refusal) -> Placement:
    assert isinstance(result, Placement), result
    return result


def device(i: int, numa: int = 0, memory: int = 80 * GIB, **kw: object) -> Device:
    return Device(
        index=i,
        uuid=f"GPU-{i}",
        name="T",
        pci_bus_id=f"00000000:{i + 16:02X}:00.0",
        minor=i,
        memory_total=memory,
        numa_node=numa,
        cpus=(),
        mig_enabled=False,
        **kw,  # type: ignore[arg-type]
    )


def busy(*indices: int) -> Holdings:
    return Holdings(exclusive=frozenset(f"GPU-{i}" for i in indices))


def taken(node: NodeGpus, *indices: int) -> Holdings:
    return Holdings(exclusive=frozenset(node.devices[i].uuid for i in indices))


@st.composite
def nodes(draw: st.DrawFn, max_gpus: int = 8, pairs_only: bool = False) -> NodeGpus:
    """Random topologies: PCIe levels and NVLink counts per pair; with `pairs_only` every
    GPU has at most one NVLink partner."""
    n = draw(st.integers(1, max_gpus))
    numa = [draw(st.integers(0, 1)) for _ in range(n)]
    links: dict[tuple[int, int], Link] = {}
    partner: dict[int, int] = {}
    if pairs_only:
        order = draw(st.permutations(range(n)))
        for a, b in zip(order[::2], order[1::2], strict=False):
            if draw(st.booleans()):
                partner[a], partner[b] = b, a
    for a in range(n):
        for b in range(a + 1, n):
            level = draw(st.sampled_from(PcieLevel))
            if pairs_only:
                nv = draw(st.integers(1, 4)) if partner.get(a) == b else 0
            else:
                nv = draw(st.sampled_from([0, 0, 1, 2, 4]))
            links[a, b] = Link(level, nv)
    devices = tuple(device(i, numa[i], healthy=draw(st.booleans()) or i % 3 != 0) for i in range(n))
    return NodeGpus(devices, Topology(links))


def brute_force(node: NodeGpus, request: GpuRequest, held: Holdings) -> int:
    """The score placement must reach, by trying every set of the eligible GPUs: the best,
    or, for several GPUs out of at most PARTITION_MAX, the best of the sets that score best
    with the best partition of the rest into sets of the same size."""
    pool = [p for p, d in enumerate(node.devices) if d.healthy and d.uuid not in held.exclusive]
    bonus = [NUMA_SCORE if d.numa_node in request.cpu_numa_nodes else 0 for d in node.devices]
    k = request.count

    def own(s: tuple[int, ...]) -> int:
        return sum(node.weights[a][b] for a, b in combinations(s, 2)) + sum(bonus[p] for p in s)

    sets = list(combinations(pool, k))
    if not (k >= 2 and k < len(pool) <= PARTITION_MAX):
        return max(own(s) for s in sets)
    total = {s: own(s) + every_partition(sorted(set(pool) - set(s)), k, node) for s in sets}
    return max(own(s) for s in sets if total[s] == max(total.values()))


def every_partition(members: list[int], k: int, node: NodeGpus, padded: bool = False) -> int:
    """The best split of `members` into sets of k and at most one set of the len % k left
    over, tried every way (-1: no such split)."""
    if not members:
        return 0
    first, others = members[0], members[1:]
    left_over = len(members) % k
    totals = [-1]
    for size in [k] + ([left_over] if left_over and not padded else []):
        for more in combinations(others, size - 1):
            below = every_partition(
                [m for m in others if m not in more], k, node, padded or size != k
            )
            if below >= 0:
                totals.append(
                    sum(node.weights[a][b] for a, b in combinations((first, *more), 2)) + below
                )
    return max(totals)


@settings(max_examples=300, deadline=None)
@given(nodes(pairs_only=True), st.data())
def test_one_gpu_never_splits_an_nvlink_pair_while_a_lone_gpu_is_free(
    node: NodeGpus, data: st.DataObject
) -> None:
    n = len(node.devices)
    held = busy(*data.draw(st.sets(st.integers(0, n - 1), max_size=n - 1)))
    free = {d.index for d in node.devices if d.healthy and d.uuid not in held.exclusive}
    if not free:
        return

    def lone(i: int) -> bool:
        return not any(node.topology.link(i, j).nvlinks for j in free - {i})

    (chosen,) = placed(place(GpuRequest(), node, held)).indices
    if any(lone(i) for i in free):
        assert lone(chosen)


def test_one_gpu_examples() -> None:
    pairs = shipped("4x-a100-two-nvlink-pairs.yaml")
    assert placed(place(GpuRequest(), pairs, taken(pairs, 0))).indices == (1,)
    assert placed(place(GpuRequest(), pairs, taken(pairs, 2))).indices == (3,)
    # go-gpuallocator takes the first free GPU and splits the other pair
    assert placed(best_effort(GpuRequest(), pairs, taken(pairs, 2))).indices == (0,)


def test_leftovers_then_pcie_affinity_break_ties() -> None:
    """8x PCIe, GPU 6 taken: taking 4, 5 or 7 leaves socket 0 whole; 7 is alone under its
    switch, so taking it leaves the pair 4-5 whole too."""
    node = shipped("8x-l40s-pcie-dual-socket.yaml")
    result = placed(place(GpuRequest(), node, taken(node, 6)))
    assert result.indices == (7,)
    assert "leaves best 4-GPU set 180" in result.reason
    assert placed(first_fit(GpuRequest(), node, taken(node, 6))).indices == (0,)


def test_nvswitch_peers_all_count_as_nvlink_connected() -> None:
    node = shipped("dgx-h100-nvswitch.yaml")
    result = placed(place(GpuRequest(count=4), node, taken(node, 1, 6)))
    assert all(p.link.nvswitch and p.link.nvlinks == 18 for p in result.pairs)
    assert all(p.score == pair_score(p.link) >= 1800 for p in result.pairs)
    # three free GPUs per socket: the two whole PXB pairs (2-3, 4-5) would score 10 more, but
    # three GPUs of socket 0 and GPU 7 leave the PXB pair 4-5 whole for the next job: 10910
    # and 1840 left beat 10920 and 1810 left (0-7 across sockets)
    assert result.indices == (0, 2, 3, 7)
    assert result.pair_score == 6 * 1800 + 40 + 2 * 20 + 3 * 10
    assert "the best set now scores 10920" in result.reason
    # with the same PCIe view, go-gpuallocator's best effort sees no NVLink at all
    theirs = placed(best_effort(GpuRequest(count=2), node, Holdings()))
    assert theirs.pair_score == placed(place(GpuRequest(count=2), node, Holdings())).pair_score


def test_dgx1_pairs_and_quads() -> None:
    node = shipped("dgx1-v100-hybrid-cube-mesh.yaml")
    two = placed(place(GpuRequest(count=2), node, Holdings()))
    assert two.indices == (2, 3) and two.pair_score == 250  # NV2 under one PCIe switch
    four = placed(place(GpuRequest(count=4), node, taken(node, 0)))
    assert four.indices == (4, 5, 6, 7)
    assert four.fraction == 1.0


def test_a_multi_gpu_set_leaves_the_rest_to_pair_well() -> None:
    """DGX-1, one quad free: the NV2 pair under one switch (2-3, 250) would leave the NV1
    pair 0-1 (150) to the next job; 0-3 and 1-2 (220 each) are the better split."""
    node = shipped("dgx1-v100-hybrid-cube-mesh.yaml")
    result = placed(place(GpuRequest(count=2), node, taken(node, 4, 5, 6, 7)))
    assert result.indices == (0, 3) and result.pair_score == 220
    assert "the best set now scores 250" in result.reason
    assert "would score 150 after it and 220 after this one" in result.reason
    # go-gpuallocator's best effort splits the quad the same way
    assert placed(best_effort(GpuRequest(count=2), node, taken(node, 4, 5, 6, 7))).pair_score == 220


def released(node: NodeGpus, **back: float | None) -> Holdings:
    """GPUs held (by index, as g0=..., g1=...), each expected back in so many seconds
    (None: unknown)."""
    held = {node.devices[int(k[1:])].uuid: t for k, t in back.items()}
    return Holdings(
        exclusive=frozenset(held), release={u: t for u, t in held.items() if t is not None}
    )


def test_a_waiting_request_waits_for_a_much_better_set_expected_soon() -> None:
    node = shipped("dgx1-v100-hybrid-cube-mesh.yaml")
    # free: 0-1 (NV1, 150); 2-3 (NV2 under one switch, 250) expected back in 2 s
    held = released(node, g2=2.0, g3=2.0, g4=None, g5=None, g6=None, g7=None)
    waits = place(GpuRequest(count=2, expected_duration=10, patience=3), node, held)
    assert isinstance(waits, Refusal) and waits.better_in == 2.0
    assert waits.reason == (
        "waits for GPUs 2, 3: expected free within 2s, they score 250 against 150 for the "
        "best set now (patience left 3s)"
    )
    # not within its patience, no patience, or nothing known of when they are back: 0-1
    for request, holdings in (
        (GpuRequest(count=2, patience=1.5), held),
        (GpuRequest(count=2), held),
        (GpuRequest(count=2, patience=3), taken(node, 2, 3, 4, 5, 6, 7)),
    ):
        assert placed(place(request, node, holdings)).indices == (0, 1)


def test_patience_only_for_a_set_that_scores_enough_more() -> None:
    """0-3 (220) free, 2-3 (250) soon: 30 more is 12% of the best pair, worth waiting for;
    with 1-2 (220) free beside it instead, 4-7 (220) soon is no better."""
    node = shipped("dgx1-v100-hybrid-cube-mesh.yaml")
    soon = released(node, g1=None, g2=1.0, g4=None, g5=None, g6=None, g7=None)
    assert isinstance(place(GpuRequest(count=2, patience=5), node, soon), Refusal)
    same = released(node, g0=None, g3=None, g5=None, g6=None, g4=1.0, g7=1.0)
    assert placed(place(GpuRequest(count=2, patience=5), node, same)).indices == (1, 2)


def test_an_expected_duration_lines_up_with_the_neighbours_ends() -> None:
    """8x L40S, GPU 1 back in 0.5 s and GPU 5 in 10 s: an 8-second job joins GPU 5's pair
    and socket, which are busy past its end anyway, and leaves 0-1 and socket 0 to free
    together; not knowing how long it runs, it takes the lowest index."""
    node = shipped("8x-l40s-pcie-dual-socket.yaml")
    held = released(node, g1=0.5, g5=10.0)
    long = placed(place(GpuRequest(expected_duration=8.0), node, held))
    assert long.indices == (4,)
    assert "its 8s expected hold delays the node's best blocks least" in long.reason
    assert placed(place(GpuRequest(), node, held)).indices == (0,)
    # a holder whose end is unknown counts as busy for long: the job joins it
    unknown = released(node, g1=0.5, g5=None)
    assert placed(place(GpuRequest(expected_duration=8.0), node, unknown)).indices == (4,)


def test_one_gpu_with_a_known_duration_joins_the_quad_busy_past_its_end() -> None:
    """DGX-1, GPU 0 held for 10 s more, one GPU for 8 s: GPU 1 joins quad 0-3, busy past
    the job's end anyway, and leaves quad 4-7 whole for the next four-GPU job. Its pairs
    left (690) are go-gpuallocator's (it takes GPU 1 too), never fewer; not knowing the
    duration, GPU 4, whose pairs left are best (710)."""
    node = shipped("dgx1-v100-hybrid-cube-mesh.yaml")
    held = released(node, g0=10.0)
    known = placed(place(GpuRequest(expected_duration=8.0), node, held))
    assert known.indices == (1,)
    assert "leaves pairs 690" in known.reason
    assert "its 8s expected hold delays the node's best blocks least" in known.reason
    assert placed(place(GpuRequest(), node, held)).indices == (4,)


def test_numa_alignment_with_the_jobs_cpus() -> None:
    node = shipped("dgx-h100-nvswitch.yaml")
    result = placed(place(GpuRequest(count=2, cpu_numa_nodes=frozenset({1})), node, Holdings()))
    assert result.indices == (4, 5)
    assert (result.numa_bonus, result.numa_nodes) == (2 * NUMA_SCORE, (1,))
    assert result.score == result.pair_score + result.numa_bonus


def test_refusals_say_why() -> None:
    node = NodeGpus(
        (
            device(0),
            device(1, healthy=False, reason="critical Xid 79"),
            device(2, memory=16 * GIB),
            device(3),
        ),
        Topology(),
    )
    result = place(GpuRequest(count=3, memory=40 * GIB), node, busy(3))
    assert isinstance(result, Refusal)
    assert result.reason == (
        "no 3 GPUs free now: 1 of 4 eligible (1 unhealthy, 1 with less than 40.0Gi free, 1 held)"
    )
    assert place(GpuRequest(count=0), node, Holdings()) == Refusal(
        "a request needs at least one GPU"
    )


def test_free_memory_counts_what_is_used_now() -> None:
    node = NodeGpus((device(0), device(1)), Topology(), memory_used={"GPU-0": 70 * GIB})
    assert placed(place(GpuRequest(memory=20 * GIB), node, Holdings())).indices == (1,)


def test_shared_jobs_pack_by_memory() -> None:
    node = shipped("4x-a100-two-nvlink-pairs.yaml")
    uuids = [d.uuid for d in node.devices]
    small = GpuRequest(memory=10 * GIB, shared=True)
    # nothing shared yet: open the GPU that hurts the pairs least (all alike here: GPU 0)
    first = placed(place(small, node, Holdings()))
    assert first.indices == (0,)
    # best fit among GPUs already shared: GPU 2 has the least room that still fits
    held = Holdings(shared={uuids[0]: 30 * GIB, uuids[2]: 60 * GIB})
    assert placed(place(small, node, held)).indices == (2,)
    # a GPU whose partner is shared is the one to open next
    big = GpuRequest(memory=75 * GIB, shared=True)
    assert placed(place(big, node, held)).indices == (1,)
    # exclusive requests never land on a shared GPU
    assert placed(place(GpuRequest(count=2), node, held)).indices == (1, 3)
    assert place(GpuRequest(shared=True), node, held) == Refusal(
        "a shared request needs a memory size, to pack it"
    )


def mig_node() -> NodeGpus:
    def gpu(i: int) -> Device:
        migs = tuple(
            MigDevice(f"MIG-{i}-{slot}", f"GPU-{i}", slot, profile, 10 * GIB * size)
            for slot, (profile, size) in enumerate([("3g.40gb", 4), ("1g.10gb", 1), ("1g.10gb", 1)])
        )
        return Device(i, f"GPU-{i}", "H100", "", i, 80 * GIB, 0, (), True, migs)

    return NodeGpus((gpu(0), gpu(1), device(2)), Topology())


def test_mig_instances_pack_onto_gpus_in_use() -> None:
    node = mig_node()
    one = GpuRequest(mig_profile="1g.10gb")
    assert placed(place(one, node, Holdings())).uuids == ("MIG-0-1",)
    held = Holdings(exclusive=frozenset({"MIG-1-0"}))
    result = placed(place(one, node, held))
    assert (result.uuids, result.indices) == (("MIG-1-1",), (1,))
    assert result.fraction == 1.0
    full = Holdings(exclusive=frozenset({"MIG-0-1", "MIG-0-2", "MIG-1-1", "MIG-1-2"}))
    refusal = place(one, node, full)
    assert refusal == Refusal(
        "no 1 free MIG instance(s) of profile 1g.10gb: 0 free; "
        "this node's MIG profiles: 1g.10gb, 3g.40gb"
    )
    # whole-GPU requests skip GPUs in MIG mode
    assert placed(place(GpuRequest(), node, Holdings())).indices == (2,)
    assert isinstance(place(GpuRequest(count=2), node, Holdings()), Refusal)


def test_shipped_mig_node() -> None:
    node = shipped("h100-mig.yaml")
    result = placed(place(GpuRequest(mig_profile="2g.20gb"), node, Holdings()))
    assert result.uuids == (node.devices[0].mig_devices[1].uuid,)
    assert result.uuids[0].startswith("MIG-")


@pytest.mark.parametrize("name", sorted(p.name for p in GPUS.glob("*.yaml")))
def test_an_empty_node_gets_the_best_set_for_every_size(name: str) -> None:
    node = shipped(name)
    whole = [d for d in node.devices if not d.mig_enabled]
    for k in (1, 2, 4, 8):
        if k <= len(whole):
            assert placed(place(GpuRequest(count=k), node, Holdings())).fraction == 1.0


def test_gpu_modules_that_do_io_are_banned_in_the_policy_package() -> None:
    assert (
        unflagged(
            [
                "from nodeagent.gpu.nvml import open_nvml",
                "from nodeagent.gpu import simulated",
                "from nodeagent.gpu.backend import GpuBackend",
                "from nodeagent.gpu.choice import open_backend",
                "import nodeagent.gpu.procs",
                "from nodeagent.policyfile.yamlfile import read_text",
            ]
        )
        == []
    )
    assert unflagged(["from nodeagent.gpu.model import Device"]) == [
        "from nodeagent.gpu.model import Device"
    ]


def with_processes(node: NodeGpus, *on: tuple[int, str], holds: tuple[Hold, ...] = ()) -> NodeGpus:
    """The node as a tick sees it with compute processes (pid, device UUID) on it."""
    processes = tuple(GpuProcess(pid, uuid, GIB, "system.slice/x.scope") for pid, uuid in on)
    state = GpuState(node.devices, node.topology, (), processes, holds, "test", True)
    return node_of(state) or node


def test_exclusive_requests_pass_over_gpus_with_processes_outside_any_hold() -> None:
    node = shipped("4x-a100-two-nvlink-pairs.yaml")
    uuids = [d.uuid for d in node.devices]
    seen = with_processes(node, (31337, uuids[0]), (4711, uuids[2]))
    one = placed(place(GpuRequest(), seen, Holdings()))
    assert one.indices == (1,)
    assert one.reason.endswith(
        "; passed over busy GPU 0 (pid 31337), GPU 2 (pid 4711): compute processes outside any hold"
    )
    assert placed(place(GpuRequest(count=2), seen, Holdings())).indices == (1, 3)
    assert place(GpuRequest(count=3), seen, Holdings()) == Refusal(
        "no 3 GPUs free now: 2 of 4 eligible (2 busy with compute processes outside any hold)"
    )
    # a shared request packs by memory beside what runs there
    shared = GpuRequest(memory=10 * GIB, shared=True)
    assert placed(place(shared, seen, Holdings())).indices == (0,)


def test_processes_of_a_hold_make_its_gpus_held_not_busy() -> None:
    node = shipped("4x-a100-two-nvlink-pairs.yaml")
    uuids = [d.uuid for d in node.devices]
    job = Hold("train", HoldKind.JOB, (uuids[0],), (0,), cgroup="nodeagent.slice/train")
    seen = with_processes(node, (31337, uuids[0]), holds=(job,))
    assert seen.busy == {}
    # once the hold is gone (the job ended) the GPU is free: nothing else runs there
    result = placed(place(GpuRequest(count=2), seen, Holdings()))
    assert result.indices == (0, 1)
    # a hold's process on a GPU the hold does not have makes that GPU busy
    stray = with_processes(node, (31337, uuids[1]), holds=(job,))
    assert stray.busy == {uuids[1]: (31337,)}


def test_a_busy_mig_instance_is_passed_over() -> None:
    node = mig_node()
    seen = with_processes(node, (7, "MIG-0-1"))
    assert placed(place(GpuRequest(mig_profile="1g.10gb"), seen, Holdings())).uuids == ("MIG-0-2",)
    full = Holdings(exclusive=frozenset({"MIG-0-2", "MIG-1-1", "MIG-1-2"}))
    refusal = place(GpuRequest(mig_profile="1g.10gb"), seen, full)
    assert isinstance(refusal, Refusal)
    assert "0 free (1 busy with compute processes outside any hold)" in refusal.reason


@settings(max_examples=300, deadline=None)
@given(
    nodes(),
    st.integers(1, 9),
    st.sampled_from([None, 16 * GIB, 80 * GIB, 81 * GIB]),
    st.booleans(),
)
def test_impossible_exactly_when_an_idle_node_could_not_place_it(
    node: NodeGpus, count: int, memory: int | None, shared: bool
) -> None:
    request = GpuRequest(count, memory, shared and memory is not None)
    could = isinstance(place(request, node, Holdings()), Placement)
    assert (impossible(request, node) is None) == could


@pytest.mark.parametrize(
    ("request_", "what", "reason"),
    [
        (GpuRequest(count=4), "count", "this node has 3 GPUs"),
        (
            GpuRequest(count=2),
            "count",
            "this node has 3 GPUs, 2 in MIG mode (given out only as MIG instances)",
        ),
        (
            GpuRequest(memory=81 * GIB),
            "memory",
            "no GPU on this node has 81.0Gi: the largest has 80.0Gi",
        ),
        (
            GpuRequest(mig_profile="7g.80gb"),
            "mig",
            "this node has no MIG instances of profile 7g.80gb (its profiles: 1g.10gb, 3g.40gb)",
        ),
        (
            GpuRequest(count=5, mig_profile="1g.10gb"),
            "count",
            "this node has 4 MIG instance(s) of profile 1g.10gb",
        ),
        (
            GpuRequest(count=2, mig_profile="3g.40gb", memory=41 * GIB),
            "memory",
            "no 3g.40gb MIG instance on this node has 41.0Gi: the largest has 40.0Gi",
        ),
        (GpuRequest(shared=True), "shared", "a shared request needs a memory size, to pack it"),
    ],
)
def test_impossible_says_what_the_node_lacks(request_: GpuRequest, what: str, reason: str) -> None:
    never = impossible(request_, mig_node())
    assert never is not None and (never.what, never.reason) == (what, reason)
    assert impossible(GpuRequest(count=4, mig_profile="1g.10gb"), mig_node()) is None


def test_an_unhealthy_gpu_makes_a_request_for_every_gpu_impossible() -> None:
    node = NodeGpus((device(0), device(1, healthy=False, reason="critical Xid 79")), Topology())
    never = impossible(GpuRequest(count=2), node)
    assert never is not None
    assert never.reason == "this node has 2 GPUs, 1 unhealthy (GPU 1: critical Xid 79)"
