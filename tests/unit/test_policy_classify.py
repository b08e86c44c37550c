"""Classification: the first rule whose every given field matches claims the workload."""

from __future__ import annotations

from typing import Any

import pytest
from builders import CID, CID2, POD_UID, docker, job, k8s_container, service, spec

from nodeagent.identity import QosTier, WorkloadIdentity
from nodeagent.policy.base import Assignment
from nodeagent.policy.classify import assign
from nodeagent.policyfile.matching import matches
from nodeagent.policyfile.model import Match, WorkloadClass

DOCKER = docker()
K8S = k8s_container()
K8S_BESTEFFORT = k8s_container(CID, QosTier.BESTEFFORT)
CRON = service("cron.service")
JOB = job("nodeagent.slice/research-train-7")


def m(**fields: Any) -> Match:
    return Match.model_validate(fields)


@pytest.mark.parametrize(
    ("match", "workload", "expected"),
    [
        # empty match: everything
        (m(), DOCKER, True),
        (m(), CRON, True),
        # path glob; fnmatch's '*' crosses '/'
        (m(path="nodeagent.slice/research-*"), JOB, True),
        (m(path="nodeagent.slice/prod-*"), JOB, False),
        (m(path="system.slice/*"), DOCKER, True),
        (m(path="kubepods/*"), K8S, True),
        (m(path="kubepods/burstable/pod*/*"), K8S, True),
        (m(path="kubepods/besteffort/*"), K8S, False),
        (m(path="*.service"), CRON, True),
        (m(path="NODEAGENT.slice/*"), JOB, False),  # case-sensitive
        (m(path="nodeagent.slice/research-train-?"), JOB, True),
        (m(path="nodeagent.slice/research-train-[0-6]"), JOB, False),
        # name glob
        (m(name="cron.*"), CRON, True),
        (m(name="cron"), CRON, False),
        (m(name=f"{CID[:6]}*"), DOCKER, True),
        (m(name="research-*"), JOB, True),
        # attributes compare exactly
        (m(runtime="docker"), DOCKER, True),
        (m(runtime="docker"), K8S, False),
        (m(runtime="containerd"), K8S, True),
        (m(runtime="systemd"), CRON, True),
        (m(runtime="nodeagent"), JOB, True),
        (m(kind="container"), DOCKER, True),
        (m(kind="container"), CRON, False),
        (m(kind="service"), CRON, True),
        (m(kind="job"), JOB, True),
        (m(owner="systemd"), DOCKER, True),
        (m(owner="cgroupfs"), K8S, True),
        (m(owner="cgroupfs"), DOCKER, False),
        (m(owner="nodeagent"), JOB, True),
        (m(qos="burstable"), K8S, True),
        (m(qos="besteffort"), K8S, False),
        (m(qos="besteffort"), K8S_BESTEFFORT, True),
        (m(qos="burstable"), DOCKER, False),  # no qos at all
        (m(pod_uid=POD_UID), K8S, True),
        (m(pod_uid=POD_UID[:8]), K8S, False),  # exact, not a prefix
        (m(pod_uid=POD_UID), DOCKER, False),
        # container_id is a prefix
        (m(container_id=CID), DOCKER, True),
        (m(container_id=CID[:12]), DOCKER, True),
        (m(container_id=CID[:3]), DOCKER, True),
        (m(container_id=CID2[:12]), DOCKER, False),
        (m(container_id=CID[:12]), CRON, False),  # no container id
        (m(container_id=CID[1:12]), DOCKER, False),
        # all given fields must match
        (m(runtime="docker", kind="container", owner="systemd"), DOCKER, True),
        (m(runtime="docker", qos="burstable"), DOCKER, False),
        (m(qos="burstable", pod_uid=POD_UID, container_id=CID2[:12]), K8S, True),
        (m(qos="burstable", pod_uid=POD_UID, container_id=CID[:12]), K8S, False),
        (m(path="system.slice/*", kind="service"), DOCKER, False),
    ],
)
def test_matches(match: Match, workload: WorkloadIdentity, expected: bool) -> None:
    assert matches(match, workload) is expected


RULES = [
    {"name": "research-jobs", "match": {"path": "nodeagent.slice/research-*"},
     "tenant": "research", "class": "training"},
    {"name": "besteffort-pods", "match": {"qos": "besteffort"}, "tenant": "research",
     "class": "besteffort"},
    {"name": "k8s", "match": {"runtime": "containerd"}, "tenant": "prod", "class": "inference"},
    {"name": "docker", "match": {"runtime": "docker"}, "tenant": "research"},
    {"name": "all-containers", "match": {"kind": "container"}, "tenant": "prod"},
]  # fmt: skip


def test_first_match_wins() -> None:
    policy = spec({"research": 2, "prod": 1}, RULES)
    got = assign([JOB, K8S, K8S_BESTEFFORT, DOCKER, CRON], policy)
    assert got == {
        JOB.path: Assignment("research-jobs", "research", WorkloadClass.TRAINING),
        K8S.path: Assignment("k8s", "prod", WorkloadClass.INFERENCE),
        # matches besteffort-pods, k8s and all-containers: the first one wins
        K8S_BESTEFFORT.path: Assignment("besteffort-pods", "research", WorkloadClass.BESTEFFORT),
        DOCKER.path: Assignment("docker", "research", WorkloadClass.BATCH),  # default class
    }
    assert CRON.path not in got, "no rule matches: left alone"


def test_rule_order_decides() -> None:
    reordered = [RULES[4], *RULES[:4]]
    got = assign([K8S, DOCKER, JOB], spec({"research": 2, "prod": 1}, reordered))
    assert got[K8S.path].rule == "all-containers"
    assert got[DOCKER.path].rule == "all-containers"
    assert got[JOB.path].rule == "research-jobs"


def test_no_rules_assign_nothing() -> None:
    policy = spec({"a": 1}, [{"name": "none", "match": {"runtime": "podman"}, "tenant": "a"}])
    assert assign([DOCKER, K8S, CRON, JOB], policy) == {}
    assert assign([], policy) == {}
