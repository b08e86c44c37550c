"""Publishing the NodeResourceTopology has one deadline on the whole call (issue 34, item 8):
the kubernetes client's `_request_timeout` is per read, so an API server that trickles its
answer a byte a second held `read_node` (on the loop's thread) for 119 s.

The API server is a STAND-IN (no API server runs here): an HTTP server that answers the
first read of the Node a byte a second, then everything at once; the client is the real
`kubernetes` library.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import structlog
from kube_standins import kubelet, load, node, reply
from kubernetes import client as kube_client
from test_kube_publish import NODE_UID, PAIRS, PUBLISH_NRT, state

from nodeagent.kube.podresources import PodResourcesClient
from nodeagent.kube.publish import Publisher
from nodeagent.policyfile.model import ApiServerSettings

DEADLINE = 2.0
TRICKLED = 10
"""Bytes of the Node sent a second apart: 10 s, five times the deadline."""
CEILING = DEADLINE + 3.0
"""What one publish may hold the loop's thread, generously (a loaded host)."""


class TricklingApiServer:
    """STAND-IN API server: the first GET of the Node is answered TRICKLED bytes a second
    apart (each read within any per-read timeout), then the rest at once; the
    NodeResourceTopology is absent (404) until created (POST)."""

    def __init__(self) -> None:
        self.trickles = 1
        self.topologies: dict[str, dict[str, Any]] = {}
        self.stopping = threading.Event()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/api/v1/nodes/gpu-1":
                    stand_in._node(self)
                else:
                    found = stand_in.topologies.get(self.path.rsplit("/", 1)[-1])
                    reply(self, 200 if found else 404, found or {"kind": "Status", "code": 404})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                body["metadata"]["resourceVersion"] = "1"
                stand_in.topologies[body["metadata"]["name"]] = body
                reply(self, 201, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _node(self, handler: BaseHTTPRequestHandler) -> None:
        data = json.dumps(node("gpu-1", NODE_UID)).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.flush()
        if self.trickles > 0:
            self.trickles -= 1
            for i in range(TRICKLED):
                handler.wfile.write(data[i : i + 1])
                handler.wfile.flush()
                if self.stopping.wait(1.0):
                    return
            data = data[TRICKLED:]
        handler.wfile.write(data)

    def close(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def trickling() -> Iterator[TricklingApiServer]:
    server = TricklingApiServer()
    yield server
    server.close()


def test_a_trickling_api_server_costs_the_loop_its_deadline_and_the_ticks_go_on(
    trickling: TricklingApiServer, tmp_path: Path
) -> None:
    spec = PUBLISH_NRT.model_copy(
        update={
            "kubernetes": PUBLISH_NRT.kubernetes.model_copy(
                update={"api_server": ApiServerSettings(timeout=DEADLINE)}
            )
        }
    )
    client = kube_client.ApiClient(kube_client.Configuration(host=trickling.url))
    pairs = state(PAIRS)
    with (
        kubelet(tmp_path, load("podresources.json")) as k,
        structlog.testing.capture_logs() as logs,
    ):
        publisher = Publisher(PodResourcesClient(k.socket, 5), client, "gpu-1", lambda: [])
        t0 = time.monotonic()
        publisher.publish(pairs, spec)
        held = time.monotonic() - t0
        assert held < CEILING, (
            f"publish held the loop's thread {held:.1f} s; its deadline is {DEADLINE:g} s"
        )
        failed = [e["error"] for e in logs if e["event"] == "publish.failed"]
        assert len(failed) == 1 and "did not answer in 2 s in all" in failed[0], logs
        # the next ticks go on: a refresh due while the late call runs makes no other call
        publisher._published_at = -1e9
        t0 = time.monotonic()
        publisher.publish(pairs, spec)
        assert time.monotonic() - t0 < CEILING
        assert "has not finished answering" in logs[-1]["error"], logs[-1]
        assert trickling.topologies == {}, "nothing the late call learnt was used"
        # once the late call has ended (the trickle is over), the next refresh publishes
        ceiling = time.monotonic() + TRICKLED + 2 * CEILING
        while "gpu-1" not in trickling.topologies:
            assert time.monotonic() < ceiling, (
                f"no NodeResourceTopology {TRICKLED + 2 * CEILING:g} s after the trickle"
                " began: the late call never ended, or no refresh was made after it"
            )
            publisher._published_at = -1e9
            publisher.publish(pairs, spec)
            time.sleep(0.2)  # a refresh is due every REFRESH s; here as soon as may be
    assert [e["event"] for e in logs if e["event"].startswith("publish.")][-1] == (
        "publish.recovered"
    )
    owners = trickling.topologies["gpu-1"]["metadata"]["ownerReferences"]
    assert owners == [{"apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": NODE_UID}]
