"""Rules on the names operators use (issue 16, part 3): match keys on runtime metadata,
tenant and class from labels within what the rule allows, deadlines from annotations."""

from __future__ import annotations

from typing import Any

import pytest

from nodeagent.identity import Kind, Owner, QosTier, Runtime, WorkloadIdentity
from nodeagent.meta import ContainerMeta, PodMeta, labels
from nodeagent.policy.classify import assign, unmatched_for_metadata
from nodeagent.policyfile.load import check_text
from nodeagent.policyfile.matching import matches
from nodeagent.policyfile.model import PolicySpec, WorkloadClass
from nodeagent.policyfile.nesting import nesting_warnings
from nodeagent.policyfile.yamlfile import PolicyError

CID = "c" * 64
UID = "0d6f6d1e-8a8b-4c1e-9b1a-1c2d3e4f5a6b"


def docker(name: str = "web-1", image: str = "nginx:1.25", **own: str) -> WorkloadIdentity:
    meta = ContainerMeta("docker", name, image, labels(own))
    return WorkloadIdentity(
        f"docker/{CID}", Kind.CONTAINER, Runtime.DOCKER, Owner.CGROUPFS, CID[:12],
        container_id=CID, meta=meta,
    )  # fmt: skip


def pod_container(
    pod_labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    namespace: str = "prod-inference",
    name: str = "app",
) -> WorkloadIdentity:
    pod = PodMeta(namespace, "web-0", UID, labels(pod_labels or {}), labels(annotations or {}))
    meta = ContainerMeta("containerd", name, "registry/app:2", pod=pod)
    return WorkloadIdentity(
        f"kubepods/burstable/pod{UID}/{CID}", Kind.CONTAINER, Runtime.CONTAINERD,
        Owner.CGROUPFS, CID[:12], container_id=CID, pod_uid=UID, qos=QosTier.BURSTABLE,
        meta=meta,
    )  # fmt: skip


def spec(*rules: dict[str, Any], classes: dict[str, Any] | None = None) -> PolicySpec:
    return PolicySpec.model_validate(
        {
            "version": 1,
            "tenants": {"team-a": {"shares": 2}, "team-b": {"shares": 1}, "big": {"shares": 9}},
            "rules": list(rules),
            "classes": classes or {},
        }
    )


def rule(match: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"name": "r", "match": match, "tenant": "team-a", **more}


@pytest.mark.parametrize(
    ("match", "hit"),
    [
        ({"container_name": "web-*"}, True),
        ({"container_name": "db-*"}, False),
        ({"image": "nginx:*"}, True),
        ({"labels": {"team": "a"}}, True),
        ({"labels": {"team": "a", "tier": "front*"}}, True),
        ({"labels": {"team": "a", "missing": "*"}}, False),  # every key must be there
        ({"labels": {"team": "b"}}, False),
        ({"namespace": "*"}, False),  # not in a pod
        ({"runtime": "docker", "labels": {"team": "?"}}, True),
    ],
)
def test_container_keys(match: dict[str, Any], hit: bool) -> None:
    w = docker(team="a", tier="frontend")
    assert bool(assign([w], spec(rule(match)))) is hit


@pytest.mark.parametrize(
    ("match", "hit"),
    [
        ({"namespace": "prod-*"}, True),
        ({"namespace": "dev"}, False),
        ({"pod_name": "web-?"}, True),
        ({"pod_labels": {"app.kubernetes.io/component": "inference"}}, True),
        ({"pod_labels": {"app.kubernetes.io/component": "train*"}}, False),
        ({"pod_annotations": {"owner": "*@example.com"}}, True),
        ({"namespace": "prod-*", "container_name": "app", "image": "registry/*"}, True),
    ],
)
def test_pod_keys(match: dict[str, Any], hit: bool) -> None:
    w = pod_container({"app.kubernetes.io/component": "inference"}, {"owner": "ops@example.com"})
    assert bool(assign([w], spec(rule(match)))) is hit


def test_explain_says_which_metadata_matched() -> None:
    w = pod_container({"app": "x"})
    a = assign([w], spec(rule({"namespace": "prod-*", "pod_labels": {"app": "x"}})))[w.path]
    assert a.matched == ("namespace=prod-inference", "pod_labels.app=x")


