"""The policy schema. Frozen, so that policies can hold it without being able to change it."""

from __future__ import annotations

import contextlib
import enum
import math
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from nodeagent.api.client import DEFAULT_SOCKET
from nodeagent.identity import Kind, Owner, QosTier, Runtime
from nodeagent.spec.units import parse_duration, parse_size
from nodeagent.spec.when import parse_cpu_amount, parse_instant

MAX: Literal["max"] = "max"


def _size_or_max(value: object) -> object:
    return MAX if value == MAX else parse_size(value)


def _cores_or_max(value: object) -> object:
    """Cores as a positive finite float, or 'max'.

    Checked here rather than by the union: a union reports one error per member, and
    plain float coercion would take `true` as 1 core and a negative quota the kernel rejects.
    """
    if value == MAX:
        return MAX
    cores = math.nan
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        with contextlib.suppress(ValueError, OverflowError):
            cores = float(value)
    if not 0 < cores < math.inf:
        raise ValueError(
            f"expected a positive number of cores such as 1.5, or 'max', got {value!r}"
        )
    return cores


def _instant(value: object) -> float:
    return parse_instant(value)


Duration = Annotated[float, BeforeValidator(parse_duration)]
Instant = Annotated[float, BeforeValidator(_instant)]
"""An absolute time with a UTC offset, as unix seconds."""
CpuAmount = Annotated[tuple[float, bool], BeforeValidator(parse_cpu_amount)]
"""Cores, or (with is_fraction) a share of the node's CPUs."""
Size = Annotated[int | Literal["max"], BeforeValidator(_size_or_max)]
Cores = Annotated[float | Literal["max"], BeforeValidator(_cores_or_max)]


class WorkloadClass(enum.StrEnum):
    """What kind of work runs in a cgroup; later policies treat each class differently."""

    INFERENCE = "inference"
    TRAINING = "training"
    BATCH = "batch"
    BESTEFFORT = "besteffort"


class _Strict(BaseModel):
    # allow_inf_nan=False: `.inf` shares or thresholds would make the fair-share arithmetic NaN.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class AgentSettings(_Strict):
    """How the daemon runs: its tick, where it keeps state, and which subtree it owns."""

    interval: Duration = Field(1.0, ge=0.05, le=3600)
    resync_interval: Duration = Field(30.0, ge=1, le=86400)
    managed_root: str = Field("nodeagent.slice", min_length=1)
    state_file: str = "/var/lib/nodeagent/state.json"
    socket: str = DEFAULT_SOCKET
    socket_group: str | None = None


class FairShareSettings(_Strict):
    """Slurm-style fair share: weight follows shares, scaled by F = 2^(-usage/share)."""

    enabled: bool = True
    half_life: Duration = Field(3600.0, gt=0)
    weight_per_workload: int = Field(100, ge=1, le=10000)
    active_threshold: float = Field(0.01, ge=0)
    deadband: float = Field(0.05, ge=0, lt=1)


class Tenant(_Strict):
    shares: float = Field(gt=0, le=1e6)


class Match(_Strict):
    """All given fields must match. `path` and `name` are shell globs; the rest compare exactly."""

    path: str | None = None
    name: str | None = None
    runtime: Runtime | None = None
    kind: Kind | None = None
    owner: Owner | None = None
    qos: QosTier | None = None
    pod_uid: str | None = None
    container_id: str | None = None


class Limits(_Strict):
    """Static per-rule caps. Memory is rounded down to the page size when applied."""

    cpu_max: Cores | None = None
    cpu_period_us: int = Field(100_000, ge=1000, le=1_000_000)
    memory_max: Size | None = None
    memory_high: Size | None = None
    memory_request: Size | None = None
    """What the workload needs: protected as memory.min or memory.low by its class, and the
    base of memory.high (kubelet's MemoryQoS: request + factor x (limit - request))."""


