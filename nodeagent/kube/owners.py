"""Who a pod belongs to: its tenant from its namespace, its class and deadline from its
labels and annotations, as `kubernetes` in the policy says. Pure: the pods come in.

Tenant: the namespace's `kubernetes.tenant_label` (when the API server is watched), else
the first `kubernetes.namespaces` glob that matches it. A pod may claim another tenant
with the `nodeagent.io/tenant` annotation (or label) only where its namespace `allow`s
it; any other claim is refused, reported, and the pod stays its namespace's. A namespace
no entry names leaves the pod to the rule's own tenant.

Class: the first `kubernetes.class_from` source that gives one, else the rule's own.
Deadline: `nodeagent.io/deadline` (ISO 8601 with a UTC offset) and `nodeagent.io/work`
(CPU time, such as 2h), both or neither; a bad value is reported and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nodeagent.identity import QosTier
from nodeagent.kube.pods import Pod
from nodeagent.spec.glob import glob_matches
from nodeagent.spec.model import ClassSource, KubernetesSettings, WorkloadClass
from nodeagent.spec.units import parse_duration
from nodeagent.spec.when import parse_instant

TENANT = "nodeagent.io/tenant"
DEADLINE = "nodeagent.io/deadline"
WORK = "nodeagent.io/work"


@dataclass(frozen=True, slots=True)
class PodOwner:
    tenant: str | None
    """None: the namespace names no tenant, so the rule's own applies."""
    workload_class: WorkloadClass | None
    deadline: float | None = None
    work: float | None = None
    problems: tuple[str, ...] = ()
    """What was refused or could not be read, each a sentence naming the pod."""


def _meta(pod: Pod, key: str) -> str | None:
    return pod.annotations.get(key, pod.labels.get(key))


def namespace_tenant(
    namespace: str, labels: Mapping[str, str] | None, settings: KubernetesSettings,
    tenants: Mapping[str, object],
) -> tuple[str | None, tuple[str, ...]]:  # fmt: skip
    """The namespace's tenant and the others its pods may claim."""
    if settings.tenant_label is not None and labels is not None:
        named = labels.get(settings.tenant_label)
        if named in tenants:
            return named, ()
    for glob, entry in settings.namespaces.items():
        if glob_matches(glob, namespace):
            return entry.tenant, entry.allow
    return None, ()


def _class(pod: Pod, source: ClassSource) -> WorkloadClass | None:
    if source.annotation is not None or source.label is not None:
        value = (
            pod.annotations.get(source.annotation)
            if source.annotation is not None
            else pod.labels.get(source.label or "")
        )
        if value is None:
            return None
        if source.values is None:
            try:
                return WorkloadClass(value)
            except ValueError:
                return None
        return next((c for g, c in source.values.items() if glob_matches(g, value)), None)
    if source.priority is not None and pod.priority is not None:
        under = [t for t in source.priority if t <= pod.priority]
        return source.priority[max(under)] if under else None
    if source.qos is not None and pod.qos is not None:
        return source.qos.get(QosTier(pod.qos))
    return None


def pod_owner(
    pod: Pod,
    namespace_labels: Mapping[str, str] | None,
    settings: KubernetesSettings,
    tenants: Mapping[str, object],
) -> PodOwner:
    problems: list[str] = []
    tenant, allowed = namespace_tenant(pod.namespace, namespace_labels, settings, tenants)
    claim = _meta(pod, TENANT)
    if claim is not None and claim != tenant:
        if tenant is not None and claim in allowed and claim in tenants:
            tenant = claim
        else:
            may = ", ".join([t for t in (tenant, *allowed) if t]) or "none named"
            problems.append(
                f"pod {pod.ref} claims tenant {claim!r}, which namespace {pod.namespace}"
                f" may not use (it may: {may}); refused"
            )
    cls = next((c for s in settings.class_from if (c := _class(pod, s)) is not None), None)
    deadline = work = None
    given = {k: _meta(pod, k) for k in (DEADLINE, WORK)}
    if any(v is not None for v in given.values()):
        try:
            if given[DEADLINE] is None or given[WORK] is None:
                have = DEADLINE if given[WORK] is None else WORK
                raise ValueError(f"{have} needs {WORK if have == DEADLINE else DEADLINE}")
            deadline = parse_instant(given[DEADLINE])
            work = parse_duration(given[WORK])
            if work <= 0:
                raise ValueError(f"{WORK} must be more than 0")
        except ValueError as e:
            deadline = work = None
            problems.append(f"pod {pod.ref}: {e}; its deadline is ignored")
    return PodOwner(tenant, cls, deadline, work, tuple(problems))
