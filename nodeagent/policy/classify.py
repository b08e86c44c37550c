"""Map workloads to tenants through the policy's rules: first match wins.

Rules match on the path's identity and on what the runtime said (`WorkloadIdentity.meta`,
sensed and frozen before this pure code runs). A rule may take the tenant or the class from a
label or annotation, but only among the values it allows (in Kubernetes mode: the values
the pod's namespace allows, see nodeagent.kube.owners); anything else falls back to the
rule's own (or the namespace's) and is reported (`Assignment.refused`), so a pod cannot
promote itself. A deadline from annotations (`deadline_from_annotations`) is the pod's
word too: taken only where its class's `declared_deadlines` is not `refused`, and marked
as declared (`Assignment.declared`), so that it is defended only where that says so.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace

from nodeagent.identity import WorkloadIdentity
from nodeagent.kube.owners import node_critical, pod_class, pod_tenant, view, with_api_view
from nodeagent.kube.pods import PodDirectory
from nodeagent.meta import ContainerMeta
from nodeagent.policy.base import Assignment
from nodeagent.policyfile.matching import match_terms, matches, show
from nodeagent.policyfile.model import (
    DeadlineGrant,
    MetaSource,
    PolicySpec,
    Rule,
    WorkloadClass,
)
from nodeagent.policyfile.units import parse_duration
from nodeagent.policyfile.when import parse_instant

DEADLINE_ANNOTATION = "nodeagent.io/deadline"
WORK_ANNOTATION = "nodeagent.io/work"


_SOURCE_NAMES = {
    "label": "label",
    "pod_label": "pod label",
    "annotation": "annotation",
    "pod_annotation": "pod annotation",
}


def _read(source: MetaSource, meta: ContainerMeta | None) -> tuple[str, str | None]:
    """(how to name the source, its value or None)."""
    which, key = source.source
    where = f"{_SOURCE_NAMES[which]} {key}"
    if meta is None:
        return where, None
    pod = meta.pod
    values: Mapping[str, str] = {
        "label": meta.labels,
        "annotation": meta.annotations,
        "pod_label": pod.labels if pod is not None else {},
        "pod_annotation": pod.annotations if pod is not None else {},
    }[which]
    return where, values.get(key)


def _annotation(meta: ContainerMeta | None, key: str) -> str | None:
    """A pod's annotation, else the container's own."""
    if meta is None:
        return None
    if meta.pod is not None and key in meta.pod.annotations:
        return meta.pod.annotations[key]
    return meta.annotations.get(key)


def _assignment(
    rule: Rule, w: WorkloadIdentity, terms: tuple[str, ...], spec: PolicySpec,
    pods: PodDirectory | None,
) -> Assignment:  # fmt: skip
    matched, refused = list(terms), list[str]()
    tenant, cls = rule.tenant, rule.workload_class
    seen = view(w, pods)
    pod = seen if _kubernetes(rule) else None
    if rule.tenant_from is not None and rule.tenant_from.kubernetes:
        if pod is not None:
            ns_labels = pods.namespaces.get(pod.namespace) if pods is not None else None
            given, claims = pod_tenant(pod, ns_labels, spec.kubernetes, spec.tenants)
            if given is not None:
                tenant = given
                matched.append(f"tenant {given} from namespace {pod.namespace}")
            refused.extend(claims)
    elif rule.tenant_from is not None:
        where, value = _read(rule.tenant_from, w.meta)
        allowed = rule.tenant_from.allowed
        if value is not None and value in allowed:
            tenant = value
            matched.append(f"tenant from {where}={show(value)}")
        elif value is not None:
            refused.append(
                f"{where}={show(value)!r} is not a tenant rule {rule.name} may give"
                f" ({', '.join(allowed)}): tenant {rule.tenant}, the rule's own"
            )
    if pod is not None and w.meta is not None and w.meta.incomplete is not None:
        refused.append(f"{w.meta.incomplete}: its labels and annotations choose nothing")
    if rule.class_from is not None and rule.class_from.kubernetes:
        if pod is not None:
            said = pod_class(pod, spec.kubernetes, rule.workload_class, spec.classes)
            cls = said.cls
            matched.extend([said.matched] if said.matched else [])
            refused.extend([said.refused] if said.refused else [])
    elif rule.class_from is not None:
        where, value = _read(rule.class_from, w.meta)
        choices = [str(c) for c in rule.class_from.allowed]
        if value is not None and value in choices:
            cls = WorkloadClass(value)
            matched.append(f"class from {where}={value}")
        elif value is not None:
            refused.append(
                f"{where}={show(value)!r} is not a class rule {rule.name} may give"
                f" ({', '.join(choices)}): class {rule.workload_class}, the rule's own"
            )
    deadline, work, declared = rule.deadline, rule.work, None
    if rule.deadline_from_annotations and deadline is None:
        deadline, work = _annotated_deadline(w.meta, refused)
        grant = spec.classes[cls].declared_deadlines
        if deadline is not None and grant is DeadlineGrant.REFUSED:  # the pod's word only
            refused.append(
                f"annotations {DEADLINE_ANNOTATION}/{WORK_ANNOTATION}: class {cls} takes no"
                f" deadline a workload declares (classes.{cls}.declared_deadlines: refused):"
                " no deadline"
            )
            deadline = work = None
        elif deadline is not None:
            when = _annotation(w.meta, DEADLINE_ANNOTATION)
            matched.append(f"deadline from annotations {DEADLINE_ANNOTATION}={show(when or '')}")
            declared = "its annotations"
    return Assignment(
        rule.name,
        tenant,
        cls,
        rule.limits,
        deadline=deadline,
        work=work,
        matched=tuple(matched),
        refused=tuple(refused),
        node_critical=None if seen is None else node_critical(seen, spec.kubernetes.node_critical),
        declared=declared,
    )


def _annotated_deadline(
    meta: ContainerMeta | None, refused: list[str]
) -> tuple[float | None, float | None]:
    when, work = _annotation(meta, DEADLINE_ANNOTATION), _annotation(meta, WORK_ANNOTATION)
    if when is None and work is None:
        return None, None
    if when is None or work is None:
        lacks = DEADLINE_ANNOTATION if when is None else WORK_ANNOTATION
        refused.append(f"a deadline needs both annotations; {lacks} is missing: no deadline")
        return None, None
    try:
        deadline = parse_instant(when)
        cpu = parse_duration(work)
        if not cpu > 0:
            raise ValueError("must be more than 0")
    except (ValueError, TypeError) as e:
        refused.append(f"annotations {DEADLINE_ANNOTATION}/{WORK_ANNOTATION}: {e}: no deadline")
        return None, None
    return deadline, cpu


def _kubernetes(rule: Rule) -> bool:
    return any(s is not None and s.kubernetes for s in (rule.tenant_from, rule.class_from))


def assign(
    workloads: Iterable[WorkloadIdentity], spec: PolicySpec, pods: PodDirectory | None = None
) -> dict[str, Assignment]:
    """Assignments by cgroup path; workloads that no rule matches are left out (left alone).
    `pods`: the API server's view of the node's pods (Kubernetes mode), which wins over
    what CRI said at their creation."""
    out: dict[str, Assignment] = {}
    for w in workloads:
        w = with_api_view(w, pods)  # noqa: PLW2901
        for rule in spec.rules:
            terms = match_terms(rule.match, w)
            if terms is not None:
                out[w.path] = _assignment(rule, w, terms, spec, pods)
                break
    return out


def unmatched_for_metadata(w: WorkloadIdentity, spec: PolicySpec) -> list[str]:
    """The rules, before the one that claims `w` (or all), that need runtime metadata `w`
    has not got: said by `workloads`, so that an operator sees why a rule did not match."""
    if w.meta is not None:
        return [
            f"rule {r.name}: labels unknown ({w.meta.incomplete})"
            for r in _before_claim(w, spec)
            if r.match.labels is not None and w.meta.incomplete is not None
            and matches(r.match, replace(w, meta=None), assume_meta=True)
        ]  # fmt: skip
    why = w.meta_problem or "no runtime metadata"
    return [
        f"rule {r.name} needs runtime metadata: {why}"
        for r in _before_claim(w, spec)
        if r.match.needs_metadata and matches(r.match, w, assume_meta=True)
    ]


def _before_claim(w: WorkloadIdentity, spec: PolicySpec) -> list[Rule]:
    out = []
    for rule in spec.rules:
        if matches(rule.match, w):
            break
        out.append(rule)
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