def test_without_metadata_a_metadata_rule_does_not_match_and_says_why() -> None:
    w = docker(team="a")
    silent = WorkloadIdentity(
        w.path, w.kind, w.runtime, w.owner, w.name, container_id=CID,
        meta_problem="docker does not answer: no socket at /run/docker.sock",
    )  # fmt: skip
    policy = spec(
        rule({"labels": {"team": "a"}}, name="team-a", tenant="team-a"),
        rule({"runtime": "docker"}, name="any-docker", tenant="team-b"),
    )
    assert assign([silent], policy)[w.path].rule == "any-docker", "managed by path all the same"
    assert unmatched_for_metadata(silent, policy) == [
        "rule team-a needs runtime metadata: docker does not answer: no socket at /run/docker.sock"
    ]
    assert assign([w], policy)[w.path].rule == "team-a"
    assert unmatched_for_metadata(w, policy) == []


def test_podman_from_disk_matches_names_not_labels() -> None:
    meta = ContainerMeta("podman", "p1", "localhost/x:1", incomplete="labels unknown: no API")
    w = WorkloadIdentity(
        f"libpod_parent/libpod-{CID}", Kind.CONTAINER, Runtime.PODMAN, Owner.CGROUPFS,
        CID[:12], container_id=CID, meta=meta,
    )  # fmt: skip
    policy = spec(rule({"labels": {"x": "*"}}, name="by-label"), rule({"container_name": "p1"}))
    assert assign([w], policy)[w.path].rule == "r"
    assert unmatched_for_metadata(w, policy) == [
        "rule by-label: labels unknown (labels unknown: no API)"
    ]


def test_tenant_and_class_from_labels_only_among_the_allowed() -> None:
    policy = spec(
        rule(
            {"namespace": "prod-*"},
            tenant="team-b",
            tenant_from={"pod_label": "nodeagent.io/tenant", "allowed": ["team-a", "team-b"]},
            class_from={"pod_annotation": "nodeagent.io/class", "allowed": ["inference", "batch"]},
        )
    )
    good = pod_container({"nodeagent.io/tenant": "team-a"}, {"nodeagent.io/class": "inference"})
    a = assign([good], policy)[good.path]
    assert (a.tenant, a.workload_class, a.refused) == ("team-a", WorkloadClass.INFERENCE, ())
    assert "tenant from pod label nodeagent.io/tenant=team-a" in a.matched

    # a pod cannot promote itself into a bigger share or a higher class
    bad = pod_container({"nodeagent.io/tenant": "big"}, {"nodeagent.io/class": "training"})
    a = assign([bad], policy)[bad.path]
    assert (a.tenant, a.workload_class) == ("team-b", WorkloadClass.BATCH)
    assert a.refused == (
        "pod label nodeagent.io/tenant='big' is not a tenant rule r may give (team-a, team-b):"
        " tenant team-b, the rule's own",
        "pod annotation nodeagent.io/class='training' is not a class rule r may give"
        " (inference, batch): class batch, the rule's own",
    )
    absent = pod_container()
    assert assign([absent], policy)[absent.path].refused == (), "no label: the rule's own, quietly"


def test_a_deadline_from_annotations() -> None:
    scheduled = {"batch": {"declared_deadlines": "scheduled"}}
    policy = spec(rule({"namespace": "*"}, deadline_from_annotations=True), classes=scheduled)
    notes = {"nodeagent.io/deadline": "2030-01-01T00:00:00Z", "nodeagent.io/work": "2h"}
    w = pod_container(annotations=notes)
    a = assign([w], policy)[w.path]
    assert (a.deadline, a.work, a.declared) == (1893456000.0, 7200.0, "its annotations")
    assert "deadline from annotations nodeagent.io/deadline=2030-01-01T00:00:00Z" in a.matched
    half = pod_container(annotations={"nodeagent.io/work": "2h"})
    a = assign([half], policy)[half.path]
    assert a.deadline is None and "nodeagent.io/deadline is missing" in a.refused[0]
    wrong = pod_container(annotations={**notes, "nodeagent.io/deadline": "tomorrow"})
    a = assign([wrong], policy)[wrong.path]
    assert a.deadline is None and "no deadline" in a.refused[0]
    off = spec(rule({"namespace": "*"}), classes=scheduled)
    assert assign([w], off)[w.path].deadline is None, "only where the rule says so"
    refused = assign([w], spec(rule({"namespace": "*"}, deadline_from_annotations=True)))
    assert refused[w.path].deadline is None, "nor where the class refuses it (the default)"
    assert "classes.batch.declared_deadlines: refused" in refused[w.path].refused[0]
    assert not any("deadline" in m for m in refused[w.path].matched)


