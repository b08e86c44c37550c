"""Beside the GPU device plugin: the kubelet's PodResources API (against a stand-in that
answers as the kubelet does: no kubelet runs here), its GPU UUIDs joined to the right
containers' cgroups, verification on them, power classes from the pods' classes, and no
CUDA_VISIBLE_DEVICES ever made for a pod; `exec --gpus` and `gpus reserve` refused.

The node is config/gpus/4x-a100-two-nvlink-pairs.yaml's GPUs (simulated: no GPU here),
with compute processes placed in the pods' containers' cgroups; the pods are known
through the API-server watch, against its stand-in, through the real `kubernetes` client.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from kube_standins import ApiServerStandIn, KubeletStandIn, kubelet, load, namespace, pod
from kubernetes import client as kube_client
from test_cli import REPO, assert_one_line_error, nodeagent

from nodeagent.api import client
from nodeagent.api.client import ApiRefused
from nodeagent.api.peer import Peer
from nodeagent.api.server import ApiServer, Request
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.commands import Commands
from nodeagent.daemon import Agent, open_agent
from nodeagent.gpu.simulated import load_simulated
from nodeagent.gpualloc import service as gpu_service
from nodeagent.gpualloc.service import GpuService
from nodeagent.kube.node import KubernetesNode
from nodeagent.kube.podresources import PodResourcesClient, PodResourcesError
from nodeagent.policyfile.model import ApiServerSettings, PolicySpec
from nodeagent.routes.gpus import GpuRoutes
from nodeagent.sense.gpus import GpuSensor
from nodeagent.wakeup import Wakeup

PAIRS = REPO / "config/gpus/4x-a100-two-nvlink-pairs.yaml"
GPU = [d.uuid for d in load_simulated(str(PAIRS)).inventory()]
TRAIN_UID = "6f1d2c3b-4a5e-4f60-8b7a-9c0d1e2f3a4b"
INFER_UID = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
TRAINER = "a1" * 32
SHIPPER = "b2" * 32
SERVER = "c3" * 32
CGROUP = {
    TRAINER: f"kubepods/burstable/pod{TRAIN_UID}/{TRAINER}",
    SHIPPER: f"kubepods/burstable/pod{TRAIN_UID}/{SHIPPER}",
    SERVER: f"kubepods/pod{INFER_UID}/{SERVER}",
}
FILES = {
    "cgroup.procs": "", "cgroup.events": "populated 1\nfrozen 0\n", "cgroup.freeze": "0\n",
    "cpu.stat": "usage_usec 100\nuser_usec 60\nsystem_usec 40\n", "cpu.weight": "100\n",
    "cpu.max": "max 100000\n", "memory.current": "4096\n", "memory.max": "max\n",
    "memory.high": "max\n", "memory.low": "0\n", "memory.min": "0\n",
}  # fmt: skip
PROCESSES = [
    {"pid": 101, "gpu": 0, "memory": "30Gi", "cgroup": CGROUP[TRAINER]},  # given to it
    {"pid": 102, "gpu": 3, "memory": "1Gi", "cgroup": CGROUP[TRAINER]},  # not given to it
    {"pid": 103, "gpu": 3, "memory": "1Gi", "cgroup": CGROUP[SHIPPER]},  # its pod gave it none
    {"pid": 104, "gpu": 2, "memory": "18Gi", "cgroup": CGROUP[SERVER] + "/sub"},  # given
]


def test_the_client_reads_what_the_kubelet_answers(tmp_path: Path) -> None:
    with kubelet(tmp_path, load("podresources.json")) as k:
        c = PodResourcesClient(k.socket, timeout=5)
        listing = {(d.namespace, d.pod, d.container): d.devices for d in c.list()}
        allocatable = c.allocatable()
        c.close()
    # containers without devices are not listed; a container's other devices are kept
    assert set(listing) == {
        ("research-nlp", "train-llm-0", "trainer"),
        ("prod-serving", "infer-7d9f5c-qz8mw", "server"),
    }
    (trainer,) = listing[("research-nlp", "train-llm-0", "trainer")]
    assert (trainer.resource, trainer.ids, trainer.numa_nodes) == (
        "nvidia.com/gpu", (GPU[0], GPU[1]), (0,)
    )  # fmt: skip
    assert [d.resource for d in listing[("prod-serving", "infer-7d9f5c-qz8mw", "server")]] == [
        "nvidia.com/gpu", "example.com/nic"
    ]  # fmt: skip
    gpus = [(d.ids, d.numa_nodes) for d in allocatable if d.resource == "nvidia.com/gpu"]
    assert gpus == [((GPU[0],), (0,)), ((GPU[1],), (0,)), ((GPU[2],), (1,)), ((GPU[3],), (1,))]
    assert k.calls == ["List", "GetAllocatableResources"]


def test_a_kubelet_that_does_not_answer_in_time_is_one_line_naming_the_socket(
    tmp_path: Path,
) -> None:
    with kubelet(tmp_path, load("podresources.json")) as k:
        k.delay = 3.0
        c = PodResourcesClient(k.socket, timeout=0.3)
        started = time.monotonic()
        with pytest.raises(PodResourcesError) as info:
            c.list()
        assert time.monotonic() - started < 2.5
        c.close()
    assert str(info.value) == f"kubelet PodResources List on {k.socket}: no answer within 0.3s"


def test_no_kubelet_socket_is_one_line_naming_it(tmp_path: Path) -> None:
    c = PodResourcesClient(str(tmp_path / "absent.sock"), timeout=1)
    with pytest.raises(PodResourcesError) as info:
        c.allocatable()
    c.close()
    message = str(info.value)
    assert message.startswith(
        f"kubelet PodResources GetAllocatableResources on {tmp_path}/absent.sock: UNAVAILABLE:"
    ), message
    assert "\n" not in message


# --- the daemon in Kubernetes mode -----------------------------------------------------


def policy(tmp_path: Path, socket: str) -> PolicySpec:
    node = yaml.safe_load(PAIRS.read_text())
    node["processes"] = PROCESSES
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(node))
    return PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"mode": "kubernetes", "state_file": str(tmp_path / "state.json")},
            "gpu": {"simulate": str(tmp_path / "node.yaml"),
                    "power": [{"class": "inference", "watts": 250}]},
            "kubernetes": {
                "pod_resources_socket": socket,
                "namespaces": {"research-*": {"tenant": "research", "classes": ["training"]},
                               "prod-*": {"tenant": "prod", "classes": ["inference"]}},
            },
            "tenants": {"research": {"shares": 1}, "prod": {"shares": 1}},
            "rules": [{"name": "pods", "match": {"kind": "container", "runtime": "containerd"},
                       "tenant": "research", "tenant_from": {"kubernetes": True},
                       "class_from": {"kubernetes": True}}],
        }
    )  # fmt: skip


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        server.put("namespaces", namespace("research-nlp"))
        server.put("namespaces", namespace("prod-serving"))
        server.put("pods", pod("train-llm-0", "research-nlp", TRAIN_UID,
                               {"trainer": TRAINER, "log-shipper": SHIPPER},
                               annotations={"nodeagent.io/class": "training"}))  # fmt: skip
        server.put("pods", pod("infer-7d9f5c-qz8mw", "prod-serving", INFER_UID,
                               {"server": SERVER}, qos="Guaranteed",
                               labels={"nodeagent.io/class": "inference"}))  # fmt: skip
        yield server


def watching(spec: PolicySpec, server: ApiServerStandIn) -> KubernetesNode:
    """The Kubernetes side as the daemon makes it with kubernetes.api_server.watch on, its
    client pointed at the stand-in instead of the in-cluster address; synced."""
    kube = spec.kubernetes.model_copy(
        update={"node_name": "gpu-1", "api_server": ApiServerSettings(watch=True)}
    )
    side = KubernetesNode(
        spec.model_copy(update={"kubernetes": kube}),
        api_client=kube_client.ApiClient(kube_client.Configuration(host=server.url)),
    )
    side.start()
    assert side.api is not None
    assert side.api.pods.synced.wait(20) and side.api.namespaces.synced.wait(20)
    return side


@pytest.fixture
def agent(tmp_path: Path, api: ApiServerStandIn) -> Iterator[tuple[Agent, KubeletStandIn]]:
    with kube_agent(tmp_path, api, policy) as both:
        yield both


@contextmanager
def kube_agent(
    tmp_path: Path, api: ApiServerStandIn, make: Callable[[Path, str], PolicySpec]
) -> Iterator[tuple[Agent, KubeletStandIn]]:
    """A dry-run daemon in Kubernetes mode on the pods' cgroups (files under tmp_path),
    with the policy `make(tmp_path, kubelet socket)`, its pods known through `api`."""
    root = tmp_path / "cgroup"
    for path in ["kubepods", "kubepods/burstable", f"kubepods/burstable/pod{TRAIN_UID}",
                 f"kubepods/pod{INFER_UID}", *CGROUP.values()]:  # fmt: skip
        (root / path).mkdir(parents=True, exist_ok=True)
        for name, text in FILES.items():
            (root / path / name).write_text(text)
    with KubeletStandIn(str(tmp_path / "kubelet.sock"), load("podresources.json")) as k:
        spec = make(tmp_path, k.socket)
        a = open_agent(spec, CgroupTree(str(root)), dry_run=True)
        assert a.rec.kube is not None
        a.rec.kube.close()
        a.rec.kube = watching(spec, api)
        a.rec.registry.resync()
        try:
            yield a, k
        finally:
            a.rec.kube.close()


def test_gpu_uuids_are_joined_to_the_right_containers(agent: tuple[Agent, Any]) -> None:
    a, k = agent
    record = a.tick()
    assert record.snapshot.gpus is not None
    holds = {h.owner: h for h in record.snapshot.gpus.holds}
    assert {o: (h.kind, h.uuids, h.indices, h.cgroup, h.workload_class)
            for o, h in holds.items()} == {
        "pod:research-nlp/train-llm-0/trainer":
            ("pod", tuple(sorted(GPU[:2])), (0, 1), CGROUP[TRAINER], "training"),
        "pod:prod-serving/infer-7d9f5c-qz8mw/server":
            ("pod", (GPU[2],), (2,), CGROUP[SERVER], "inference"),
    }  # fmt: skip
    assert "List" in k.calls
    # the tenants come from the namespaces, the classes from the pods' metadata
    assert {p: (x.tenant, str(x.workload_class)) for p, x in record.assignments.items()} == {
        CGROUP[TRAINER]: ("research", "training"),
        CGROUP[SHIPPER]: ("research", "training"),
        CGROUP[SERVER]: ("prod", "inference"),
    }


def test_the_kubelet_and_the_api_server_are_peers_in_the_tick_and_its_status(
    agent: tuple[Agent, Any], api: ApiServerStandIn
) -> None:
    """What nodeagent_peer_up and /v1/status show of the Kubernetes side: PodResources at
    its socket, and each kind the API server is watched for at the server's URL."""
    a, k = agent
    record = a.tick()
    assert {(p.name, p.address, p.up) for p in record.peers} >= {
        ("pod-resources", k.socket, True),
        ("api-server/pods", api.url, True),
        ("api-server/namespaces", api.url, True),
    }


