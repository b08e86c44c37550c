"""Who a cgroup belongs to: what runs in it, and who may write its attributes."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nodeagent.meta import ContainerMeta


class Runtime(enum.StrEnum):
    DOCKER = "docker"
    CONTAINERD = "containerd"
    CRIO = "crio"
    PODMAN = "podman"
    SYSTEMD = "systemd"
    NODEAGENT = "nodeagent"
    KUBELET = "kubelet"  # a pod-level cgroup: the kubelet made it, its containers live below
    SLURM = "slurm"


class Kind(enum.StrEnum):
    CONTAINER = "container"
    POD = "pod"
    SERVICE = "service"
    JOB = "job"
    GROUP = "group"
    """A parent of workloads (a slice, a QoS tier, the managed root): written for the
    hierarchy of fair share, never claimed by a rule."""


class Owner(enum.StrEnum):
    """Who manages the cgroup's attributes, and so how the agent may write them (see
    nodeagent.ownership): its own subtree and cgroupfs-driver trees directly, the system
    manager's cgroups through systemd's D-Bus API (never the file alone), others not at all."""

    NODEAGENT = "nodeagent"
    CGROUPFS = "cgroupfs"
    SYSTEMD = "systemd"
    USER_SYSTEMD = "user-systemd"
    """A user's own systemd manager (below ``user@<n>.service``: rootless podman, user
    services): its units are not the system manager's, so they are read-only."""
    SLURM = "slurm"
    """slurmd's cgroup/v2 plugin: systemd delegated slurmstepd.scope to it, and it makes and
    sets everything below (jobs, steps, their cpuset, memory and device limits)."""
    OTHER = "other"


class QosTier(enum.StrEnum):
    GUARANTEED = "guaranteed"
    BURSTABLE = "burstable"
    BESTEFFORT = "besteffort"


@dataclass(frozen=True, slots=True)
class WorkloadIdentity:
    """What discovery learned about one cgroup from its place in the tree; for a Slurm
    job, the account Slurm itself reports for it (nodeagent.slurm); and what its runtime
    said about it (`meta`, added by nodeagent.runtimes.metadata before the policies see it;
    `meta_problem` says why there is none).

    `path` is relative to the cgroup root, '/'-separated, with no leading slash.
    """

    path: str
    kind: Kind
    runtime: Runtime
    owner: Owner
    name: str
    container_id: str | None = None
    pod_uid: str | None = None
    qos: QosTier | None = None
    job_id: str | None = None
    """A Slurm job's id (its cgroup is job_<id>)."""
    account: str | None = None
    """A Slurm job's account, as Slurm records it; None until Slurm has answered."""
    meta: ContainerMeta | None = None
    meta_problem: str | None = None