def test_a_namespace_rule_without_kind_warns_of_nesting() -> None:
    """A pod's cgroup and its containers both have the pod's metadata: validate says so."""
    assert nesting_warnings(spec(rule({"namespace": "prod"})))
    assert not nesting_warnings(spec(rule({"namespace": "prod", "kind": "container"})))
    assert not nesting_warnings(spec(rule({"container_name": "app"}))), "pods have no name"


def test_pod_cgroups_match_pod_keys() -> None:
    pod = PodMeta("prod", "web-0", UID, labels({"app": "x"}))
    w = WorkloadIdentity(
        f"kubepods/burstable/pod{UID}", Kind.POD, Runtime.KUBELET, Owner.CGROUPFS, f"pod-{UID}",
        pod_uid=UID, qos=QosTier.BURSTABLE, meta=ContainerMeta("containerd", pod=pod),
    )  # fmt: skip
    assert matches(spec(rule({"pod_labels": {"app": "x"}})).rules[0].match, w)
    assert not matches(spec(rule({"container_name": "*"})).rules[0].match, w)


POLICY = """\
version: 1
tenants:
  team-a: {shares: 2}
rules:
  - name: k8s
    match:
      namespace: prod-*
      pod_labels: {app: web}
      pod_lables: {}
    tenant: team-a
    tenant_from: {pod_label: t, allowed: [team-a, nobody]}
    class_from: {pod_annotation: c, allowed: [gold]}
  - name: d
    match: {labels: {team: [a]}}
    tenant: team-a
    tenant_from: {label: x, pod_label: y, allowed: [team-a]}
    class_from: {label: c}
    deadline: 2030-01-01T00:00:00Z
    work: 1h
    deadline_from_annotations: true
"""


def test_validate_knows_the_new_keys() -> None:
    with pytest.raises(PolicyError) as e:
        check_text(POLICY, "p.yaml")
    assert [str(p) for p in e.value.problems] == [
        "p.yaml:9:7: unknown key 'pod_lables' in rules[0].match; did you mean 'pod_labels'?",
        "p.yaml:11:51: rules[0].tenant_from.allowed[1]: unknown tenant 'nobody'; tenants are"
        " 'team-a'",
        "p.yaml:12:47: rules[0].class_from.allowed[0]: must be 'inference', 'training',"
        " 'batch' or 'besteffort', got 'gold'",
        "p.yaml:14:28: rules[1].match.labels.team: must be a string, got a list",
        "p.yaml:16:18: rules[1].tenant_from: needs exactly one of label, pod_label, annotation,"
        " pod_annotation, kubernetes, got label, pod_label",
        "p.yaml:17:17: rules[1].class_from: needs allowed: the classes this rule may give (at"
        " least one)",
        "p.yaml:20:32: rules[1].deadline_from_annotations: the rule gives a deadline itself:"
        " annotations would never be read",
    ]


def test_a_pods_sandbox_is_matched_by_no_metadata_key() -> None:
    """The pause container has the pod's metadata, but a deadline or a share of the pod's
    rule must not go to it."""
    pod = PodMeta("prod", "web-0", UID, labels({"app": "x"}))
    w = WorkloadIdentity(
        f"kubepods/burstable/pod{UID}/{CID}", Kind.CONTAINER, Runtime.CONTAINERD,
        Owner.CGROUPFS, CID[:12], container_id=CID, pod_uid=UID,
        meta=ContainerMeta("containerd", pod=pod, sandbox=True),
    )  # fmt: skip
    policy = spec(
        rule({"namespace": "prod"}), rule({"qos": None, "runtime": "containerd"}, name="path")
    )
    assert assign([w], policy)[w.path].rule == "path"
