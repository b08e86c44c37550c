"""How the agent may write each cgroup: directly, through systemd, or not at all.

Its own subtree (the managed root and below) and the trees runtimes make with the
cgroupfs driver (docker/, libpod_parent/) are written directly. Cgroups systemd owns are
written as runc and the kubelet do: the unit's properties first, over D-Bus, then the
file (nodeagent.sdbus explains why), and only the kinds the policy allows
(`agent.systemd`): by default runtime scopes and pod slices and parent slices, not
services. The kubelet's own levels (kubepods, the QoS tiers, under either driver) are
read-only by default: the kubelet rewrites their weights about every minute
(`agent.kubelet_levels`). Anything below a user's manager (`user@<n>.service`: rootless
podman, user services, the user's slices) is read-only: the system manager does not own
those cgroups, and a user names them as they like. Slurm's jobs and its scope
(system.slice/slurmstepd.scope) are slurmd's: read-only by default; with
`agent.slurm.cpu_weight: write`, a job's cpu.weight (at job level, never below) and nothing
else (WEIGHT_ONLY: never its cpuset, memory, devices, cpu.max or freezer, which slurmd
sets). Anything else (a cgroup no known layout explains) is read-only.

"Through systemd" is only ever through the unit systemd itself says owns the cgroup
(nodeagent.sdbus.Systemd.unit_for_cgroup, checked by the executor before any write).
"""

from __future__ import annotations

import enum

from nodeagent.discovery.layouts import classify, user_manager
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.policyfile.model import AgentSettings, Permission

_CGROUPFS_RUNTIMES = {"docker": Runtime.DOCKER, "libpod_parent": Runtime.PODMAN}
_UNIT_SUFFIXES = (".slice", ".scope", ".service")


class WriteMode(enum.StrEnum):
    DIRECT = "direct"
    SYSTEMD = "systemd"
    READ_ONLY = "read-only"
    WEIGHT_ONLY = "weight-only"
    """cpu.weight written directly, every other attribute left as it is (a Slurm job)."""


def write_mode(identity: WorkloadIdentity, settings: AgentSettings) -> WriteMode:
    allowed = {Permission.WRITE: WriteMode.SYSTEMD, Permission.READ_ONLY: WriteMode.READ_ONLY}
    if identity.owner is Owner.NODEAGENT:
        return WriteMode.DIRECT
    if identity.runtime is Runtime.KUBELET and identity.kind is Kind.GROUP:
        if settings.kubelet_levels is Permission.READ_ONLY:
            return WriteMode.READ_ONLY
        return WriteMode.DIRECT if identity.owner is Owner.CGROUPFS else WriteMode.SYSTEMD
    if identity.owner is Owner.CGROUPFS:
        return WriteMode.DIRECT
    if identity.owner is Owner.SLURM:
        weights = identity.kind is Kind.JOB and settings.slurm.cpu_weight is Permission.WRITE
        return WriteMode.WEIGHT_ONLY if weights else WriteMode.READ_ONLY
    if identity.owner is Owner.SYSTEMD:
        systemd = settings.systemd
        if identity.kind is Kind.SERVICE:
            return allowed[systemd.services]
        if identity.kind is Kind.GROUP:
            return allowed[systemd.slices]
        return allowed[systemd.containers]
    return WriteMode.READ_ONLY  # a user's manager's, or no known layout's


def read_only_reason(identity: WorkloadIdentity) -> str:
    """Why the agent leaves a read-only cgroup's files as they are, for `explain` and the
    write results."""
    if identity.owner is Owner.USER_SYSTEMD:
        manager = user_manager(identity.path) or "a user manager"
        return (
            f"below {manager}: that user's own systemd manages it, not the system manager,"
            " so nodeagent leaves it read-only"
        )
    if identity.owner is Owner.SLURM:
        if identity.kind is Kind.JOB:
            return (
                "slurmd's cgroup/v2 plugin owns Slurm's jobs: nodeagent writes only their"
                " cpu.weight, and only with agent.slurm.cpu_weight: write"
            )
        return "slurmd's cgroup/v2 plugin owns its scope: nodeagent leaves it read-only"
    return f"owned by {identity.owner}: not written directly"


def classify_level(path: str, managed_root: str) -> WorkloadIdentity:
    """A parent of workloads, by where it is: ours, a runtime's, the kubelet's, systemd's."""
    name = path.rsplit("/", 1)[-1]
    top = path.split("/", 1)[0]

    def group(runtime: Runtime, owner: Owner) -> WorkloadIdentity:
        return WorkloadIdentity(path, Kind.GROUP, runtime, owner, name)

    if path == managed_root or path.startswith(managed_root + "/"):
        return group(Runtime.NODEAGENT, Owner.NODEAGENT)
    if user_manager(path) is not None:
        return group(Runtime.SYSTEMD, Owner.USER_SYSTEMD)
    if top == "kubepods":
        return group(Runtime.KUBELET, Owner.CGROUPFS)
    if top == "system.slice" and name.endswith("slurmstepd.scope"):
        return group(Runtime.SLURM, Owner.SLURM)
    if top in _CGROUPFS_RUNTIMES:
        return group(_CGROUPFS_RUNTIMES[top], Owner.CGROUPFS)
    if name.startswith("kubepods") and name.endswith(".slice"):
        return group(Runtime.KUBELET, Owner.SYSTEMD)
    if name.endswith(_UNIT_SUFFIXES):
        return group(Runtime.SYSTEMD, Owner.SYSTEMD)
    return group(Runtime.SYSTEMD, Owner.OTHER)


def parent_identity(path: str, managed_root: str) -> WorkloadIdentity:
    """A parent of a claimed workload: a workload itself when discovery knows its layout
    (a pod, written as pods are), else a level (`classify_level`)."""
    return classify(path, managed_root) or classify_level(path, managed_root)
