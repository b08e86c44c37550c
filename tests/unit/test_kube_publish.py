"""What the node tells the scheduler: node-feature-discovery labels through a features.d
file for each simulated GPU node in config/gpus/ (tests/unit/data/features.d holds them,
as written), and a NodeResourceTopology v1alpha2 object validated against the CRD's own
schema (tests/unit/schemas) and published through the stand-in API server, which refuses
what the schema refuses. The GPUs are simulated (no GPU here); the kubelet and the API
server are labelled stand-ins."""

from __future__ import annotations

import os
import re
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import structlog
from kube_schemas import problems
from kube_standins import NRT_PATH, ApiServerStandIn, kubelet, load, node
from kubernetes import client as kube_client
from test_cli import REPO

from nodeagent.gpu.model import GpuState
from nodeagent.gpu.simulated import load_simulated
from nodeagent.kube.podresources import PodResourcesClient
from nodeagent.kube.publish import Publisher, node_resource_topology
from nodeagent.policyfile.model import ApiServerSettings, PolicySpec
from nodeagent.sense.gpus import GpuSensor

NODES = sorted((REPO / "config/gpus").glob("*.yaml"))
SHOWN = REPO / "tests/unit/data/features.d"
# a label as NFD's local source takes it: name=value, the name prefixed, the value a
# Kubernetes label value
LINE = re.compile(r"nodeagent\.io/[A-Za-z0-9][A-Za-z0-9._-]{0,61}[A-Za-z0-9]=[A-Za-z0-9]"
                  r"(?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")  # fmt: skip
ISLANDS = {
    "4x-a100-two-nvlink-pairs": ("4", "2_2", "false", "2"),
    "8x-l40s-pcie-dual-socket": ("8", "1_1_1_1_1_1_1_1", "false", "2"),
    "dgx-h100-nvswitch": ("8", "8", "true", "2"),
    "dgx1-v100-hybrid-cube-mesh": ("8", "8", "false", "2"),
    "h100-mig": ("1", "1", "false", "1"),
    "hgx2-16x-v100-nvswitch": ("16", "16", "true", "2"),
}


def state(path: Path) -> GpuState:
    read = GpuSensor(load_simulated(str(path))).read(())
    assert read is not None
    return read


@pytest.mark.parametrize("path", NODES, ids=[p.stem for p in NODES])
def test_the_features_file_of_each_simulated_node(path: Path, tmp_path: Path) -> None:
    spec = PolicySpec.model_validate(
        {"version": 1, "agent": {"mode": "kubernetes"}, "tenants": {"a": {"shares": 1}},
         "publish": {"node_features": str(tmp_path / "nodeagent")}}
    )  # fmt: skip
    publisher = Publisher(None, None, "gpu-1", lambda: ())  # type: ignore[arg-type]
    publisher.publish(state(path), spec)
    written = (tmp_path / "nodeagent").read_text()
    assert written == (SHOWN / path.stem).read_text()
    labels = dict(line.split("=", 1) for line in written.splitlines() if line[:1] != "#")
    assert all(LINE.fullmatch(f"{k}={v}") for k, v in labels.items()), labels
    count, sizes, nvswitch, numa = ISLANDS[path.stem]
    assert (labels["nodeagent.io/gpu.count"], labels["nodeagent.io/nvlink.island-sizes"],
            labels["nodeagent.io/nvlink.nvswitch"], labels["nodeagent.io/gpu.numa-nodes"]) == (
        count, sizes, nvswitch, numa)  # fmt: skip
    assert labels["nodeagent.io/gpu.simulated"] == "true"
    assert os.listdir(tmp_path) == ["nodeagent"], "no temp file is left beside it"


def test_the_file_is_written_only_when_it_changes_and_a_failure_is_said_once(
    tmp_path: Path,
) -> None:
    target = tmp_path / "features.d" / "nodeagent"
    spec = PolicySpec.model_validate(
        {"version": 1, "agent": {"mode": "kubernetes"}, "tenants": {"a": {"shares": 1}},
         "publish": {"node_features": str(target)}}
    )  # fmt: skip
    publisher = Publisher(None, None, "gpu-1", lambda: ())  # type: ignore[arg-type]
    pairs = state(NODES[0])
    with structlog.testing.capture_logs() as logs:
        publisher.publish(pairs, spec)
        publisher.publish(pairs, spec)
    assert [e["error"] for e in logs if e["event"] == "publish.failed"] == [
        f"publish.node_features {target}: cannot write it: No such file or directory"
    ]
    target.parent.mkdir()
    with structlog.testing.capture_logs() as logs:
        publisher.publish(pairs, spec)
    assert [e["event"] for e in logs] == ["publish.node_features", "publish.recovered"]
    inode = target.stat().st_ino
    publisher.publish(pairs, spec)
    assert target.stat().st_ino == inode, "the same text is not written again"
    publisher.publish(state(NODES[1]), spec)  # the GPUs changed
    assert target.stat().st_ino != inode
    assert target.read_text() == (SHOWN / NODES[1].stem).read_text()


PAIRS = REPO / "config/gpus/4x-a100-two-nvlink-pairs.yaml"
NODE_UID = "9d2f0c1e-0000-4000-8000-000000000001"
PUBLISH_NRT = PolicySpec.model_validate(
    {"version": 1, "agent": {"mode": "kubernetes"}, "tenants": {"a": {"shares": 1}},
     "publish": {"node_resource_topology": True}}
)  # fmt: skip


