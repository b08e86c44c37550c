"""Who a pod belongs to (nodeagent.kube.owners): the tenant from its namespace (globs, or
a namespace label), a claim through nodeagent.io/tenant allowed only where the namespace
allows it (any other refused and reported), the class from the pod's annotations and
labels with the fallbacks the policy lists, and its deadline from annotations."""

from __future__ import annotations

import pytest

from nodeagent.identity import QosTier
from nodeagent.kube.owners import pod_owner
from nodeagent.kube.pods import Pod
from nodeagent.spec.model import PolicySpec, WorkloadClass

SPEC = PolicySpec.model_validate(
    {
        "version": 1,
        "kubernetes": {
            "namespaces": {
                "research-*": "research",
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


def pod(namespace: str = "research-nlp", **kw: object) -> Pod:
    return Pod(uid="u1", namespace=namespace, name="p", **kw)  # type: ignore[arg-type]


def owner(p: Pod, ns_labels: dict[str, str] | None = None) -> tuple[object, ...]:
    o = pod_owner(p, ns_labels, K, SPEC.tenants)
    return (o.tenant, o.workload_class, o.problems)


def test_the_tenant_comes_from_the_namespace() -> None:
    assert owner(pod("research-nlp")) == ("research", None, ())
    assert owner(pod("prod-serving")) == ("prod", None, ())
    assert owner(pod("default")) == (None, None, ())  # no entry: the rule's own tenant


def test_a_namespace_label_names_the_tenant_when_the_api_server_says_it() -> None:
    assert owner(pod("default"), {"nodeagent.io/tenant": "ops"})[0] == "ops"
    assert owner(pod("research-x"), {"nodeagent.io/tenant": "ops"})[0] == "ops"
    # a label naming no tenant of the policy is not taken: the globs decide
    assert owner(pod("research-x"), {"nodeagent.io/tenant": "nobody"})[0] == "research"


def test_a_claim_the_namespace_allows_is_taken() -> None:
    claim = pod("prod-serving", annotations={"nodeagent.io/tenant": "research"})
    assert owner(claim) == ("research", None, ())


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
    assert owner(claim) == (stays, None, (
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
        ({"priority": 10, "qos": QosTier.BURSTABLE}, None),
    ],
)  # fmt: skip
def test_the_class_comes_from_the_first_source_that_gives_one(
    meta: dict[str, object], expected: WorkloadClass | None
) -> None:
    assert owner(pod(**meta))[1] == expected


def test_the_deadline_and_work_come_from_annotations() -> None:
    o = pod_owner(pod(annotations={"nodeagent.io/deadline": "2026-12-01T18:00:00Z",
                                   "nodeagent.io/work": "2h"}), None, K, SPEC.tenants)  # fmt: skip
    assert (o.deadline, o.work, o.problems) == (1796148000.0, 7200.0, ())


@pytest.mark.parametrize(
    ("annotations", "problem"),
    [
        ({"nodeagent.io/deadline": "2026-12-01T18:00:00Z"},
         "pod research-nlp/p: nodeagent.io/deadline needs nodeagent.io/work; its deadline is"
         " ignored"),
        ({"nodeagent.io/deadline": "tomorrow", "nodeagent.io/work": "2h"},
         "pod research-nlp/p: "),
        ({"nodeagent.io/deadline": "2026-12-01T18:00:00Z", "nodeagent.io/work": "0s"},
         "pod research-nlp/p: nodeagent.io/work must be more than 0; its deadline is ignored"),
    ],
)  # fmt: skip
def test_a_bad_deadline_annotation_is_reported_and_ignored(
    annotations: dict[str, str], problem: str
) -> None:
    o = pod_owner(pod(annotations=annotations), None, K, SPEC.tenants)
    assert (o.deadline, o.work) == (None, None)
    (found,) = o.problems
    assert found.startswith(problem) and found.endswith("; its deadline is ignored"), found