def test_a_process_on_a_gpu_its_pod_was_not_given_is_a_violation(
    agent: tuple[Agent, Any],
) -> None:
    a, _ = agent
    record = a.tick()
    found = {
        n.fields["pid"]: (n.status, n.path) for n in record.plan.notes if n.kind == "gpu-violation"
    }
    assert found == {
        102: ("wrong-gpu", CGROUP[TRAINER]),
        103: ("unassigned", CGROUP[SHIPPER]),
    }


def test_power_caps_follow_the_pods_classes(agent: tuple[Agent, Any]) -> None:
    a, _ = agent
    record = a.tick()
    capped = {d.uuid: (d.value, d.reason) for d in record.plan.devices}
    assert capped[GPU[2]] == (250_000, "class inference holds it: capped at 250 W")
    assert GPU[0] not in capped and GPU[1] not in capped  # training: no cap, at the default


def test_no_cuda_visible_devices_is_ever_made_for_a_pod(
    agent: tuple[Agent, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only place nodeagent makes CUDA_VISIBLE_DEVICES is a job's environment: in
    Kubernetes mode the ledger holds nothing, and a pod's hold never becomes one."""
    a, _ = agent

    def refuse(hold: object) -> dict[str, str]:
        raise AssertionError(f"an environment was made for {hold}")

    monkeypatch.setattr(gpu_service, "environment", refuse)
    monkeypatch.setattr("nodeagent.routes.agent.environment", refuse)
    for _ in range(3):
        a.tick()
    assert a.rec.gpus.ledger.holds() == ()
    assert {h.kind for h in a.rec.gpus.view.holds()} == {"pod"}
    root = Request("GET", "/v1/gpus", {}, Peer(pid=1, uid=0, gid=0, groups=frozenset()))
    report = a.routes()["/v1/gpus"]["GET"](root)
    assert "CUDA_VISIBLE_DEVICES" not in str(report)


def test_gpus_the_kubelet_cannot_tie_to_a_cgroup_are_not_checked_and_said_once(
    tmp_path: Path,
) -> None:
    """Without the pods known (no watch, no CRI answer yet) the holds have no cgroup: a
    process on their GPUs is not taken for a violation, and the reason is logged once."""
    with kubelet(tmp_path, load("podresources.json")) as k:
        spec = policy(tmp_path, k.socket)
        (tmp_path / "cgroup").mkdir()
        a = open_agent(spec, CgroupTree(str(tmp_path / "cgroup")), dry_run=True)
        with pytest.MonkeyPatch.context() as m:
            events: list[dict[str, object]] = []
            m.setattr("nodeagent.kube.node.audit_warning",
                      lambda event, **f: events.append({"event": event, **f}))  # fmt: skip
            first, second = a.tick(), a.tick()
        assert a.rec.kube is not None
        a.rec.kube.close()
    assert first.snapshot.gpus is not None
    assert {h.cgroup for h in first.snapshot.gpus.holds} == {None}
    assert [n for n in second.plan.notes if n.kind == "gpu-violation" and
            n.fields["device"] in GPU[:3]] == []  # fmt: skip
    assert [e["message"] for e in events] == [
        f"pod:research-nlp/train-llm-0/trainer holds {GPU[0]}, {GPU[1]}: the pod is not known"
        " yet (neither CRI nor the API server's watch names it)",
        f"pod:prod-serving/infer-7d9f5c-qz8mw/server holds {GPU[2]}: the pod is not known"
        " yet (neither CRI nor the API server's watch names it)",
    ]


# --- exec --gpus and gpus reserve are refused ----------------------------------------------


@pytest.fixture
def kube_daemon() -> Iterator[str]:
    spec = PolicySpec.model_validate(
        {"version": 1, "agent": {"mode": "kubernetes"}, "tenants": {"a": {"shares": 1}},
         "jobs": {"default_tenant": "a"}}
    )  # fmt: skip
    service = GpuService(load_simulated(str(PAIRS)), lambda: spec, lambda c: True)
    service.sense(0.0)
    where = Path(tempfile.mkdtemp(prefix="nodeagent-kube-"))
    server = ApiServer(
        str(where / "api.sock"),
        Commands(Wakeup()).serve(
            GpuRoutes(service, lambda: spec, lambda t: 0.0).routes(), then=service.publish
        ),
    )
    server.start()
    try:
        yield str(where / "api.sock")
    finally:
        server.close()
        shutil.rmtree(where, ignore_errors=True)
    assert service.ledger.holds() == () and service.ledger.queue() == []


def test_exec_gpus_is_refused_with_one_line_saying_why(kube_daemon: str) -> None:
    proc = nodeagent("exec", "--socket", kube_daemon, "--gpus", "1", "--", "true")
    assert assert_one_line_error(proc) == (
        "nodeagent: error: nodeagent exec --gpus is refused: agent.mode is kubernetes, where"
        " the kubelet's device plugin assigns GPUs; request nvidia.com/gpu in a pod spec instead"
    )


def test_gpus_reserve_is_refused_with_one_line_saying_why(kube_daemon: str) -> None:
    proc = nodeagent("gpus", "reserve", "--socket", kube_daemon, "--name", "c1", "--count", "1")
    assert assert_one_line_error(proc).endswith(
        "nodeagent gpus reserve is refused: agent.mode is kubernetes, where the kubelet's"
        " device plugin assigns GPUs; request nvidia.com/gpu in a pod spec instead"
    )
    with pytest.raises(ApiRefused) as info:
        client.post(kube_daemon, "/v1/gpus/reservations", {"name": "c2", "count": 1})
    assert info.value.status == 400


def test_a_pod_claiming_a_tenant_its_namespace_may_not_use_is_refused_and_reported_once(
    agent: tuple[Agent, Any], api: ApiServerStandIn
) -> None:
    a, _ = agent
    a.tick()
    api.put("pods", pod("infer-7d9f5c-qz8mw", "prod-serving", INFER_UID, {"server": SERVER},
                        qos="Guaranteed", labels={"nodeagent.io/class": "inference"},
                        annotations={"nodeagent.io/tenant": "research"}), "MODIFIED")  # fmt: skip
    assert a.rec.kube is not None
    deadline = time.monotonic() + 20
    while not a.rec.kube.pods().pods[INFER_UID].annotations:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with structlog.testing.capture_logs() as logs:
        records = [a.tick(), a.tick()]
    assert {r.assignments[CGROUP[SERVER]].tenant for r in records} == {"prod"}
    assert [(e["cgroup"], e["refused"]) for e in logs if e["event"] == "rule.value_refused"] == [
        (CGROUP[SERVER], "pod prod-serving/infer-7d9f5c-qz8mw claims tenant 'research', which"
         " namespace prod-serving may not use (it may: prod); refused")
    ]  # fmt: skip


def test_without_the_watch_the_names_cri_gave_join_the_gpus(tmp_path: Path) -> None:
    """CRI names each container and its pod (agent.runtimes): enough to tie the kubelet's
    answer to the cgroups, with no API server at all."""
    from nodeagent.identity import Kind, Owner, QosTier, Runtime, WorkloadIdentity
    from nodeagent.kube.gpus import join
    from nodeagent.kube.pods import EMPTY
    from nodeagent.meta import ContainerMeta, PodMeta

    def container(cid: str, name: str, pod_name: str, ns: str, uid: str) -> WorkloadIdentity:
        return WorkloadIdentity(CGROUP[cid], Kind.CONTAINER, Runtime.CONTAINERD, Owner.CGROUPFS,
                                cid[:12], container_id=cid, pod_uid=uid, qos=QosTier.BURSTABLE,
                                meta=ContainerMeta("containerd", name=name,
                                                   pod=PodMeta(ns, pod_name, uid)))  # fmt: skip

    identities = [
        container(TRAINER, "trainer", "train-llm-0", "research-nlp", TRAIN_UID),
        container(SHIPPER, "log-shipper", "train-llm-0", "research-nlp", TRAIN_UID),
        container(SERVER, "server", "infer-7d9f5c-qz8mw", "prod-serving", INFER_UID),
    ]
    gpus = load_simulated(str(PAIRS))
    state = GpuSensor(gpus).read(())
    assert state is not None
    with kubelet(tmp_path, load("podresources.json")) as k:
        listing = PodResourcesClient(k.socket, 5).list()
    joined = join(listing, EMPTY, identities, gpu_resources=("nvidia.com/gpu",), gpus=state,
                  classes={})  # fmt: skip
    assert {h.owner: (h.cgroup, h.indices) for h in joined.holds} == {
        "pod:research-nlp/train-llm-0/trainer": (CGROUP[TRAINER], (0, 1)),
        "pod:prod-serving/infer-7d9f5c-qz8mw/server": (CGROUP[SERVER], (2,)),
    }
    assert joined.unjoined == ()
