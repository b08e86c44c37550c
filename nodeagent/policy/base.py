"""The small interface every policy implements, and what it is given and returns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from nodeagent.cgroupfs.values import Attribute, Value
from nodeagent.snapshot import NodeSnapshot
from nodeagent.spec.model import PolicySpec, WorkloadClass


@dataclass(frozen=True, slots=True)
class Assignment:
    """Which rule claimed a workload, and so its tenant and class."""

    rule: str
    tenant: str
    workload_class: WorkloadClass


@dataclass(frozen=True, slots=True)
class PolicyInput:
    snapshot: NodeSnapshot
    spec: PolicySpec
    assignments: Mapping[str, Assignment]
    tenant_usage: Mapping[str, float]
    """Decayed CPU usage per tenant, in core-seconds, including this tick."""


@dataclass(frozen=True, slots=True)
class Decision:
    """One policy's wish for one attribute of one cgroup, with the reasoning behind it."""

    path: str
    attribute: Attribute
    value: Value
    policy: str
    reason: str
    trace: tuple[str, ...] = ()


class Policy(Protocol):
    name: str

    def decide(self, given: PolicyInput) -> Sequence[Decision]: ...
