"""Who a pod belongs to in Kubernetes mode, for rules with `tenant_from: {kubernetes: true}`
and `class_from: {kubernetes: true}`. Pure: the pod's metadata comes in.

Tenant: the namespace's `kubernetes.tenant_label` (when the API server is watched), else
the first `kubernetes.namespaces` glob that matches it. A pod may claim another tenant
with the `nodeagent.io/tenant` annotation (or label) only where its namespace `allow`s
it; any other claim is refused, reported, and the pod stays its namespace's. A namespace
no entry names leaves the pod to the rule's own tenant.

Class: the first `kubernetes.class_from` source that gives one, else the rule's own. (A
deadline comes from the nodeagent.io/deadline and nodeagent.io/work annotations with the
rule's `deadline_from_annotations`, as for any workload.)

What a pod says is read through `with_api_view`: the API server's view of it when its
watch knows the pod (edits since the pod was made), else what CRI said at its creation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from nodeagent.identity import QosTier, WorkloadIdentity
from nodeagent.kube.pods import PodDirectory
from nodeagent.meta import ContainerMeta, PodMeta, labels
from nodeagent.policyfile.glob import glob_matches
from nodeagent.policyfile.model import ClassSource, KubernetesSettings, WorkloadClass

TENANT = "nodeagent.io/tenant"


@dataclass(frozen=True, slots=True)
class PodView:
    """What the owner rules read of one pod."""

    namespace: str
    name: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    priority: int | None = None
    qos: QosTier | None = None

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def with_api_view(w: WorkloadIdentity, pods: PodDirectory | None) -> WorkloadIdentity:
    """`w` with its pod's metadata as the API server's watch has it now, when it knows the
    pod; otherwise as it is (CRI's, from the pod's creation, or none)."""
    if pods is None or w.pod_uid is None or w.pod_uid not in pods.pods:
        return w
    api = pods.pods[w.pod_uid]
    name = api.containers.get(w.container_id or "")
    meta = w.meta or ContainerMeta(runtime=str(w.runtime), name=name)
    pod = PodMeta(api.namespace, api.name, api.uid, labels(api.labels), labels(api.annotations))
    return replace(w, meta=replace(meta, pod=pod, name=meta.name or name))


def view(w: WorkloadIdentity, pods: PodDirectory | None) -> PodView | None:
    """The pod `w` is (or is in), from its metadata; priority from the API server's watch."""
    pod = w.meta.pod if w.meta is not None else None
    if pod is None:
        return None
    api = None if pods is None or w.pod_uid is None else pods.pods.get(w.pod_uid)
    return PodView(pod.namespace, pod.name, pod.labels, pod.annotations,
                   api.priority if api is not None else None, w.qos)  # fmt: skip


def namespace_tenant(
    namespace: str, ns_labels: Mapping[str, str] | None, settings: KubernetesSettings,
    tenants: Mapping[str, object],
) -> tuple[str | None, tuple[str, ...]]:  # fmt: skip
    """The namespace's tenant and the others its pods may claim."""
    if settings.tenant_label is not None and ns_labels is not None:
        named = ns_labels.get(settings.tenant_label)
        if named in tenants:
            return named, ()
    for glob, entry in settings.namespaces.items():
        if glob_matches(glob, namespace):
            return entry.tenant, entry.allow
    return None, ()


def pod_tenant(
    pod: PodView,
    ns_labels: Mapping[str, str] | None,
    settings: KubernetesSettings,
    tenants: Mapping[str, object],
) -> tuple[str | None, str | None]:
    """(the pod's tenant, None for the rule's own; a refused claim, as a sentence)."""
    tenant, allowed = namespace_tenant(pod.namespace, ns_labels, settings, tenants)
    claim = pod.annotations.get(TENANT, pod.labels.get(TENANT))
    if claim is None or claim == tenant:
        return tenant, None
    if tenant is not None and claim in allowed and claim in tenants:
        return claim, None
    may = ", ".join([t for t in (tenant, *allowed) if t]) or "none named"
    return tenant, (
        f"pod {pod.ref} claims tenant {claim!r}, which namespace {pod.namespace} may not use"
        f" (it may: {may}); refused"
    )


def _class(pod: PodView, source: ClassSource) -> WorkloadClass | None:
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
        return source.qos.get(pod.qos)
    return None


def pod_class(pod: PodView, settings: KubernetesSettings) -> WorkloadClass | None:
    """The class of the first `kubernetes.class_from` source that gives one."""
    return next((c for s in settings.class_from if (c := _class(pod, s)) is not None), None)
