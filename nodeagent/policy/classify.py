"""Map workloads to tenants through the policy's rules: first match wins."""

from __future__ import annotations

from collections.abc import Iterable

from nodeagent.identity import WorkloadIdentity
from nodeagent.policy.base import Assignment
from nodeagent.spec.glob import glob_matches
from nodeagent.spec.model import Match, PolicySpec


def matches(match: Match, w: WorkloadIdentity) -> bool:
    checks = (
        match.path is None or glob_matches(match.path, w.path),
        match.name is None or glob_matches(match.name, w.name),
        match.runtime is None or match.runtime == w.runtime,
        match.kind is None or match.kind == w.kind,
        match.owner is None or match.owner == w.owner,
        match.qos is None or match.qos == w.qos,
        match.pod_uid is None or match.pod_uid == w.pod_uid,
        match.container_id is None
        or (w.container_id is not None and w.container_id.startswith(match.container_id)),
    )
    return all(checks)


def assign(workloads: Iterable[WorkloadIdentity], spec: PolicySpec) -> dict[str, Assignment]:
    """Assignments by cgroup path; workloads that no rule matches are left out (left alone)."""
    out: dict[str, Assignment] = {}
    for w in workloads:
        for rule in spec.rules:
            if matches(rule.match, w):
                out[w.path] = Assignment(
                    rule.name,
                    rule.tenant,
                    rule.workload_class,
                    rule.limits,
                    deadline=rule.deadline,
                    work=rule.work,
                )
                break
    return out
