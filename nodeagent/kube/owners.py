"""Who a pod belongs to in Kubernetes mode, for rules with `tenant_from: {kubernetes: true}`
and `class_from: {kubernetes: true}`. Pure: the pod's metadata comes in.

Tenant: the first `kubernetes.namespaces` glob that matches the namespace names it. The
namespace's `kubernetes.tenant_label` (when the API server is watched) chooses another
only among the tenants that entry `allow`s: whoever may label a namespace is not trusted
beyond what the operator listed for it, so a label naming any other tenant is refused and
reported, and the namespace keeps its entry's tenant. A pod may claim another tenant with
the `nodeagent.io/tenant` annotation (or label) only where its namespace `allow`s it (and
its namespace's label has not already chosen); any other claim is refused, reported, and
the pod stays its namespace's. A namespace no entry names leaves the pod to the rule's
own tenant, whatever its label says.

Class: the namespace's default (its entry's `class`, else the rule's own), or what the
first `kubernetes.class_from` source that gives one says. Every source is the pod
creator's to set (labels, annotations, priority class, QoS), so a class above the default
is taken only where the namespace's entry lists it in `classes`; any other claim above it
is refused, reported, and the pod keeps the default. A class at or below it is taken.
(A deadline comes from the nodeagent.io/deadline and nodeagent.io/work annotations with
the rule's `deadline_from_annotations`, as for any workload.)

What a pod says is read through `with_api_view`: the API server's view of it when its
watch knows the pod (edits since the pod was made), else what CRI said at its creation.
A view outside the bounds of `nodeagent.meta` costs that pod alone: its labels and
annotations are left unread, and it gets its namespace's tenant and default class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from nodeagent.identity import QosTier, WorkloadIdentity
from nodeagent.kube.pods import PodDirectory
from nodeagent.meta import BadAnswer, ContainerMeta, PodMeta, labels, optional_name
from nodeagent.policyfile.glob import glob_matches
from nodeagent.policyfile.matching import show
from nodeagent.policyfile.model import (
    ClassSettings,
    ClassSource,
    KubernetesSettings,
    NamespaceTenant,
    NodeCriticalSettings,
    WorkloadClass,
)

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
    try:
        own = labels(api.labels), labels(api.annotations, "annotations")
        asked = api.images.get(meta.name or name or "")
        if asked is not None:  # the tag the pod names, where the runtime may say another
            meta = replace(meta, image=optional_name(asked, "the pod spec's image"))
    except BadAnswer as e:
        # the pod's creator made this: it costs this pod its labels, never the others
        bare = PodMeta(api.namespace, api.name, api.uid)
        why = f"{UNREAD} pod {api.ref}: {e}"
        return replace(w, meta=replace(meta, pod=bare, name=meta.name or name, incomplete=why))
    pod = PodMeta(api.namespace, api.name, api.uid, *own)
    return replace(w, meta=replace(meta, pod=pod, name=meta.name or name))


UNREAD = "the API server's labels and annotations are not read for"
"""How `ContainerMeta.incomplete` starts when `with_api_view` refused a pod's view."""


def view(w: WorkloadIdentity, pods: PodDirectory | None) -> PodView | None:
    """The pod `w` is (or is in), from its metadata; priority from the API server's watch."""
    pod = w.meta.pod if w.meta is not None else None
    if pod is None:
        return None
    api = None if pods is None or w.pod_uid is None else pods.pods.get(w.pod_uid)
    return PodView(pod.namespace, pod.name, pod.labels, pod.annotations,
                   api.priority if api is not None else None, w.qos)  # fmt: skip


def namespace_entry(namespace: str, settings: KubernetesSettings) -> NamespaceTenant | None:
    """The first `kubernetes.namespaces` entry whose glob matches `namespace`."""
    return next((e for g, e in settings.namespaces.items() if glob_matches(g, namespace)), None)


def _may_choose(
    named: str, tenant: str | None, allowed: tuple[str, ...], tenants: Mapping[str, object]
) -> bool:
    """Whether a namespace's label or a pod's claim may name `named` over the entry's tenant:
    only a tenant the entry allows, and one the policy has."""
    return tenant is not None and named in allowed and named in tenants


def _may(tenant: str | None, allowed: tuple[str, ...]) -> str:
    """The tenants a namespace may use, as a refusal's sentence lists them."""
    return ", ".join([t for t in (tenant, *allowed) if t]) or "none named"


