"""What a pod may choose of its own standing in Kubernetes mode (issue 34, items 2 and 3).

A pod's labels, annotations, priority class and QoS are its creator's to set: they raise
its class above its namespace's default only where the policy's `kubernetes.namespaces`
entry lists that class, and a refused claim is said (a `rule.value_refused` event). A pod
whose metadata is outside the bounds (1025 labels) costs that pod alone: it gets its
namespace's tenant and default class, the tick goes on for every other pod.

The daemon ticks (dry run) on the pods' cgroups; the pods are known through the API-server
watch against its labelled stand-in, through the real `kubernetes` client, and the
kubelet's PodResources through its stand-in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from kube_standins import ApiServerStandIn, namespace, pod
from test_kube_podresources import (
    CGROUP,
    INFER_UID,
    SERVER,
    SHIPPER,
    TRAIN_UID,
    TRAINER,
    kube_agent,
)
from waits import wait_for

from nodeagent.daemon import Agent
from nodeagent.policyfile.model import PolicySpec

TRAIN = {"trainer": TRAINER, "log-shipper": SHIPPER}


def with_namespaces(namespaces: dict[str, Any]) -> Callable[[Path, str], PolicySpec]:
    """The shipped DaemonSet policy's shape: tenants by namespace (`namespaces`), classes
    from the pods (kubernetes.class_from, its defaults), one rule for every container."""

    def make(tmp_path: Path, socket: str) -> PolicySpec:
        return PolicySpec.model_validate(
            {
                "version": 1,
                "agent": {"mode": "kubernetes", "state_file": str(tmp_path / "state.json")},
                "kubernetes": {"pod_resources_socket": socket, "namespaces": namespaces},
                "tenants": {"research": {"shares": 1}, "prod": {"shares": 1}},
                "rules": [{"name": "pods", "match": {"kind": "container", "path": "kubepods*"},
                           "tenant": "research", "tenant_from": {"kubernetes": True},
                           "class": "batch", "class_from": {"kubernetes": True}}],
            }
        )  # fmt: skip

    return make


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        server.put("namespaces", namespace("research-nlp"))
        server.put("namespaces", namespace("prod-serving"))
        server.put("pods", pod("train-llm-0", "research-nlp", TRAIN_UID, TRAIN))
        server.put("pods", pod("infer-7d9f5c-qz8mw", "prod-serving", INFER_UID,
                               {"server": SERVER}, qos="Guaranteed"))  # fmt: skip
        yield server


@pytest.fixture
def agent(tmp_path: Path, api: ApiServerStandIn) -> Iterator[Agent]:
    # no namespace names a class: as the shipped policy was on 645b2ad
    names = {"research-*": "research", "prod-*": "prod"}
    with kube_agent(tmp_path, api, with_namespaces(names)) as (a, _):
        yield a


def edit_train_pod(
    a: Agent, api: ApiServerStandIn, *, labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> None:  # fmt: skip
    """The training pod's labels and annotations as its creator edits them, once the
    daemon's watch has them."""
    api.put("pods", pod("train-llm-0", "research-nlp", TRAIN_UID, TRAIN, labels=labels,
                        annotations=annotations), "MODIFIED")  # fmt: skip
    assert a.rec.kube is not None
    kube = a.rec.kube
    seen = "the watch to see the pod's edit"
    wait_for(
        lambda: (
            (
                dict(kube.pods().pods[TRAIN_UID].labels),
                dict(kube.pods().pods[TRAIN_UID].annotations),
            )
            == (labels or {}, annotations or {})
        ),
        20,
        seen,
    )


def refusals(logs: list[MutableMapping[str, Any]]) -> dict[str, str]:
    return {e["cgroup"]: e["refused"] for e in logs if e["event"] == "rule.value_refused"}


