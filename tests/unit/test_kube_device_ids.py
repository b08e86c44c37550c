"""The NVIDIA device plugin's device ids under each of its strategies, as the kubelet's
PodResources lists them, joined to the pods' GPUs (issue 35 item 3: `GPU-...::0` and `0`
joined to no GPU, so every pod's own GPU process was flagged `wrong-gpu`).

The strategies' id forms are the device plugin's own (k8s-device-plugin, internal/rm:
`deviceIDStrategy` uuid or index, a MIG instance's index `GPU:MIG`, and `NewAnnotatedID`'s
`ID::REPLICA` for time-slicing and MPS replicas). The kubelet's listing and the processes
are hand-written stand-ins for a node; the GPUs are the simulated nodes of config/gpus.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
from test_gpu_policies import G0, G1, state

from nodeagent.gpu.grants import device_uuid, uuid_indices
from nodeagent.gpu.model import GpuProcess, GpuState, Hold
from nodeagent.gpu.simulated import load_simulated
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.kube.gpus import join
from nodeagent.kube.podresources import ContainerDevices, Devices
from nodeagent.kube.pods import EMPTY
from nodeagent.meta import ContainerMeta, PodMeta
from nodeagent.policy.gpu_checks import violations
from nodeagent.sense.gpus import GpuSensor

REPO = Path(__file__).resolve().parents[2]
CGROUPS = {"a": "kubepods/pod-a/ctr-a", "b": "kubepods/pod-b/ctr-b", "c": "kubepods/pod-c/ctr-c"}
"""Three pods' containers: a and b are given GPUs by the device plugin, c is not."""


def container(pod: str) -> WorkloadIdentity:
    """Pod `pod`'s container `server` in namespace ml, as CRI named it."""
    meta = ContainerMeta("containerd", "server", "registry/app:1", pod=PodMeta("ml", pod))
    return WorkloadIdentity(
        CGROUPS[pod], Kind.CONTAINER, Runtime.CONTAINERD, Owner.CGROUPFS, "server",
        container_id=f"{pod}000", pod_uid=f"uid-{pod}", meta=meta,
    )  # fmt: skip


def listed(
    ids: Mapping[str, tuple[str, ...]], resource: str = "nvidia.com/gpu"
) -> list[ContainerDevices]:
    return [
        ContainerDevices("ml", pod, "server", (Devices(resource, device_ids),))
        for pod, device_ids in ids.items()
    ]


def holds(
    gpus: GpuState, ids: Mapping[str, tuple[str, ...]], resource: str = "nvidia.com/gpu"
) -> tuple[Hold, ...]:
    joined = join(
        listed(ids, resource), EMPTY, [container(p) for p in CGROUPS], gpus=gpus,
        gpu_resources=["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*"], classes={},
    )  # fmt: skip
    assert joined.unjoined == (), joined.unjoined
    return joined.holds


def on(gpu: str, pod: str, pid: int) -> GpuProcess:
    return GpuProcess(pid, gpu, 1 << 30, CGROUPS[pod])


# each strategy's ids for: pod a given GPU 0, pod b given GPU 1 (whole GPUs), or both pods a
# replica of GPU 0 (shared)
WHOLE = {
    "uuid": {"a": (G0,), "b": (G1,)},
    "index": {"a": ("0",), "b": ("1",)},
}
SHARED = {
    "time-slicing, uuid": {"a": (f"{G0}::0",), "b": (f"{G0}::3",)},
    "time-slicing, index": {"a": ("0::1",), "b": ("0::2",)},
    # MPS replicas are named as time-slicing's (the plugin's resource: nvidia.com/gpu.shared
    # with renameByDefault)
    "MPS, uuid": {"a": (f"{G0}::0",), "b": (f"{G0}::1",)},
}


