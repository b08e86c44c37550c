"""Frozen descriptions of a node's GPUs, shared by the backends, placement and the CLI.

Every record says whether it comes from a simulation, so that nothing simulated can
pass for a reading of real hardware in the CLI or in JSON. Sizes are bytes and power
is milliwatts, as NVML reports them; None is a figure the device does not report.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# the kernel's CPU list format, which cpuset.cpus holds too: re-exported (explicitly, for
# mypy) from cgroupfs, where the cgroup values are
from nodeagent.cgroupfs.parse import parse_cpulist as parse_cpulist  # noqa: PLC0414
from nodeagent.cgroupfs.values import format_cpulist as format_cpulist  # noqa: PLC0414


class PcieLevel(enum.IntEnum):
    """The PCIe path between two GPUs, as nvidia-smi topo -m names it; closest first."""

    PIX = 1
    """Through at most one PCIe switch."""
    PXB = 2
    """Through several PCIe switches, without a host bridge."""
    PHB = 3
    """Through a PCIe host bridge."""
    NODE = 4
    """Between host bridges within one NUMA node."""
    SYS = 5
    """Across NUMA nodes, over the CPUs' interconnect (QPI/UPI, Infinity Fabric)."""


@dataclass(frozen=True, slots=True)
class MigDevice:
    """A MIG instance: CUDA and containers address it by its own MIG- UUID."""

    uuid: str
    parent_uuid: str
    index: int
    """Its slot on the parent GPU (NVML's MIG device index)."""
    profile: str
    """The instance's profile, such as 1g.10gb."""
    memory_total: int | None
    gpu_instance: int | None = None
    compute_instance: int | None = None
    healthy: bool = True
    reason: str = ""
    simulated: bool = False


@dataclass(frozen=True, slots=True)
class Device:
    """One physical GPU as the driver enumerates it."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    minor: int | None
    """N in /dev/nvidiaN."""
    memory_total: int | None
    numa_node: int | None
    cpus: tuple[int, ...]
    """The CPUs closest to the GPU (its CPU affinity); empty when unknown."""
    mig_enabled: bool | None
    """None when the GPU cannot do MIG."""
    mig_devices: tuple[MigDevice, ...] = ()
    healthy: bool = True
    reason: str = ""
    """Why the GPU is unhealthy; empty when it is healthy."""
    simulated: bool = False


@dataclass(frozen=True, slots=True)
class Link:
    """How two GPUs reach each other."""

    pcie: PcieLevel = PcieLevel.SYS
    nvlinks: int = 0
    """NVLinks usable between the two GPUs; through an NVSwitch fabric, the fewer of the
    two GPUs' links to the fabric (nvidia-smi shows NV18 for every pair on a DGX H100)."""
    nvswitch: bool = False
    """The NVLinks go through an NVSwitch fabric rather than GPU to GPU."""


NO_LINK = Link()


@dataclass(frozen=True)
class Topology:
    """Every pair of GPUs, by index; a pair left out is across NUMA nodes without NVLink."""

    links: Mapping[tuple[int, int], Link] = field(default_factory=dict)
    simulated: bool = False

    def link(self, a: int, b: int) -> Link:
        return self.links.get((a, b) if a < b else (b, a), NO_LINK)


@dataclass(frozen=True, slots=True)
class Telemetry:
    """One GPU's readings now; None for a figure the device does not support."""

    uuid: str
    index: int
    utilization: int | None
    """Percent of the last sample period in which a kernel ran."""
    memory_used: int | None
    memory_total: int | None
    power_draw_mw: int | None
    power_limit_mw: int | None
    power_min_mw: int | None
    power_max_mw: int | None
    power_default_mw: int | None
    temperature_c: int | None
    simulated: bool = False


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process that the driver sees on a GPU or MIG device."""

    pid: int
    """In the host's PID namespace, as NVML reports it."""
    device_uuid: str
    """The GPU's UUID, or the MIG device's when the process runs in a MIG instance."""
    used_memory: int | None
    cgroup: str | None
    """Its cgroup v2 path relative to the cgroup root; None when the process is gone."""
    simulated: bool = False


@dataclass(frozen=True, slots=True)
class XidEvent:
    """An Xid error the driver reported for a GPU (or one of its MIG devices)."""

    device_uuid: str
    xid: int
    critical: bool
    """False for Xids caused by an application, which leave the GPU healthy."""
    simulated: bool = False


@dataclass(frozen=True, slots=True)
class PowerLimit:
    """The outcome of setting a power limit, as read back from the device."""

    uuid: str
    requested_mw: int
    applied_mw: int
    min_mw: int
    max_mw: int
    simulated: bool = False

    @property
    def clamped(self) -> bool:
        return self.applied_mw != self.requested_mw