@pytest.mark.parametrize(
    ("meta", "where"),
    [
        ({"annotations": {"nodeagent.io/class": "inference"}},
         "annotation nodeagent.io/class=inference"),
        ({"labels": {"nodeagent.io/class": "inference"}}, "label nodeagent.io/class=inference"),
        ({"labels": {"koordinator.sh/qosClass": "LSE"}}, "label koordinator.sh/qosClass=LSE"),
    ],
)  # fmt: skip
def test_a_pod_cannot_raise_its_own_class_above_its_namespaces_default(
    agent: Agent, api: ApiServerStandIn, meta: dict[str, dict[str, str]], where: str
) -> None:
    edit_train_pod(agent, api, labels=meta.get("labels"), annotations=meta.get("annotations"))
    with structlog.testing.capture_logs() as logs:
        record = agent.tick()
    assert {p: (x.tenant, str(x.workload_class)) for p, x in record.assignments.items()} == {
        CGROUP[TRAINER]: ("research", "batch"),
        CGROUP[SHIPPER]: ("research", "batch"),
        CGROUP[SERVER]: ("prod", "batch"),
    }
    assert refusals(logs)[CGROUP[TRAINER]] == (
        f"pod research-nlp/train-llm-0 claims class inference by its {where}, above what"
        " namespace research-nlp may take (it may: batch and lower); refused: class batch"
    )


def test_a_pod_may_lower_its_class_and_take_one_its_namespace_lists(
    tmp_path: Path, api: ApiServerStandIn
) -> None:
    listed = with_namespaces({
        "research-*": {"tenant": "research", "classes": ["training"]},
        "prod-*": {"tenant": "prod", "class": "inference"},
    })  # fmt: skip

    with kube_agent(tmp_path, api, listed) as (a, _):
        edit_train_pod(a, api, annotations={"nodeagent.io/class": "training"})
        api.put("pods", pod("infer-7d9f5c-qz8mw", "prod-serving", INFER_UID, {"server": SERVER},
                            labels={"nodeagent.io/class": "besteffort"}), "MODIFIED")  # fmt: skip
        kube = a.rec.kube
        assert kube is not None
        wait_for(lambda: kube.pods().pods[INFER_UID].labels, 20, "the server pod's label")
        record = a.tick()
        assert {p: str(x.workload_class) for p, x in record.assignments.items()} == {
            CGROUP[TRAINER]: "training",  # listed for research-*
            CGROUP[SHIPPER]: "training",
            CGROUP[SERVER]: "besteffort",  # below its namespace's inference: always taken
        }
        api.put("pods", pod("infer-7d9f5c-qz8mw", "prod-serving", INFER_UID, {"server": SERVER}),
                "MODIFIED")  # fmt: skip
        wait_for(lambda: not kube.pods().pods[INFER_UID].labels, 20, "the label's removal")
        edit_train_pod(a, api, annotations={"nodeagent.io/class": "inference"})
        record = a.tick()
        assert {p: (str(x.workload_class), x.refused) for p, x in record.assignments.items()
                if p != CGROUP[SHIPPER]} == {
            CGROUP[TRAINER]: ("batch", (
                "pod research-nlp/train-llm-0 claims class inference by its annotation"
                " nodeagent.io/class=inference, above what namespace research-nlp may take"
                " (it may: training, batch and lower); refused: class batch",
            )),
            CGROUP[SERVER]: ("inference", ()),  # the namespace's default, unasked
        }  # fmt: skip


def test_one_pod_with_1025_labels_costs_that_pod_alone(agent: Agent, api: ApiServerStandIn) -> None:
    many = {f"example.com/l{i}": "x" for i in range(1025)}
    edit_train_pod(agent, api, labels=many, annotations={"nodeagent.io/class": "batch"})
    with structlog.testing.capture_logs() as logs:
        records = [agent.tick(), agent.tick()]
    assert not [e for e in logs if e["event"] == "tick.failed"]
    for record in records:
        assert {p: (x.tenant, str(x.workload_class)) for p, x in record.assignments.items()} == {
            CGROUP[TRAINER]: ("research", "batch"),  # its namespace's tenant and default
            CGROUP[SHIPPER]: ("research", "batch"),
            CGROUP[SERVER]: ("prod", "batch"),
        }
    said = refusals(logs)
    assert said[CGROUP[TRAINER]] == (
        "the API server's labels and annotations are not read for pod research-nlp/train-llm-0:"
        " 1025 labels, more than 1024: its labels and annotations choose nothing"
    )
    assert CGROUP[SERVER] not in said
