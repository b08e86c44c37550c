"""The API-server watch: this node's pods (spec.nodeName=<node>) and the namespaces,
listed then watched from the list's resourceVersion, each event moving it on, a watch the
server ends made again from there, and a 410 Gone answered by listing afresh. Against a
labelled stand-in of the API server, through the real `kubernetes` client."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import structlog
from kube_standins import ApiServerStandIn, namespace, pod
from kubernetes import client as kube_client
from waits import wait_for

from nodeagent.errors import NodeagentError
from nodeagent.identity import Kind, Owner, QosTier, Runtime, WorkloadIdentity
from nodeagent.kube.apiwatch import ApiWatch, in_cluster, pod_of
from nodeagent.kube.owners import with_api_view
from nodeagent.meta import ContainerMeta, PodMeta
from nodeagent.policy.classify import assign
from nodeagent.policyfile.model import PolicySpec

UID = "6f1d2c3b-4a5e-4f60-8b7a-9c0d1e2f3a4b"
CID = "a1" * 32
CONTAINER = WorkloadIdentity(f"kubepods/burstable/pod{UID}/{CID}", Kind.CONTAINER,
                             Runtime.CONTAINERD, Owner.CGROUPFS, CID[:12], container_id=CID,
                             pod_uid=UID, qos=QosTier.BURSTABLE)  # fmt: skip


@pytest.fixture
def server() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as s:
        s.put("namespaces", namespace("research-nlp", {"team": "nlp"}))
        s.put("pods", pod("train-0", "research-nlp", UID, {"trainer": CID}))
        yield s


@pytest.fixture
def watch(server: ApiServerStandIn) -> Iterator[ApiWatch]:
    w = ApiWatch(kube_client.ApiClient(kube_client.Configuration(host=server.url)), "gpu-1",
                 timeout=5, watch_timeout=30)  # fmt: skip
    w.start()
    assert w.pods.synced.wait(20) and w.namespaces.synced.wait(20)
    both = "both watches"
    wait_for(lambda: server.watching["pods"].is_set() and server.watching["namespaces"].is_set(),
             20, both)  # fmt: skip
    yield w
    w.close()


def pod_requests(server: ApiServerStandIn) -> list[dict[str, str]]:
    return [q for path, q in server.requests if path == "/api/v1/pods"]


def test_lists_only_this_nodes_pods_then_watches_from_the_lists_version(
    server: ApiServerStandIn, watch: ApiWatch
) -> None:
    first, second = pod_requests(server)[:2]
    assert first["fieldSelector"] == "spec.nodeName=gpu-1" and "watch" not in first
    assert second["fieldSelector"] == "spec.nodeName=gpu-1"
    assert second["watch"] == "true" and second["allowWatchBookmarks"] == "true"
    assert second["resourceVersion"] == watch.pods.resource_version == str(server.rv)
    directory = watch.directory()
    (p,) = directory.pods.values()
    assert (p.uid, p.ref, p.containers, p.qos) == (UID, "research-nlp/train-0",
                                                   {CID: "trainer"}, QosTier.BURSTABLE)  # fmt: skip
    assert directory.namespaces == {"research-nlp": {"team": "nlp"}}
    assert p.images == {"trainer": "registry.example/train:1"}, "as the pod spec asks"


def test_a_containers_image_is_the_tag_its_pod_asked_for(
    server: ApiServerStandIn, watch: ApiWatch
) -> None:
    """containerd 1.6 and 1.7 report an image by its first tag (issue 35 item 5): the pod
    asked for registry.example/train:1, the runtime said registry.example/train:latest, a
    rule on the asked tag fell through. With the API server's view, the pod's own tag."""
    said = ContainerMeta("containerd", "trainer", "registry.example/train:latest",
                         pod=PodMeta("research-nlp", "train-0", UID))  # fmt: skip
    seen = with_api_view(replace(CONTAINER, meta=said), watch.directory())
    assert seen.meta is not None and seen.meta.image == "registry.example/train:1"
    spec = PolicySpec.model_validate({
        "version": 1, "tenants": {"r": {"shares": 1}},
        "rules": [{"name": "by-image", "match": {"image": "registry.example/train:1"},
                   "tenant": "r"}],
    })  # fmt: skip
    claimed = assign([replace(CONTAINER, meta=said)], spec, watch.directory())
    assert claimed[CONTAINER.path].rule == "by-image"


def test_later_label_edits_arrive_and_a_new_watch_starts_where_the_last_ended(
    server: ApiServerStandIn, watch: ApiWatch
) -> None:
    before = watch.directory().version
    server.put("pods", pod("train-0", "research-nlp", UID, {"trainer": CID},
                           labels={"nodeagent.io/class": "inference"}), "MODIFIED")  # fmt: skip
    wait_for(lambda: watch.directory().pods[UID].labels.get("nodeagent.io/class"), 20,
             "the label edit")  # fmt: skip
    assert watch.directory().version > before
    edited = str(server.rv)
    server.end_watch("pods")  # the server's timeoutSeconds ran out
    wait_for(lambda: len(pod_requests(server)) == 3, 20, "the watch made again")
    assert pod_requests(server)[2]["resourceVersion"] == edited
    assert watch.pods.lists == 1, "an ended watch is made again, not listed again"
    server.put("pods", pod("train-0", "research-nlp", UID, {"trainer": CID}), "DELETED")
    wait_for(lambda: not watch.directory().pods, 20, "the pod's deletion")


def test_410_gone_lists_afresh_and_watches_from_the_new_list(
    server: ApiServerStandIn, watch: ApiWatch
) -> None:
    # changes the watch never sees (the server compacted its history meanwhile)
    server.put("pods", pod("train-0", "research-nlp", UID, {"trainer": CID},
                           annotations={"nodeagent.io/tenant": "prod"}))  # fmt: skip
    server.put("pods", pod("serve-0", "research-nlp", "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d",
                           {"server": "c3" * 32}))  # fmt: skip
    server.expire("pods")
    wait_for(lambda: watch.pods.lists == 2, 20, "a second list after 410 Gone")
    wait_for(lambda: len(watch.directory().pods) == 2, 20, "both pods in the view")
    assert watch.directory().pods[UID].annotations == {"nodeagent.io/tenant": "prod"}
    lists = [q for q in pod_requests(server) if "watch" not in q]
    assert len(lists) == 2
    wait_for(server.watching["pods"].is_set, 20, "a watch from the new list")
    last = pod_requests(server)[-1]
    assert last["watch"] == "true" and last["resourceVersion"] == watch.pods.resource_version


def test_an_unreachable_server_keeps_the_last_view(
    server: ApiServerStandIn, watch: ApiWatch
) -> None:
    view = watch.directory()
    with structlog.testing.capture_logs() as logs:
        server.server.shutdown()
        server.server.server_close()
        server.end_watch("pods")

        def failed() -> bool:
            return any(e["event"] == "kubernetes.watch_failed" and e["kind"] == "pods"
                       for e in list(logs))  # fmt: skip

        wait_for(failed, 20, "the pods' watch to fail against the gone server")
    assert watch.directory().pods == view.pods
    pods = {r.name: r for r in watch.reach.now()}["api-server/pods"]
    assert not pods.up and pods.last_ok is not None and pods.error, pods
    assert pods.address.startswith("http"), "the server's URL"


def test_an_edit_on_the_api_server_reassigns_the_pod(
    server: ApiServerStandIn, watch: ApiWatch
) -> None:
    """CRI gives labels as they were at sandbox creation; the watch gives later edits."""
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"mode": "kubernetes"},
            "kubernetes": {"api_server": {"watch": True}, "tenant_label": "nodeagent.io/tenant",
                           "namespaces": {"research-*": {"tenant": "research", "allow": ["nlp"],
                                                         "classes": ["training"]}}},
            "tenants": {"research": {"shares": 1}, "nlp": {"shares": 1}, "prod": {"shares": 1}},
            "rules": [{"name": "pods", "match": {"kind": "container"}, "tenant": "research",
                       "tenant_from": {"kubernetes": True}, "class_from": {"kubernetes": True}}],
        }
    )  # fmt: skip
    (first,) = assign([CONTAINER], spec, watch.directory()).values()
    assert (first.tenant, str(first.workload_class)) == ("research", "batch")
    # whoever labels the namespace chooses only among the tenants its entry allows
    server.put("namespaces", namespace("research-nlp", {"nodeagent.io/tenant": "prod"}),
               "MODIFIED")  # fmt: skip
    wait_for(lambda: watch.directory().namespaces["research-nlp"].get("nodeagent.io/tenant"),
             20, "the namespace's tenant label")  # fmt: skip
    (labelled,) = assign([CONTAINER], spec, watch.directory()).values()
    assert labelled.tenant == "research"
    assert labelled.refused == (
        "namespace research-nlp's label nodeagent.io/tenant='prod' names a tenant the namespace"
        " may not use (it may: research, nlp); refused",
    )
    server.put("pods", pod("train-0", "research-nlp", UID, {"trainer": CID},
                           annotations={"nodeagent.io/class": "training"}), "MODIFIED")  # fmt: skip
    server.put("namespaces", namespace("research-nlp", {"nodeagent.io/tenant": "nlp"}),
               "MODIFIED")  # fmt: skip
    wait_for(lambda: watch.directory().namespaces["research-nlp"].get("nodeagent.io/tenant")
             == "nlp", 20, "the namespace's tenant label")  # fmt: skip
    wait_for(lambda: watch.directory().pods[UID].annotations, 20, "the pod's class annotation")
    (now,) = assign([CONTAINER], spec, watch.directory()).values()
    assert (now.tenant, str(now.workload_class)) == ("nlp", "training")


def test_a_server_that_keeps_answering_410_is_not_listed_in_a_tight_loop(
    server: ApiServerStandIn, watch: ApiWatch
) -> None:
    server.oldest = 10**9  # every watch is too old, even from a fresh list
    server.end_watch("pods")
    wait_for(lambda: watch.pods.lists >= 2, 20, "the re-list at once after the first 410")
    # no wait on anything: how many lists 2.5 s hold is the rate under test; with backoff
    # (2 s, then 5 s, ...) a handful, not thousands
    time.sleep(2.5)
    assert watch.pods.lists <= 4, watch.pods.lists


def test_watching_without_a_node_name_is_one_line_saying_where_it_comes_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    from nodeagent.errors import NodeagentError
    from nodeagent.kube.node import KubernetesNode

    monkeypatch.delenv("NODE_NAME", raising=False)
    spec = PolicySpec.model_validate(
        {"version": 1, "agent": {"mode": "kubernetes"}, "tenants": {"a": {"shares": 1}},
         "kubernetes": {"api_server": {"watch": True}}}
    )  # fmt: skip
    with pytest.raises(NodeagentError) as info:
        KubernetesNode(spec)
    assert str(info.value) == (
        "kubernetes.api_server.watch and publish.node_resource_topology need this node's"
        " name: set NODE_NAME (the DaemonSet sets it from the downward API) or"
        " kubernetes.node_name"
    )


def test_a_pod_without_a_status_yet_is_read_not_raised_on() -> None:
    """A pod just made may come with no status: reading it must not raise, which would stop
    the watch at that event and freeze the pods' view."""
    bare = kube_client.V1Pod(
        metadata=kube_client.V1ObjectMeta(uid="u-1", namespace="ns", name="p", labels={"a": "b"}),
        spec=None,
        status=None,
    )
    read = pod_of(bare)
    assert (read.uid, read.name, read.labels, read.containers, read.qos) == (
        "u-1", "p", {"a": "b"}, {}, None
    )  # fmt: skip


def test_no_service_account_or_no_client_is_one_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The DaemonSet's pod died at start with a traceback when the image lacked the client
    (./scripts/test image, issue 35): both causes are one line the CLI prints."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(NodeagentError, match=r"pod's service account .* Service host/port"):
        in_cluster()
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    with pytest.raises(NodeagentError, match=r"pip install 'nodeagent\[kubernetes\]'"):
        in_cluster()