def api_client(api: ApiServerStandIn) -> kube_client.ApiClient:
    """A client of the stand-in API server, which knows node gpu-1."""
    api.nodes["gpu-1"] = node("gpu-1", NODE_UID)
    return kube_client.ApiClient(kube_client.Configuration(host=api.url))


def pairs_topology(tmp_path: Path) -> dict[str, Any]:
    with kubelet(tmp_path, load("podresources.json")) as k:
        c = PodResourcesClient(k.socket, 5)
        body = node_resource_topology(
            "gpu-1", state(PAIRS),
            c.allocatable(), c.list(), gpu_resources=("nvidia.com/gpu", "nvidia.com/mig-*"),
            owner={"name": "gpu-1", "uid": NODE_UID},
        )  # fmt: skip
        c.close()
    return body


def test_the_node_resource_topology_object_is_valid_against_its_schema(tmp_path: Path) -> None:
    body = pairs_topology(tmp_path)
    assert problems(body) == []
    assert body["zones"] == [
        {"name": "node-0", "type": "Node", "resources": [
            {"name": "nvidia.com/gpu", "capacity": 2, "allocatable": 2, "available": 0}]},
        {"name": "node-1", "type": "Node", "resources": [
            {"name": "nvidia.com/gpu", "capacity": 2, "allocatable": 2, "available": 1}]},
    ]  # fmt: skip
    assert body["metadata"]["annotations"] == {"nodeagent.io/simulated": "true"}
    broken = {**body, "zones": [{"name": "node-0"}]}  # no type: the schema says no
    assert problems(broken)


def test_the_object_is_created_then_replaced_through_the_api_server(tmp_path: Path) -> None:
    with ApiServerStandIn() as api, kubelet(tmp_path, load("podresources.json")) as k:
        client = api_client(api)
        listing = PodResourcesClient(k.socket, 5).list()
        held = [listing]
        publisher = Publisher(PodResourcesClient(k.socket, 5), client, "gpu-1", lambda: held[0])
        pairs = state(PAIRS)
        publisher.publish(pairs, PUBLISH_NRT)
        created = api.topologies["gpu-1"]
        assert created["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": "gpu-1",
             "uid": NODE_UID}
        ]  # fmt: skip
        held[0] = listing[1:]  # the trainer's pod ended: GPUs 0 and 1 are free
        publisher._published_at = -1e9  # its next update is due
        publisher.publish(pairs, PUBLISH_NRT)
        zones = api.topologies["gpu-1"]["zones"]
        assert [z["resources"][0]["available"] for z in zones] == [2, 1]
        publisher._published_at = -1e9
        publisher.publish(pairs, PUBLISH_NRT)  # nothing changed: nothing sent
    assert api.writes == [("POST", NRT_PATH), ("PUT", f"{NRT_PATH}/gpu-1")]


def test_the_docs_show_the_labels_as_written() -> None:
    shown = (SHOWN / "4x-a100-two-nvlink-pairs").read_text().split("\n", 2)[2]
    assert f"```\n{shown}```" in (REPO / "docs" / "kubernetes.md").read_text()


def test_an_object_another_producer_keeps_is_left_alone_and_said_once(tmp_path: Path) -> None:
    with ApiServerStandIn() as api, kubelet(tmp_path, load("podresources.json")) as k:
        client = api_client(api)
        theirs = {"apiVersion": "topology.node.k8s.io/v1alpha2", "kind": "NodeResourceTopology",
                  "metadata": {"name": "gpu-1", "resourceVersion": "7",
                               "labels": {"app.kubernetes.io/managed-by": "nfd-topology-updater"}},
                  "zones": []}  # fmt: skip
        api.topologies["gpu-1"] = theirs
        publisher = Publisher(PodResourcesClient(k.socket, 5), client, "gpu-1", lambda: ())
        pairs = state(PAIRS)
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                publisher._published_at = -1e9
                publisher.publish(pairs, PUBLISH_NRT)
    assert api.topologies["gpu-1"] is theirs and api.writes == []
    assert [e["error"] for e in logs if e["event"] == "publish.failed"] == [
        "NodeResourceTopology gpu-1 has another producer (app.kubernetes.io/managed-by:"
        " nfd-topology-updater): left as it is; turn publish.node_resource_topology off, or"
        " that producer"
    ]


def test_an_api_server_that_never_answers_costs_the_tick_its_deadline_only(
    tmp_path: Path,
) -> None:
    """publish runs on the loop's thread: a server that takes the connection and never
    answers must not hang it (the kubernetes client has no deadline of its own)."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepted by the kernel, never read
    port = silent.getsockname()[1]
    spec = PUBLISH_NRT.model_copy(
        update={
            "kubernetes": PUBLISH_NRT.kubernetes.model_copy(
                update={"api_server": ApiServerSettings(timeout=0.5)}
            )
        }
    )
    try:
        with kubelet(tmp_path, load("podresources.json")) as k:
            client = kube_client.ApiClient(
                kube_client.Configuration(host=f"http://127.0.0.1:{port}")
            )
            publisher = Publisher(PodResourcesClient(k.socket, 5), client, "gpu-1", lambda: [])
            done = threading.Event()

            def publish() -> None:
                publisher.publish(state(PAIRS), spec)
                done.set()

            with structlog.testing.capture_logs() as logs:
                worker = threading.Thread(target=publish, daemon=True)
                worker.start()
                worker.join(timeout=60)
            assert done.is_set(), "publish hung on a silent API server"
    finally:
        silent.close()
    failed = [e for e in logs if e["event"] == "publish.failed"]
    assert len(failed) == 1 and failed[0]["what"] == "topology", logs
    assert "timed out" in failed[0]["error"].lower(), failed[0]
