"""Which GPUs each container holds, as the device plugin assigned them: the kubelet's
PodResources answer (namespace, pod and container names, device ids) joined to the
containers' cgroups through what the agent knows of them: the names CRI gave each container
(agent.runtimes), or the API server's watch (pod uid and container ids).

The result is one Hold of kind "pod" per container, with its cgroup, so that GPU
verification (a process on a GPU its pod was not given), power classes and the metrics
treat a pod's GPUs as they treat a job's. nodeagent never tells a pod which GPUs to use:
the device plugin did, and no Hold of kind "pod" is ever turned into an environment.

The device ids are the NVIDIA device plugin's, under each of its strategies
(`device_uuid`, in nodeagent.gpu.grants with the runtimes' ids): `deviceIDStrategy=uuid`
gives the GPU's UUID (a MIG instance's MIG-UUID), `index` its index (`0`; `0:1` for MIG
instance 1 of GPU 0), and sharing by time-slicing or MPS a replica of either
(`GPU-...::3`, `0::3`). A replica is the GPU,
held shared: several pods hold one GPU, and each one's processes on it are its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nodeagent.gpu.grants import REPLICA, device_uuid, uuid_indices
from nodeagent.gpu.model import GpuState, Hold, HoldKind
from nodeagent.identity import Kind, WorkloadIdentity
from nodeagent.kube.owners import with_api_view
from nodeagent.kube.podresources import ContainerDevices
from nodeagent.kube.pods import PodDirectory
from nodeagent.policyfile.glob import glob_matches


@dataclass(frozen=True, slots=True)
class Joined:
    holds: tuple[Hold, ...]
    unjoined: tuple[str, ...]
    """Why a container's GPUs could not be tied to its cgroup (shown once each in the log):
    their hold has no cgroup, so its GPUs are not checked."""


def owner(c: ContainerDevices) -> str:
    return f"pod:{c.namespace}/{c.pod}/{c.container}"


def join(
    listing: Sequence[ContainerDevices],
    pods: PodDirectory,
    identities: Sequence[WorkloadIdentity],
    *,
    gpu_resources: Sequence[str],
    gpus: GpuState,
    classes: Mapping[str, str],
) -> Joined:
    """`classes`: the class of each claimed workload's cgroup, for the power caps."""
    index = uuid_indices(gpus)
    cgroups: dict[tuple[str, str, str], str] = {}
    known: set[tuple[str, str]] = set()
    for i in identities:
        v = with_api_view(i, pods)  # what the API server says, else what CRI said
        pod = v.meta.pod if v.meta is not None else None
        if pod is None:
            continue
        known.add((pod.namespace, pod.name))
        if v.kind is Kind.CONTAINER and v.meta is not None and v.meta.name is not None:
            cgroups[(pod.namespace, pod.name, v.meta.name)] = v.path
    holds, unjoined = [], []
    for c in listing:
        ids = [
            i
            for d in c.devices
            if any(glob_matches(g, d.resource) for g in gpu_resources)
            for i in d.ids
        ]
        if not ids:
            continue
        named = {i: device_uuid(i, gpus, index) for i in ids}
        uuids = tuple(sorted({u for u in named.values() if u is not None}))
        shared = any(REPLICA in i for i in ids)
        cgroup = cgroups.get((c.namespace, c.pod, c.container))
        why = (
            ""
            if cgroup is not None
            else (
                f"no cgroup of container {c.container!r} is known yet"
                if (c.namespace, c.pod) in known
                else "the pod is not known yet (neither CRI nor the API server's watch names it)"
            )
        )
        if why:
            unjoined.append(f"{owner(c)} holds {', '.join(ids)}: {why}")
        foreign = [i for i, u in named.items() if u is None]
        if foreign:
            unjoined.append(f"{owner(c)} holds {', '.join(foreign)}, which is no GPU this node has")
        if not uuids:
            continue
        holds.append(
            Hold(
                owner(c),
                HoldKind.POD,
                uuids,
                tuple(sorted({index[u] for u in uuids})),
                shared_memory=0 if shared else None,  # a replica: the GPU, held with others
                cgroup=cgroup,
                workload_class=None if cgroup is None else classes.get(cgroup),
            )
        )
    return Joined(tuple(holds), tuple(unjoined))