class Rule(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(min_length=1)
    match: Match
    tenant: str
    workload_class: WorkloadClass = Field(WorkloadClass.BATCH, alias="class")
    limits: Limits = Limits()
    deadline: Instant | None = None
    """When the work must be done: an ISO 8601 time with a UTC offset."""
    work: Duration | None = Field(None, gt=0)
    """CPU-seconds the work needs in all, counted from the cgroup's creation."""


class MemoryProtection(enum.StrEnum):
    MIN = "min"
    LOW = "low"
    NONE = "none"


class ClassSettings(_Strict):
    """How the policies treat one class of work."""

    priority: int = Field(ge=0, le=1000)
    """Higher wins: a protected class's pressure throttles, then freezes, lower ones."""
    protect: bool = False
    """Watched for CPU pressure: when it stalls, lower classes are throttled in steps."""
    reserved_cpu: CpuAmount | None = None
    """CPU kept for this class when it wants it (cores or a share of the node); every
    policy plans around it, deadlines included."""
    floor_cpu: Cores = 0.1
    """Throttling never takes this class's cgroups below this many cores in all."""
    freezable: bool = True
    """May be frozen (cgroup.freeze, never killed) to make room for higher priorities."""
    memory_protection: MemoryProtection = MemoryProtection.NONE
    """How memory_request is protected from reclaim: memory.min, memory.low or not at all."""
    memory_throttle_factor: float = Field(0.9, ge=0, le=1)
    """memory.high = request + factor x (limit - request), as the kubelet's MemoryQoS."""


_CLASS_DEFAULTS: dict[WorkloadClass, dict[str, object]] = {
    WorkloadClass.INFERENCE: {
        "priority": 300,
        "protect": True,
        "freezable": False,
        "memory_protection": MemoryProtection.MIN,
    },
    WorkloadClass.TRAINING: {"priority": 200, "memory_protection": MemoryProtection.LOW},
    WorkloadClass.BATCH: {"priority": 100},
    WorkloadClass.BESTEFFORT: {"priority": 0, "floor_cpu": 0.01},
}


def _classes(value: object) -> object:
    """Each class starts from its defaults; the file overrides the keys it gives."""
    if not isinstance(value, dict):
        return value  # the schema then says it must be a mapping
    merged: dict[object, object] = {str(c): dict(d) for c, d in _CLASS_DEFAULTS.items()}
    for name, given in value.items():
        base = merged.get(name)
        both = isinstance(base, dict) and isinstance(given, dict)
        merged[name] = {**base, **given} if both else given  # type: ignore[dict-item]
    return merged


class NodeSettings(_Strict):
    reserved_cpu: CpuAmount = (0.0, False)
    """CPU kept for the system (cores or a share): no policy hands it to a workload."""


class ProtectionSettings(_Strict):
    """Inference first: the controller that throttles lower classes while a protected one
    stalls (koordlet's CPU suppress, with senpai's smooth steps)."""

    cpu_pressure: float = Field(0.10, gt=0, le=1)
    """Stall share (PSI 'some', over 10 s or the last tick) above which a protected cgroup
    is under pressure."""
    step: float = Field(0.25, gt=0, lt=1)
    """Each tick under pressure, lower classes' CPU caps shrink by this fraction."""
    release_step: float = Field(0.10, gt=0, le=1)
    """Each calm tick after `calm_ticks`, caps grow by this share of the node's CPUs."""
    calm_ticks: int = Field(3, ge=1, le=1000)
    """Ticks below half the threshold before caps are raised or frozen cgroups thawed."""
    freeze_after: int = Field(5, ge=1, le=1000)
    """Ticks under pressure with every lower class at its floor before the lowest is frozen."""
    period_us: int = Field(100_000, ge=1000, le=1_000_000)
    """The cpu.max period of the caps: ten per one-second tick, so a tick sees a smooth rate."""


class DeadlineSettings(_Strict):
    enabled: bool = True
    headroom: float = Field(1.1, ge=1, le=10)
    """Required rates are multiplied by this, for the scheduler's and the measurement's noise."""


class JobSettings(_Strict):
    """Defaults for `nodeagent exec`."""

    default_tenant: str | None = None
    default_class: WorkloadClass = WorkloadClass.BATCH


class PolicySpec(_Strict):
    version: Literal[1]
    agent: AgentSettings = AgentSettings()
    fair_share: FairShareSettings = FairShareSettings()
    node: NodeSettings = NodeSettings()
    classes: Annotated[dict[WorkloadClass, ClassSettings], BeforeValidator(_classes)] = Field(
        default_factory=lambda: {
            c: ClassSettings.model_validate(d) for c, d in _CLASS_DEFAULTS.items()
        }
    )
    protection: ProtectionSettings = ProtectionSettings()
    deadlines: DeadlineSettings = DeadlineSettings()
    jobs: JobSettings = JobSettings()
    tenants: dict[str, Tenant] = Field(min_length=1)
    rules: tuple[Rule, ...] = ()