@pytest.mark.parametrize("strategy", WHOLE)
def test_whole_gpus_by_uuid_or_index_are_each_pods_own(strategy: str) -> None:
    gpus = state((), ())
    got = holds(gpus, WHOLE[strategy])
    assert [(h.owner, h.uuids, h.indices, h.cgroup, h.shared_memory) for h in got] == [
        ("pod:ml/a/server", (G0,), (0,), CGROUPS["a"], None),
        ("pod:ml/b/server", (G1,), (1,), CGROUPS["b"], None),
    ]
    processes = (on(G0, "a", 11), on(G1, "b", 12), on(G0, "b", 13), on(G1, "c", 14))
    found = [(p.pid, kind) for p, kind, _ in violations(state(processes, got))]
    assert found == [(13, "wrong-gpu"), (14, "unassigned")], "each pod's own, and only its own"


@pytest.mark.parametrize("strategy", SHARED)
def test_replicas_of_a_shared_gpu_are_that_gpu_held_by_each_pod(strategy: str) -> None:
    """Two pods given replicas of GPU 0: both hold GPU 0, shared; their processes on it are
    theirs, while a process on it from a pod given none is still unassigned, and one of a
    replica's holder on GPU 1 still wrong-gpu."""
    gpus = state((), ())
    got = holds(gpus, SHARED[strategy], "nvidia.com/gpu.shared")
    assert [(h.owner, h.uuids, h.indices, h.shared_memory) for h in got] == [
        ("pod:ml/a/server", (G0,), (0,), 0),
        ("pod:ml/b/server", (G0,), (0,), 0),
    ]
    processes = (on(G0, "a", 21), on(G0, "b", 22), on(G0, "c", 23), on(G1, "a", 24))
    found = [(p.pid, kind) for p, kind, _ in violations(state(processes, got))]
    assert found == [(23, "unassigned"), (24, "wrong-gpu")]


def test_two_replicas_of_one_gpu_in_one_container_are_that_gpu_once() -> None:
    (hold,) = holds(state((), ()), {"a": (f"{G0}::0", f"{G0}::1")})
    assert (hold.uuids, hold.indices) == ((G0,), (0,))


def mig_node() -> GpuState:
    read = GpuSensor(load_simulated(REPO / "config" / "gpus" / "h100-mig.yaml")).read(())
    assert read is not None
    return read


@pytest.mark.parametrize(
    ("device_id", "mig_slot"),
    [("MIG-fc891b4a-6a50-4f4d-b4d6-6a3a47469a4d", 2), ("0:2", 2), ("0:1::4", 1)],
)
def test_a_mig_instance_by_uuid_index_or_replica(device_id: str, mig_slot: int) -> None:
    gpus = mig_node()
    (gpu,) = gpus.devices
    assert device_uuid(device_id, gpus, uuid_indices(gpus)) == gpu.mig_devices[mig_slot].uuid


def test_the_uuids_are_each_gpus_and_mig_instances_with_the_gpus_index() -> None:
    """What join ties a pod's ids to, made once per listing: a MIG instance is its GPU's
    index, as the whole GPU is."""
    gpus = mig_node()
    (gpu,) = gpus.devices
    assert gpu.mig_devices
    assert uuid_indices(gpus) == {gpu.uuid: gpu.index} | {
        m.uuid: gpu.index for m in gpu.mig_devices
    }
    assert uuid_indices(state((), ())) == {G0: 0, G1: 1}


@pytest.mark.parametrize("device_id", ["7", "GPU-not-here", "0:9", "9:0", "x::1", ""])
def test_an_id_of_no_gpu_this_node_has_is_said_and_holds_nothing(device_id: str) -> None:
    gpus = state((), ())
    assert device_uuid(device_id, gpus, uuid_indices(gpus)) is None
    joined = join(
        listed({"a": (device_id,)}), EMPTY, [container("a")], gpus=gpus,
        gpu_resources=["nvidia.com/gpu"], classes={},
    )  # fmt: skip
    assert joined.holds == ()
    assert joined.unjoined == (f"pod:ml/a/server holds {device_id}, which is no GPU this node has",)