class HoldKind(enum.StrEnum):
    REQUEST = "request"
    """GPUs granted to a request, waiting for its job to start (they lapse unclaimed)."""
    JOB = "job"
    """A running job's GPUs, released when that job ends."""
    RESERVATION = "reservation"
    """GPUs held for a container started elsewhere; released by name or when it goes."""
    POD = "pod"
    """Kubernetes mode: a container's GPUs as the device plugin gave them, read from the
    kubelet each tick; never in the ledger, never saved, never made into an environment."""
    RUNTIME = "runtime"
    """A workload's GPUs as whatever started it gave them: a container's runtime (`docker run
    --gpus`, owner `docker:NAME`) or Slurm (a job's GRES, owner `slurm:JOBID`), read from it
    (nodeagent.runtimes.gpus); never in the ledger, never saved, never made into an
    environment, and never weighed when the ledger grants GPUs."""


@dataclass(frozen=True, slots=True)
class Hold:
    """GPUs (or MIG devices) held by one job, one reservation for a container, one granted
    request waiting for its job to start, or (read each tick, outside the ledger) one
    container as Kubernetes' device plugin or its runtime gave them, or one Slurm job's GRES.
    Its `id` is what the daemon acts on; `owner` is a label (the job's or the reservation's
    name; `pod:...`, `docker:NAME`, `slurm:JOBID`), unique among live holds."""

    owner: str
    kind: HoldKind
    uuids: tuple[str, ...]
    """What CUDA_VISIBLE_DEVICES lists: GPU UUIDs, or MIG UUIDs."""
    indices: tuple[int, ...]
    """The GPUs' indices (the parent GPUs of MIG devices)."""
    shared_memory: int | None = None
    """Bytes promised on each GPU to a shared holder; None: held alone."""
    cgroup: str | None = None
    """The workload using them (a job's cgroup; a reservation's once its container shows)."""
    workload_class: str | None = None
    until: float | None = None
    """When an unclaimed hold lapses, on the daemon's monotonic clock (the state file keeps
    it as Unix time); None: until released."""
    cpus: tuple[int, ...] = ()
    """The CPUs closest to these GPUs (their NUMA nodes'), for pinning a job's cpuset."""
    id: str = ""
    """Unguessable, made by the daemon; what releases exactly this hold."""
    uid: int = 0
    """Who asked for it: only that uid or root may act on it."""
    tenant: str | None = None
    container: str | None = None
    """A reservation's container, as named when it was made (an id or a workload name)."""
    since: float | None = None
    """When it was granted, on the monotonic clock (the state file: Unix time)."""
    expected_end: float | None = None
    """When its job is expected to give the GPUs back, on the monotonic clock (the state
    file: Unix time), from the job's deadline and work or its class's recent holds; None:
    unknown."""
    named_by: int | None = None
    """Who named a reservation's container: its uid (it binds only to that uid's own
    workloads) or root (the operator: it binds to the workload named, whoever owns it)."""

    def covers(self, device_uuid: str, parents: Mapping[str, str]) -> bool:
        """Whether a process on `device_uuid` (a GPU or a MIG device) is on these GPUs."""
        return device_uuid in self.uuids or parents.get(device_uuid) in self.uuids


@dataclass(frozen=True, slots=True)
class GpuState:
    """The node's GPUs as one tick saw them, with what the agent had assigned then."""

    devices: tuple[Device, ...]
    topology: Topology
    telemetry: tuple[Telemetry, ...]
    processes: tuple[GpuProcess, ...]
    holds: tuple[Hold, ...]
    source: str
    simulated: bool

    def parents(self) -> dict[str, str]:
        """MIG device UUID -> its GPU's UUID."""
        return {m.uuid: d.uuid for d in self.devices for m in d.mig_devices}


def within(cgroup: str, parent: str) -> bool:
    """`cgroup` is `parent` or below it (paths relative to the cgroup root)."""
    return cgroup == parent or cgroup.startswith(parent + "/")


def holders(process: GpuProcess, holds: Sequence[Hold]) -> list[Hold]:
    """Every hold bound to the process's cgroup or one above it, closest first: any of them
    covers it (one alone would let a hold bound there, whoever's, judge the others' GPUs)."""
    if process.cgroup is None:
        return []
    cgroup = process.cgroup
    bound = [h for h in holds if h.cgroup is not None and within(cgroup, h.cgroup)]
    return sorted(bound, key=lambda h: -len(h.cgroup or ""))
