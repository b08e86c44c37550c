"""Values nodeagent writes to cgroup interface files, validated before they reach the kernel.

The kernel accepts some bad values silently (it rounds memory down to a page) and
rejects others with EINVAL mid-tick; checking here turns both into a clear error
at plan time. Each value also knows whether it is looser than another, which the
executor needs to order writes so that a parent is never tighter than its child.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from nodeagent.errors import InvalidValue

WEIGHT_MIN, WEIGHT_MAX = 1, 10_000
QUOTA_MIN_US = 1000
QUOTA_MAX_US = 2**44 - 1  # the kernel's max_cfs_runtime; above it cpu.max writes fail
PERIOD_MIN_US, PERIOD_MAX_US = 1000, 1_000_000
PIDS_MAX_LIMIT = 1 << 22
"""The largest number pids.max takes: the kernel's PID_MAX_LIMIT (above it, EINVAL)."""


class Attribute(enum.StrEnum):
    CPU_WEIGHT = "cpu.weight"
    CPU_MAX = "cpu.max"
    MEMORY_MAX = "memory.max"
    MEMORY_HIGH = "memory.high"
    MEMORY_LOW = "memory.low"
    MEMORY_MIN = "memory.min"
    PIDS_MAX = "pids.max"
    FREEZE = "cgroup.freeze"
    CPUSET_CPUS = "cpuset.cpus"


@dataclass(frozen=True, slots=True)
class CpuWeight:
    value: int

    def __post_init__(self) -> None:
        if not WEIGHT_MIN <= self.value <= WEIGHT_MAX:
            raise InvalidValue(f"cpu.weight {self.value} is outside {WEIGHT_MIN}..{WEIGHT_MAX}")

    def render(self) -> str:
        return str(self.value)

    def looser_than(self, other: CpuWeight) -> bool:
        """Weights are relative, not limits: no order between parent and child is needed."""
        return False


def is_idle_weight(text: str) -> bool:
    """cpu.weight reads 0 only where cpu.idle is set (systemd's CPUWeight=idle; writes take
    1..10000, and the kernel refuses them while the group is idle)."""
    return text.strip() == "0"


@dataclass(frozen=True, slots=True)
class CpuMax:
    """A bandwidth limit: `quota_us` of CPU time per `period_us`; quota None means 'max'."""

    quota_us: int | None
    period_us: int = 100_000

    def __post_init__(self) -> None:
        if not PERIOD_MIN_US <= self.period_us <= PERIOD_MAX_US:
            raise InvalidValue(
                f"cpu.max period {self.period_us} µs is outside {PERIOD_MIN_US}..{PERIOD_MAX_US}"
            )
        if self.quota_us is not None and self.quota_us < QUOTA_MIN_US:
            raise InvalidValue(f"cpu.max quota {self.quota_us} µs is below {QUOTA_MIN_US}")
        if self.quota_us is not None and self.quota_us > QUOTA_MAX_US:
            raise InvalidValue(f"cpu.max quota {self.quota_us} µs is above {QUOTA_MAX_US}")

    @classmethod
    def from_cores(cls, cores: float | None, period_us: int = 100_000) -> CpuMax:
        if cores is None:
            return cls(None, period_us)
        quota = cores * period_us
        if not math.isfinite(quota) or quota > QUOTA_MAX_US:
            raise InvalidValue(f"cpu.max of {cores} cores is beyond what the kernel accepts")
        return cls(max(QUOTA_MIN_US, round(quota)), period_us)

    @property
    def cores(self) -> float | None:
        return None if self.quota_us is None else self.quota_us / self.period_us

    def render(self) -> str:
        return f"{'max' if self.quota_us is None else self.quota_us} {self.period_us}"

    def looser_than(self, other: CpuMax) -> bool:
        mine, theirs = self.cores, other.cores
        return theirs is not None and (mine is None or mine > theirs)


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """A memory limit in bytes; None means 'max'. Must be page-aligned so what we write is kept."""

    bytes: int | None
    page_size: int = 4096

    def __post_init__(self) -> None:
        if self.bytes is None:
            return
        if self.bytes < 0:
            raise InvalidValue(f"memory limit {self.bytes} is negative")
        if self.bytes % self.page_size:
            raise InvalidValue(
                f"memory limit {self.bytes} is not a multiple of the page size {self.page_size}"
            )

    @classmethod
    def aligned(cls, value: int | None, page_size: int) -> MemoryLimit:
        """Round down to a page, as the kernel would, so the written value reads back equal."""
        return cls(None if value is None else value - value % page_size, page_size)

    def render(self) -> str:
        return "max" if self.bytes is None else str(self.bytes)

    def looser_than(self, other: MemoryLimit) -> bool:
        return other.bytes is not None and (self.bytes is None or self.bytes > other.bytes)


