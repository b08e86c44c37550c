"""The small interface every policy implements, and what it is given and returns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from nodeagent.cgroupfs.values import Attribute, Value
from nodeagent.errors import NodeagentError
from nodeagent.identity import WorkloadIdentity
from nodeagent.snapshot import NodeSnapshot
from nodeagent.spec.model import PolicySpec, WorkloadClass


@dataclass(frozen=True, slots=True)
class Assignment:
    """Which rule claimed a workload, and so its tenant and class."""

    rule: str
    tenant: str
    workload_class: WorkloadClass


def describe(identity: WorkloadIdentity, assignment: Assignment | None) -> dict[str, object]:
    """A workload as the API, the CLI and --json show it."""
    i, a = identity, assignment
    return {
        "cgroup": i.path,
        "name": i.name,
        "kind": str(i.kind),
        "runtime": str(i.runtime),
        "owner": str(i.owner),
        "writable": i.owner.writable,
        "container_id": i.container_id,
        "pod_uid": i.pod_uid,
        "qos": None if i.qos is None else str(i.qos),
        "rule": None if a is None else a.rule,
        "tenant": None if a is None else a.tenant,
        "class": None if a is None else str(a.workload_class),
    }


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


@dataclass(frozen=True, slots=True)
class Skip:
    """A policy could not plan one cgroup (a value out of range, say): that cgroup gets no
    targets this tick, the others are planned as usual."""

    path: str
    policy: str
    reason: str


PLANNING_ERRORS = (ArithmeticError, ValueError, NodeagentError)
"""What a policy's arithmetic on one workload may raise: caught per workload, as a Skip."""


class Policy(Protocol):
    name: str

    def decide(self, given: PolicyInput) -> Sequence[Decision | Skip]: ...
