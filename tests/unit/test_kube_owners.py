"""Who a pod belongs to (nodeagent.kube.owners): the tenant from its namespace (globs, or
a namespace label), a claim through nodeagent.io/tenant allowed only where the namespace
allows it (any other refused and reported), the class from the pod's annotations and
labels with the fallbacks the policy lists; and, through the rules, CRI pods (metadata as
the runtime gave it) and the API server's later edits winning over CRI."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from nodeagent.identity import Kind, Owner, QosTier, Runtime, WorkloadIdentity
from nodeagent.kube.owners import PodView, pod_class, pod_tenant
from nodeagent.kube.pods import Pod, PodDirectory
from nodeagent.meta import ContainerMeta, PodMeta, labels
from nodeagent.policy.classify import assign
from nodeagent.policyfile.load import check_text
from nodeagent.policyfile.model import PolicySpec, WorkloadClass
from nodeagent.policyfile.yamlfile import PolicyError

SPEC = PolicySpec.model_validate(
    {
        "version": 1,
        "kubernetes": {
            "namespaces": {
                "research-*": {"tenant": "research", "classes": ["inference", "training"]},
                "prod-*": {"tenant": "prod", "allow": ["research"]},
            },
            "tenant_label": "nodeagent.io/tenant",
            "api_server": {"watch": True},
            "class_from": [
                {"annotation": "nodeagent.io/class"},
                {"label": "nodeagent.io/class"},
                {"label": "koordinator.sh/qosClass",
                 "values": {"LS*": "inference", "BE": "besteffort"}},
                {"label": "kueue.x-k8s.io/queue-name",
                 "values": {"*train*": "training", "*": "batch"}},
                {"priority": {1000000: "inference", 1000: "training"}},
                {"qos": {"besteffort": "besteffort"}},
            ],
        },
        "tenants": {"research": {"shares": 1}, "prod": {"shares": 1}, "ops": {"shares": 1}},
    }
)  # fmt: skip
K = SPEC.kubernetes


def pod(
    namespace: str = "research-nlp",
    *,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    priority: int | None = None,
    qos: QosTier | None = None,
) -> PodView:
    return PodView(namespace, "p", labels or {}, annotations or {}, priority, qos)


def owner(p: PodView, ns_labels: dict[str, str] | None = None) -> tuple[object, ...]:
    tenant, refused = pod_tenant(p, ns_labels, K, SPEC.tenants)
    said = pod_class(p, K, WorkloadClass.BATCH, SPEC.classes)
    return (tenant, said.cls, refused + ((said.refused,) if said.refused is not None else ()))


def test_the_tenant_comes_from_the_namespace() -> None:
    assert owner(pod("research-nlp")) == ("research", WorkloadClass.BATCH, ())
    assert owner(pod("prod-serving")) == ("prod", WorkloadClass.BATCH, ())
    assert owner(pod("default")) == (None, WorkloadClass.BATCH, ())  # no entry: the rule's own


def test_a_namespace_label_chooses_among_the_tenants_its_entry_allows() -> None:
    label = {"nodeagent.io/tenant": "research"}
    assert owner(pod("prod-serving"), label) == ("research", WorkloadClass.BATCH, ())
    # the label chose: a pod there claims no other tenant, not even the entry's own
    claim = pod("prod-serving", annotations={"nodeagent.io/tenant": "prod"})
    assert owner(claim, label)[0::2] == ("research", (
        "pod prod-serving/p claims tenant 'prod', which namespace prod-serving may not use"
        " (it may: research); refused",
    ))  # fmt: skip
    assert owner(pod("research-x"), {"nodeagent.io/tenant": "research"})[0::2] == ("research", ())


@pytest.mark.parametrize(
    ("namespace", "named", "stays", "may"),
    [
        ("research-x", "ops", "research", "research"),  # a tenant its entry does not allow
        ("prod-serving", "ops", "prod", "prod, research"),
        ("default", "ops", None, "none named"),  # no entry: no label is taken
        ("research-x", "nobody", "research", "research"),  # no tenant of the policy
    ],
)
def test_a_namespace_label_naming_a_tenant_its_entry_does_not_allow_is_refused_and_reported(
    namespace: str, named: str, stays: str | None, may: str
) -> None:
    assert owner(pod(namespace), {"nodeagent.io/tenant": named}) == (stays, WorkloadClass.BATCH, (
        f"namespace {namespace}'s label nodeagent.io/tenant={named!r} names a tenant the"
        f" namespace may not use (it may: {may}); refused",
    ))  # fmt: skip


def test_a_claim_the_namespace_allows_is_taken() -> None:
    claim = pod("prod-serving", annotations={"nodeagent.io/tenant": "research"})
    assert owner(claim) == ("research", WorkloadClass.BATCH, ())


@pytest.mark.parametrize(
    ("namespace", "claimed", "stays", "may"),
    [
        ("research-nlp", "prod", "research", "research"),
        ("prod-serving", "ops", "prod", "prod, research"),
        ("default", "prod", None, "none named"),
    ],
)
def test_a_claim_the_namespace_may_not_use_is_refused_and_reported(
    namespace: str, claimed: str, stays: str | None, may: str
) -> None:
    claim = pod(namespace, annotations={"nodeagent.io/tenant": claimed})
    assert owner(claim) == (stays, WorkloadClass.BATCH, (
        f"pod {namespace}/p claims tenant {claimed!r}, which namespace {namespace} may not"
        f" use (it may: {may}); refused",
    ))  # fmt: skip


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        ({"annotations": {"nodeagent.io/class": "inference"},
          "labels": {"nodeagent.io/class": "batch"}}, WorkloadClass.INFERENCE),
        ({"labels": {"nodeagent.io/class": "training"}}, WorkloadClass.TRAINING),
        ({"labels": {"nodeagent.io/class": "not-a-class", "koordinator.sh/qosClass": "BE"}},
         WorkloadClass.BESTEFFORT),
        ({"labels": {"koordinator.sh/qosClass": "LSR"}}, WorkloadClass.INFERENCE),
        ({"labels": {"kueue.x-k8s.io/queue-name": "team-a-train"}}, WorkloadClass.TRAINING),
        ({"labels": {"kueue.x-k8s.io/queue-name": "team-a"}}, WorkloadClass.BATCH),
        ({"priority": 2000000000}, WorkloadClass.INFERENCE),
        ({"priority": 5000}, WorkloadClass.TRAINING),
        ({"priority": 10, "qos": QosTier.BESTEFFORT}, WorkloadClass.BESTEFFORT),
        ({"priority": 10, "qos": QosTier.BURSTABLE}, WorkloadClass.BATCH),
    ],
)  # fmt: skip
def test_the_class_comes_from_the_first_source_that_gives_one(
    meta: dict[str, Any], expected: WorkloadClass
) -> None:
    assert owner(pod(**meta))[1] == expected


UID = "6f1d2c3b-4a5e-4f60-8b7a-9c0d1e2f3a4b"
CID = "a1" * 32
RULES = {
    "agent": {"mode": "kubernetes"},
    "kubernetes": {"namespaces": {"research-*": {"tenant": "research",
                                                 "classes": ["inference", "training"]},
                                  "prod-*": {"tenant": "prod", "allow": ["research"]}}},
    "tenants": {"research": {"shares": 1}, "prod": {"shares": 1}, "ops": {"shares": 1}},
    "rules": [{"name": "pods", "match": {"kind": "container"}, "tenant": "ops",
               "tenant_from": {"kubernetes": True}, "class_from": {"kubernetes": True},
               "deadline_from_annotations": True}],
}  # fmt: skip


def cri_container(namespace: str, annotations: dict[str, str]) -> WorkloadIdentity:
    """A pod's container as discovery and the CRI adapter give it: the pod's namespace,
    name, uid, labels and annotations as the kubelet copied them onto its sandbox."""
    pod_meta = PodMeta(namespace, "train-0", UID, labels({}), labels(annotations))
    return WorkloadIdentity(
        f"kubepods/burstable/pod{UID}/{CID}", Kind.CONTAINER, Runtime.CONTAINERD,
        Owner.CGROUPFS, CID[:12], container_id=CID, pod_uid=UID, qos=QosTier.BURSTABLE,
        meta=ContainerMeta("containerd", name="trainer", pod=pod_meta),
    )  # fmt: skip


def test_cri_pods_get_their_tenant_from_the_namespace_and_class_and_deadline_from_annotations(
) -> None:  # fmt: skip
    classes = {"training": {"declared_deadlines": "scheduled"}}
    spec = PolicySpec.model_validate({"version": 1, **RULES, "classes": classes})
    due = {"nodeagent.io/deadline": "2026-12-01T18:00:00Z", "nodeagent.io/work": "2h"}
    w = cri_container("research-nlp", {"nodeagent.io/class": "training", **due})
    (a,) = assign([w], spec).values()
    assert (a.tenant, a.workload_class, a.deadline, a.work, a.refused) == (
        "research",
        WorkloadClass.TRAINING,
        1796148000.0,
        7200.0,
        (),
    )
    assert a.declared == "its annotations", "the pod's word, not the operator's"
    # issue 34 item 9: batch takes no deadline a pod declares (the default)
    (b,) = assign([cri_container("research-nlp", due)], spec).values()
    assert (b.workload_class, b.deadline, b.work, b.declared) == (
        WorkloadClass.BATCH, None, None, None
    )  # fmt: skip
    assert b.refused == (
        "annotations nodeagent.io/deadline/nodeagent.io/work: class batch takes no deadline a"
        " workload declares (classes.batch.declared_deadlines: refused): no deadline",
    )


def test_a_cri_pod_claiming_a_tenant_its_namespace_may_not_use_is_refused() -> None:
    spec = PolicySpec.model_validate({"version": 1, **RULES})
    allowed = cri_container("prod-serving", {"nodeagent.io/tenant": "research"})
    refused = cri_container("research-nlp", {"nodeagent.io/tenant": "prod"})
    (a,) = assign([allowed], spec).values()
    assert (a.tenant, a.refused) == ("research", ())
    (b,) = assign([refused], spec).values()
    assert (b.tenant, b.refused) == ("research", (
        "pod research-nlp/train-0 claims tenant 'prod', which namespace research-nlp may not"
        " use (it may: research); refused",
    ))  # fmt: skip


def test_the_api_servers_later_edit_wins_over_what_cri_said_at_creation() -> None:
    spec = PolicySpec.model_validate({"version": 1, **RULES})
    w = cri_container("research-nlp", {"nodeagent.io/class": "batch"})
    edited = Pod(UID, "research-nlp", "train-0", annotations={"nodeagent.io/class": "inference"},
                 containers={CID: "trainer"})  # fmt: skip
    (a,) = assign([w], spec, PodDirectory({UID: edited}, {}, 1)).values()
    assert a.workload_class is WorkloadClass.INFERENCE
    (b,) = assign([w], spec).values()
    assert b.workload_class is WorkloadClass.BATCH


def test_a_namespace_no_entry_names_leaves_the_rules_own_tenant() -> None:
    spec = PolicySpec.model_validate({"version": 1, **RULES})
    (a,) = assign([cri_container("default", {})], spec).values()
    assert (a.tenant, a.workload_class, a.refused) == ("ops", WorkloadClass.BATCH, ())


def test_a_namespaces_classes_are_checked_each_naming_its_line() -> None:
    text = (
        "version: 1\n"
        "agent: {mode: kubernetes}\n"
        "kubernetes:\n"
        "  namespaces:\n"
        '    "prod-*": {tenant: prod, classes: [inferense]}\n'
        '    "research-*": {tenant: research, class: gold}\n'
        "tenants: {prod: {shares: 1}, research: {shares: 1}}\n"
    )
    with pytest.raises(PolicyError) as e:
        check_text(text, "p.yaml")
    assert [str(p) for p in e.value.problems] == [
        "p.yaml:5:40: kubernetes.namespaces['prod-*'].classes[0]: must be 'inference',"
        " 'training', 'batch' or 'besteffort', got 'inferense'; did you mean 'inference'?",
        "p.yaml:6:45: kubernetes.namespaces['research-*'].class: must be 'inference',"
        " 'training', 'batch' or 'besteffort', got 'gold'",
    ]
