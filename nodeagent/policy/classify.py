"""Map workloads to tenants through the policy's rules: first match wins."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

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


def nested_claims(claimed: Collection[str]) -> dict[str, str]:
    """The claimed cgroups below another claimed cgroup (a pod's containers where a rule
    claims the pod as well), each with the nearest claimed one above it."""
    out: dict[str, str] = {}
    for path in claimed:
        cut = path.rfind("/")
        while cut > 0:
            if path[:cut] in claimed:
                out[path] = path[:cut]
                break
            cut = path.rfind("/", 0, cut)
    return out


def outer_claims(claimed: Collection[str]) -> set[str]:
    """The claimed cgroups with a claimed cgroup below them. The tenant split counts the
    innermost claims only: an outer one's CPU holds theirs, so it is weighted as a parent
    carrying their targets, and its own usage, share and reservation are not counted.

    Run on every tick: each parent path is made once (siblings share theirs)."""
    above: set[str] = set()
    for path in claimed:
        cut = path.rfind("/")
        while cut > 0 and path[:cut] not in above:
            above.add(path[:cut])
            cut = path.rfind("/", 0, cut)
    return above.intersection(claimed)


def nested_warnings(assignments: Mapping[str, Assignment]) -> list[str]:
    """One line per claimed cgroup with claimed cgroups below it, for `workloads`."""
    below: dict[str, list[str]] = {}
    for inner, outer in nested_claims(assignments).items():
        below.setdefault(outer, []).append(inner)
    out = []
    for outer, inners in sorted(below.items()):
        rules = sorted({assignments[p].rule for p in inners})
        out.append(
            f"{outer} (rule {assignments[outer].rule}) has {len(inners)} claimed cgroup(s)"
            f" below it (rule {', '.join(rules)}): the tenant split counts only those, and"
            f" weights {outer} as their parent; say `kind:` in a rule to claim one or the other"
        )
    return out