def namespace_tenant(
    namespace: str, ns_labels: Mapping[str, str] | None, settings: KubernetesSettings,
    tenants: Mapping[str, object],
) -> tuple[str | None, tuple[str, ...], str | None]:  # fmt: skip
    """The namespace's tenant, the others its pods may claim, and its label's refused
    choice as a sentence (None: none refused)."""
    entry = namespace_entry(namespace, settings)
    tenant, allowed = (entry.tenant, entry.allow) if entry is not None else (None, ())
    if settings.tenant_label is None or ns_labels is None:
        return tenant, allowed, None
    named = ns_labels.get(settings.tenant_label)
    if named is None or named == tenant:
        return tenant, allowed, None
    if _may_choose(named, tenant, allowed, tenants):
        return named, (), None  # the label chose: its pods claim no other
    return (
        tenant,
        allowed,
        (
            f"namespace {namespace}'s label {settings.tenant_label}={show(named)!r} names a tenant"
            f" the namespace may not use (it may: {_may(tenant, allowed)}); refused"
        ),
    )


def pod_tenant(
    pod: PodView,
    ns_labels: Mapping[str, str] | None,
    settings: KubernetesSettings,
    tenants: Mapping[str, object],
) -> tuple[str | None, tuple[str, ...]]:
    """The pod's tenant (None: the rule's own) and what was refused, a sentence each: its
    namespace's label, its own claim."""
    tenant, allowed, label = namespace_tenant(pod.namespace, ns_labels, settings, tenants)
    refused = (label,) if label is not None else ()
    claim = pod.annotations.get(TENANT, pod.labels.get(TENANT))
    if claim is None or claim == tenant:
        return tenant, refused
    if _may_choose(claim, tenant, allowed, tenants):
        return claim, refused
    return tenant, (
        *refused,
        f"pod {pod.ref} claims tenant {claim!r}, which namespace {pod.namespace} may not use"
        f" (it may: {_may(tenant, allowed)}); refused",
    )


def node_critical(pod: PodView, settings: NodeCriticalSettings) -> str | None:
    """Why the pod keeps the node running (`kubernetes.node_critical`), as a sentence; None:
    it does not."""
    glob = next((g for g in settings.namespaces if glob_matches(g, pod.namespace)), None)
    if glob is not None:
        return f"node-critical: pod {pod.ref} is in namespace {pod.namespace} ({glob!r})"
    floor = settings.min_priority
    if floor is not None and pod.priority is not None and pod.priority >= floor:
        return f"node-critical: pod {pod.ref} has priority {pod.priority} (at least {floor})"
    return None


def _class(pod: PodView, source: ClassSource) -> tuple[WorkloadClass, str] | None:
    """The class `source` gives the pod, and how to name where it came from."""
    if source.annotation is not None or source.label is not None:
        key, which = (
            (source.annotation, "annotation") if source.annotation is not None
            else (source.label or "", "label")
        )  # fmt: skip
        value = (pod.annotations if source.annotation is not None else pod.labels).get(key)
        if value is None:
            return None
        where = f"{which} {key}={show(value)}"
        if source.values is None:
            try:
                return WorkloadClass(value), where
            except ValueError:
                return None
        found = next((c for g, c in source.values.items() if glob_matches(g, value)), None)
        return None if found is None else (found, where)
    if source.priority is not None and pod.priority is not None:
        under = [t for t in source.priority if t <= pod.priority]
        return (source.priority[max(under)], f"priority {pod.priority}") if under else None
    if source.qos is not None and pod.qos is not None:
        found = source.qos.get(pod.qos)
        return None if found is None else (found, f"QoS {pod.qos}")
    return None


def above(cls: WorkloadClass, base: WorkloadClass, classes: Mapping[WorkloadClass, ClassSettings]
          ) -> bool:  # fmt: skip
    """Whether `cls` is treated better than `base`: a higher priority, or protected where
    `base` is not."""
    c, b = classes[cls], classes[base]
    return c.priority > b.priority or (c.protect and not b.protect)


@dataclass(frozen=True, slots=True)
class PodClass:
    """A pod's class, and the sentences that say why."""

    cls: WorkloadClass
    matched: str | None = None
    refused: str | None = None


def pod_class(
    pod: PodView, settings: KubernetesSettings, default: WorkloadClass,
    classes: Mapping[WorkloadClass, ClassSettings],
) -> PodClass:  # fmt: skip
    """The class of the first `kubernetes.class_from` source that gives one, where the
    pod's namespace may take it; else the namespace's default (its entry's `class`, else
    `default`, the rule's own)."""
    entry = namespace_entry(pod.namespace, settings)
    base = default if entry is None or entry.workload_class is None else entry.workload_class
    own = None if base == default else f"class {base} of namespace {pod.namespace}"
    found = next((c for s in settings.class_from if (c := _class(pod, s)) is not None), None)
    if found is None:
        return PodClass(base, own)
    cls, where = found
    allowed = () if entry is None else entry.classes
    if cls in allowed or not above(cls, base, classes):
        return PodClass(cls, f"class {cls} from the pod's {where} (kubernetes.class_from)")
    may = ", ".join(dict.fromkeys([*allowed, base]))
    return PodClass(base, own, (
        f"pod {pod.ref} claims class {cls!s} by its {where}, above what namespace"
        f" {pod.namespace} may take (it may: {may} and lower); refused: class {base}"
    ))  # fmt: skip
