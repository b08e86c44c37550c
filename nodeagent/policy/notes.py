"""What a policy reports, typed: each kind of note carries its own payload, which the
metrics, the report, the change log and the CLI read by attribute.

A note's JSON form (the API's `notes`, the log's fields) is its payload's `fields()`, the
same keys as ever; but nothing outside the policy that writes a payload reads it by those
keys, so renaming a figure is a type error where it is used, not a silent gap in a metric.
The status words of each kind are enums here too: the metrics list every one of them (a
state series per word), and the change log names its events after them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar


class NoteKind(enum.StrEnum):
    DEADLINE = "deadline"
    """A deadline job's progress (`DeadlineProgress`)."""
    DEADLINE_GRANT = "deadline-grant"
    """Why a deadline its workload declared is not defended (`DeadlineGrantNote`)."""
    GPU_VIOLATION = "gpu-violation"
    """A process on a GPU its cgroup does not hold (`GpuViolation`)."""
    HIERARCHY = "hierarchy"
    """Whether the weights of every level give the tenants their parts (`Hierarchy`)."""
    PROTECTION = "protection"
    """The protection controller's state, for the node (`ProtectionState`)."""


class DeadlineStatus(enum.StrEnum):
    ON_TRACK = "on-track"
    PREDICTED_MISS = "predicted-miss"
    MISSED = "missed"
    OVERRUN = "overrun"
    DONE = "done"
    WAITING = "waiting"


class ProtectionPhase(enum.StrEnum):
    """The first word of the protection note's status."""

    IDLE = "idle"
    THROTTLING = "throttling"
    RELEASING = "releasing"
    FREEZING = "freezing"


class ViolationKind(enum.StrEnum):
    UNASSIGNED = "unassigned"
    """Its cgroup holds no GPU."""
    WRONG_GPU = "wrong-gpu"
    """Its cgroup holds others."""


@dataclass(frozen=True, slots=True)
class DeadlineProgress:
    kind: ClassVar[NoteKind] = NoteKind.DEADLINE
    status: DeadlineStatus
    deadline: float
    """Unix seconds."""
    work: float | None
    """CPU-seconds declared in all."""
    remaining: float
    required_rate: float | None
    """Cores it needs from now on to finish in time; None once due or done."""
    rate: float | None
    """Cores the plan gives it, where it planned it this tick."""
    measured_rate: float | None
    parallelism: float
    slack: float
    """Seconds to spare at the planned rate (negative: late)."""
    predicted_finish: float | None
    rank: int | None = None
    """Its EDF rank, where the EDF planned it (with `capacity`)."""
    capacity: float | None = None
    capacity_source: str | None = None

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {
            "deadline": self.deadline,
            "work": self.work,
            "remaining": self.remaining,
            "required_rate": self.required_rate,
            "rate": self.rate,
            "measured_rate": self.measured_rate,
            "parallelism": self.parallelism,
            "slack": self.slack,
            "predicted_finish": self.predicted_finish,
        }
        if self.capacity is not None:
            out |= {
                "rank": self.rank,
                "capacity": self.capacity,
                "capacity_source": self.capacity_source,
            }
        return out


@dataclass(frozen=True, slots=True)
class DeadlineGrantNote:
    kind: ClassVar[NoteKind] = NoteKind.DEADLINE_GRANT
    declared_by: str | None
    grant: str

    def fields(self) -> dict[str, object]:
        return {"declared_by": self.declared_by, "grant": self.grant}


@dataclass(frozen=True, slots=True)
class GpuViolation:
    kind: ClassVar[NoteKind] = NoteKind.GPU_VIOLATION
    violation: ViolationKind
    pid: int
    device: str
    process_cgroup: str
    holder: str | None
    """The owner of the closest hold above the process (wrong-gpu), else None."""

    def fields(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "device": self.device,
            "process_cgroup": self.process_cgroup,
            "holder": self.holder,
        }


@dataclass(frozen=True, slots=True)
class Hierarchy:
    kind: ClassVar[NoteKind] = NoteKind.HIERARCHY
    planned: Mapping[str, float]
    expected: Mapping[str, float]
    read_only_levels: tuple[str, ...]

    def fields(self) -> dict[str, object]:
        return {
            "planned": dict(self.planned),
            "expected": dict(self.expected),
            "read_only_levels": list(self.read_only_levels),
        }


@dataclass(frozen=True, slots=True)
class ProtectionState:
    kind: ClassVar[NoteKind] = NoteKind.PROTECTION
    phase: ProtectionPhase
    stalling: Mapping[str, float]
    """Each stalling cgroup's share of the tick spent waiting for a CPU."""
    caps: Mapping[str, float]
    """Victim class -> cores its cgroups may use in all."""
    frozen: tuple[str, ...]

    def fields(self) -> dict[str, object]:
        return {
            "stalling": dict(self.stalling),
            "caps": dict(self.caps),
            "frozen": list(self.frozen),
        }


NotePayload = DeadlineProgress | DeadlineGrantNote | GpuViolation | Hierarchy | ProtectionState
