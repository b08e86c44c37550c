"""What systemd writes to a cgroup for the unit properties nodeagent sets, and back.

Pure, so that the plan can hold, for a cgroup systemd owns, exactly the value systemd will
write (a cpu.max rounded as below): the file and the property then agree and the loop has
nothing to rewrite. nodeagent.sdbus sets the properties.
"""

from __future__ import annotations

import functools

from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight, MemoryLimit, PidsMax, Value
from nodeagent.errors import NodeagentError


class UnitPropertyError(NodeagentError):
    """A value no systemd property expresses."""


UINT64_MAX = 2**64 - 1  # systemd's "infinity" for memory limits and USEC_INFINITY for times

# The unit properties nodeagent sets, all of D-Bus type "t" (uint64).
RESOURCE_PROPERTIES = frozenset(
    {
        "CPUWeight",
        "CPUQuotaPerSecUSec",
        "CPUQuotaPeriodUSec",
        "MemoryMax",
        "MemoryHigh",
        "MemoryLow",
        "MemoryMin",
        "TasksMax",
    }
)
_MEMORY_PROPERTY = {
    Attribute.MEMORY_MAX: "MemoryMax",
    Attribute.MEMORY_HIGH: "MemoryHigh",
    Attribute.MEMORY_LOW: "MemoryLow",
    Attribute.MEMORY_MIN: "MemoryMin",
}

USEC_PER_SEC = 1_000_000
USEC_PER_MSEC = 1000
DEFAULT_PERIOD_US = 100_000  # CGROUP_CPU_QUOTA_DEFAULT_PERIOD_USEC
# runc's round-up step for CPUQuotaPerSecUSec: 10 ms per second, 1 %. systemd 252 keeps a runtime
# quota as "CPUQuota=N%" with N truncated to an integer (dbus-cgroup.c, bus_cgroup_set_property),
# so any other value changes at the next daemon-reload; newer systemd keeps 0.01 %.
QUOTA_STEP_US = 10_000


def cpu_quota_properties(limit: CpuMax) -> dict[str, int]:
    """``CPUQuotaPerSecUSec`` and ``CPUQuotaPeriodUSec`` for the cpu.max `limit`.

    The per-second quota is rounded up to a multiple of 10 ms, as runc does (opencontainers/runc,
    libcontainer/cgroups/systemd/common.go, now opencontainers/cgroups systemd/common.go,
    ``addCPUQuota``), so that it survives ``daemon-reload`` (see ``QUOTA_STEP_US``) and is never
    tighter than asked. runc first truncates quota*10^6/period, then rounds up; this rounds the
    exact ratio up, so a fraction below 1 µs/s cannot make the limit tighter either.
    """
    if limit.quota_us is None:
        return {"CPUQuotaPerSecUSec": UINT64_MAX, "CPUQuotaPeriodUSec": limit.period_us}
    per_sec = -(-limit.quota_us * USEC_PER_SEC // limit.period_us)
    per_sec = -(-per_sec // QUOTA_STEP_US) * QUOTA_STEP_US
    return {"CPUQuotaPerSecUSec": per_sec, "CPUQuotaPeriodUSec": limit.period_us}


def cpu_max_from_properties(per_sec_us: int, period_us: int) -> CpuMax:
    """The cpu.max systemd writes for these two properties, to the microsecond.

    systemd's src/core/cgroup.c: ``cgroup_apply_unified_cpu_quota`` writes
    ``MAX(quota * period / USEC_PER_SEC, USEC_PER_MSEC) period`` (integer division), or
    ``max <default period>`` without a quota; the period comes from
    ``cgroup_cpu_adjust_period_and_log``/``cgroup_cpu_adjust_period``: the default when unset,
    then ``MIN(MAX3(period, 1 ms, 1 ms * USEC_PER_SEC / quota), 1 s)``.
    """
    if per_sec_us == UINT64_MAX:
        return CpuMax(None, DEFAULT_PERIOD_US)
    if per_sec_us <= 0:
        raise UnitPropertyError(f"CPUQuotaPerSecUSec={per_sec_us} is not a quota systemd accepts")
    period = DEFAULT_PERIOD_US if period_us == UINT64_MAX else period_us
    shortest = USEC_PER_MSEC * USEC_PER_SEC // per_sec_us  # so that the quota is at least 1 ms
    period = min(max(period, USEC_PER_MSEC, shortest), USEC_PER_SEC)
    return CpuMax(max(per_sec_us * period // USEC_PER_SEC, USEC_PER_MSEC), period)


def unit_properties(attribute: Attribute, value: Value) -> dict[str, int]:
    """The unit properties that make systemd write `value` to `attribute` (see systemd_value)."""
    if attribute is Attribute.CPU_WEIGHT and isinstance(value, CpuWeight):
        return {"CPUWeight": value.value}
    if attribute is Attribute.CPU_MAX and isinstance(value, CpuMax):
        return cpu_quota_properties(value)
    if attribute in _MEMORY_PROPERTY and isinstance(value, MemoryLimit):
        return {_MEMORY_PROPERTY[attribute]: UINT64_MAX if value.bytes is None else value.bytes}
    if attribute is Attribute.PIDS_MAX and isinstance(value, PidsMax):
        # systemd's src/core/cgroup.c, cgroup_context_apply: pids.max is TasksMax as it
        # is (a D-Bus TasksMax has no scale), or "max" while it is infinity
        return {"TasksMax": UINT64_MAX if value.limit is None else value.limit}
    raise UnitPropertyError(f"no systemd property for {attribute} = {value!r}")


@functools.lru_cache(maxsize=4096)
def systemd_value(attribute: Attribute, value: Value) -> Value:
    """What systemd writes to `attribute` once :func:`unit_properties` are set: write that too.
    Kept per value (they are frozen): every plan asks it of each target of each cgroup
    systemd owns, and a node's values are few."""
    if isinstance(value, CpuMax):
        props = unit_properties(attribute, value)
        return cpu_max_from_properties(props["CPUQuotaPerSecUSec"], props["CPUQuotaPeriodUSec"])
    unit_properties(attribute, value)  # the same checks
    return value
