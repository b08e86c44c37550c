"""Frozen pictures of the node, taken once per tick and handed to pure policies.

Everything a policy may look at is here, including the time and the page size,
so that policies never read a clock or a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from nodeagent.cgroupfs.parse import Psi
from nodeagent.cgroupfs.values import Attribute, Value
from nodeagent.gpu.model import GpuState
from nodeagent.identity import WorkloadIdentity


@dataclass(frozen=True, slots=True)
class CgroupSample:
    """One cgroup's interface files as read in one tick; None where a file is absent
    (its controller is not enabled for the cgroup)."""

    populated: bool | None = None
    cpu_usage_us: int | None = None
    cpu_nr_periods: int | None = None
    cpu_nr_throttled: int | None = None
    cpu_throttled_us: int | None = None
    memory_current: int | None = None
    memory_anon: int | None = None
    memory_file: int | None = None
    memory_events: Mapping[str, int] = field(default_factory=dict)
    cpu_psi: Psi | None = None
    memory_psi: Psi | None = None
    threads: int | None = None
    """Threads in the cgroup (cgroup.threads), read for deadline jobs only: a job cannot
    use more CPUs than it has threads."""
    settings: Mapping[Attribute, Value] = field(default_factory=dict)
    cpu_idle: bool = False
    """cpu.idle is set (systemd's CPUWeight=idle): the kernel shows its cpu.weight as 0 and
    refuses any other with EINVAL, so the weight is not among `settings` and is not
    planned; its other files are managed as any cgroup's."""


@dataclass(frozen=True, slots=True)
class Needs:
    """What a lean read adds to cpu.stat for one workload, because a policy in use (or
    the loop itself) needs it every tick; the policies declare it (`Policy.needs`) and
    the loop reads the union."""

    events: bool = False
    """cgroup.events: whether it holds processes (exec's jobs, to remove them when empty;
    a deadline job, seen at once when it starts or ends)."""
    memory: bool = False
    """memory.current: a memory limit is planned from usage (never below it)."""
    pressure: bool = False
    """cpu.pressure: a protected class, or a floor, whose stalls throttle others."""
    threads: bool = False
    """cgroup.threads: a deadline job's parallelism."""

    def __or__(self, other: Needs) -> Needs:
        """What both need."""
        return Needs(
            self.events or other.events,
            self.memory or other.memory,
            self.pressure or other.pressure,
            self.threads or other.threads,
        )


NO_NEEDS = Needs()
"""Only cpu.stat: what every lean read takes."""


@dataclass(frozen=True, slots=True)
class WorkloadState:
    identity: WorkloadIdentity
    sample: CgroupSample
    cpu_rate: float | None = None
    """Cores used since the previous tick; None on a workload's first tick."""
    throttled_fraction: float | None = None
    """Share of CFS periods that were throttled since the previous tick."""
    cpu_stall: float | None = None
    """Share of the time since the previous tick in which some of its tasks waited for a
    CPU (from cpu.pressure's 'some' total): reacts within a tick, where avg10 lags."""

    @property
    def path(self) -> str:
        return self.identity.path


@dataclass(frozen=True, slots=True)
class NodeState:
    cpu_count: int
    cpu_busy: float | None
    """Busy fraction of all CPUs since the previous tick, from /proc/stat."""
    memory_total: int
    memory_available: int
    page_size: int


@dataclass(frozen=True, slots=True)
class Skipped:
    """A workload left out of this tick, and why: its files could not be read or parsed,
    or no plan could be made for it. The rest of the node goes on without it."""

    identity: WorkloadIdentity
    step: str
    """Where it failed: "sense", "plan" or "write"."""
    reason: str

    @property
    def path(self) -> str:
        return self.identity.path


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    seq: int
    wall_time: float
    elapsed: float | None
    """Seconds since the previous snapshot (monotonic); None for the first."""
    node: NodeState
    workloads: tuple[WorkloadState, ...]
    skipped: tuple[Skipped, ...] = ()
    vanished: tuple[str, ...] = ()
    """Paths of workloads whose cgroups were gone when sensed (normal on a busy node)."""
    levels: tuple[WorkloadState, ...] = ()
    """Parents of the claimed workloads (Kind.GROUP), with their cpu.weight: the levels
    hierarchical fair share weights."""
    gpus: GpuState | None = None
    """None on a node without GPUs, or when they could not be read this tick."""
    local_seconds: float | None = None
    """Seconds since local midnight at `wall_time`, for daily windows (policies read no
    clock and no time zone)."""
    overwritten: tuple[tuple[str, Attribute], ...] = ()
    """(cgroup, attribute) read this tick with a value other than the one the agent last
    wrote there: another writer (the kubelet, systemd, an operator) changed it since."""
