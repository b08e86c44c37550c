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


Duration = Annotated[float, BeforeValidator(parse_duration)]
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


class Rule(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(min_length=1)
    match: Match
    tenant: str
    workload_class: WorkloadClass = Field(WorkloadClass.BATCH, alias="class")
    limits: Limits = Limits()


class PolicySpec(_Strict):
    version: Literal[1]
    agent: AgentSettings = AgentSettings()
    fair_share: FairShareSettings = FairShareSettings()
    tenants: dict[str, Tenant] = Field(min_length=1)
    rules: tuple[Rule, ...] = ()