@dataclass(frozen=True, slots=True)
class PidsMax:
    """pids.max: how many tasks (processes and threads) the cgroup and its descendants may
    hold; None means 'max'. A fork past it fails with EAGAIN; nothing running is killed.

    0 is the kernel's as much as any other number (an operator stops a fork bomb with it),
    so a cgroup that holds it still reads; the policies never plan it (a job or a rule asks
    for at least 1)."""

    limit: int | None

    def __post_init__(self) -> None:
        if self.limit is not None and not 0 <= self.limit <= PIDS_MAX_LIMIT:
            raise InvalidValue(f"pids.max {self.limit} is outside 0..{PIDS_MAX_LIMIT}")

    def render(self) -> str:
        return "max" if self.limit is None else str(self.limit)

    def looser_than(self, other: PidsMax) -> bool:
        return other.limit is not None and (self.limit is None or self.limit > other.limit)


@dataclass(frozen=True, slots=True)
class Frozen:
    """cgroup.freeze: 1 stops every process in the cgroup where it stands, 0 resumes them.
    Nothing is killed; the kernel keeps their memory."""

    frozen: bool

    def render(self) -> str:
        return "1" if self.frozen else "0"

    def looser_than(self, other: Frozen) -> bool:
        return other.frozen and not self.frozen


def format_cpulist(cpus: Iterable[int]) -> str:
    """The kernel's list format for CPUs: (0, 1, 2, 5) is '0-2,5'."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True, slots=True)
class CpuSet:
    """cpuset.cpus: the CPUs the cgroup's processes may run on, sorted; none means its
    parent's (the kernel's default)."""

    cpus: tuple[int, ...]

    def __post_init__(self) -> None:
        if any(c < 0 for c in self.cpus) or list(self.cpus) != sorted(set(self.cpus)):
            raise InvalidValue(f"cpuset.cpus {self.cpus} is not a sorted list of CPUs")

    def render(self) -> str:
        return format_cpulist(self.cpus)

    def looser_than(self, other: CpuSet) -> bool:
        """No order between parent and child is needed: a child's CPUs outside its parent's
        are simply not effective (cgroup v2), so a write never fails for its order."""
        return False


Value = CpuWeight | CpuMax | MemoryLimit | PidsMax | Frozen | CpuSet


def is_looser(new: Value, old: Value) -> bool:
    """True when `new` relaxes `old`; values of different types are never compared."""
    if isinstance(new, CpuWeight) and isinstance(old, CpuWeight):
        return new.looser_than(old)
    if isinstance(new, CpuMax) and isinstance(old, CpuMax):
        return new.looser_than(old)
    if isinstance(new, MemoryLimit) and isinstance(old, MemoryLimit):
        return new.looser_than(old)
    if isinstance(new, PidsMax) and isinstance(old, PidsMax):
        return new.looser_than(old)
    if isinstance(new, Frozen) and isinstance(old, Frozen):
        return new.looser_than(old)
    if isinstance(new, CpuSet) and isinstance(old, CpuSet):
        return new.looser_than(old)
    return False
