"""Stand-ins for what cannot run here: no kubelet and no API server run on this machine.

`ApiServerStandIn` is an HTTP server that answers the two requests nodeagent's informers
make, as the real API server answers them: a list (a PodList / NamespaceList with a
resourceVersion) and a watch (newline-delimited watch events, ending when the test ends
the watch), including a watch answered with a 410 Gone ERROR event. The client that
talks to it is the real `kubernetes` library.

`KubeletStandIn` is a gRPC server on a Unix socket that answers the kubelet's
PodResources v1 `List` and `GetAllocatableResources` with data shaped like a real
kubelet's (tests/unit/data/podresources.json: a node with the NVIDIA device plugin).
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import grpc
from kube_schemas import problems

from nodeagent.kube.podresources import MESSAGES, SERVICE

DATA = Path(__file__).resolve().parent / "data"
END = object()


class ApiServerStandIn:
    """Labelled stand-in for the Kubernetes API server (list and watch of pods, namespaces)."""

    PATHS: ClassVar = {"/api/v1/pods": "pods", "/api/v1/namespaces": "namespaces"}
    LIST_KIND: ClassVar = {"pods": "PodList", "namespaces": "NamespaceList"}

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"pods": {}, "namespaces": {}}
        self.rv = 100
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.events: dict[str, queue.Queue[object]] = {k: queue.Queue() for k in self.objects}
        self.oldest = 0
        """A watch from a resourceVersion older than this is answered 410 Gone."""
        self.watching = {k: threading.Event() for k in self.objects}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.topologies: dict[str, dict[str, Any]] = {}
        """NodeResourceTopology objects by name, each checked against its CRD's schema."""
        self.writes: list[tuple[str, str]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # a watch is a chunked stream, as the server's

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                stand_in.requests.append((url.path, query))
                kind = stand_in.PATHS.get(url.path)
                if kind is None:
                    stand_in._get(self, url.path)
                    return
                if query.get("watch") == "true":
                    stand_in._watch(self, kind, query)
                else:
                    stand_in._list(self, kind)

            def do_POST(self) -> None:
                stand_in._write(self, "POST")

            def do_PUT(self) -> None:
                stand_in._write(self, "PUT")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ApiServerStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for q in self.events.values():
            q.put(END)
        self.server.shutdown()
        self.server.server_close()

    # --- what the test does ---------------------------------------------------------

    def put(self, kind: str, obj: dict[str, Any], event: str | None = None) -> None:
        """Store an object (a new resourceVersion); with `event`, send it to the watch."""
        self.rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        key = obj["metadata"].get("uid", obj["metadata"]["name"])
        if event == "DELETED":
            self.objects[kind].pop(key, None)
        else:
            self.objects[kind][key] = obj
        if event is not None:
            self.events[kind].put({"type": event, "object": obj})

    def end_watch(self, kind: str) -> None:
        """The server closes the watch (its timeoutSeconds ran out)."""
        self.watching[kind].clear()
        self.events[kind].put(END)

    def expire(self, kind: str) -> None:
        """Compact history: every resourceVersion before the current one is too old to
        watch from."""
        self.oldest = self.rv
        self.watching[kind].clear()
        self.events[kind].put(
            {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status":
             "Failure", "message": "too old resource version", "reason": "Expired",
             "code": 410}}
        )  # fmt: skip

    # --- the HTTP side -------------------------------------------------------------

    def _get(self, handler: BaseHTTPRequestHandler, path: str) -> None:
        name = path.rsplit("/", 1)[-1]
        if path.startswith("/api/v1/nodes/") and name in self.nodes:
            reply(handler, 200, self.nodes[name])
        elif path.startswith(NRT_PATH + "/") and name in self.topologies:
            reply(handler, 200, self.topologies[name])
        else:
            reply(handler, 404, _status(404, "NotFound", f"{path} not found"))

    def _write(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        """Create (POST) or replace (PUT, with the current resourceVersion) an NRT object,
        refused as the API server refuses it when its schema says no."""
        path = urlsplit(handler.path).path
        length = int(handler.headers.get("Content-Length") or 0)
        body = json.loads(handler.rfile.read(length))
        self.writes.append((method, path))
        name = body.get("metadata", {}).get("name", "")
        found = problems(body)
        if not path.startswith(NRT_PATH) or found:
            reply(handler, 422, _status(422, "Invalid", "; ".join(found) or path))
            return
        if method == "POST" and name in self.topologies:
            reply(handler, 409, _status(409, "AlreadyExists", f"{name} exists"))
            return
        if method == "PUT":
            current = self.topologies.get(name, {}).get("metadata", {}).get("resourceVersion")
            if body["metadata"].get("resourceVersion") != current:
                reply(handler, 409, _status(409, "Conflict", "the object has been modified"))
                return
        self.rv += 1
        body["metadata"]["resourceVersion"] = str(self.rv)
        self.topologies[name] = body
        reply(handler, 201 if method == "POST" else 200, body)

    def _list(self, handler: BaseHTTPRequestHandler, kind: str) -> None:
        body = {
            "kind": self.LIST_KIND[kind],
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self.rv)},
            "items": list(self.objects[kind].values()),
        }
        data = json.dumps(body).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _watch(self, handler: BaseHTTPRequestHandler, kind: str, query: dict[str, str]) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Connection", "close")
        handler.end_headers()

        def chunk(data: bytes) -> None:
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            handler.wfile.flush()

        try:
            if int(query.get("resourceVersion") or 0) < self.oldest:
                gone = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
                        "status": "Failure", "message": "too old resource version",
                        "reason": "Expired", "code": 410}}  # fmt: skip
                chunk(json.dumps(gone).encode() + b"\n")
                return
            self.watching[kind].set()
            while True:
                event = self.events[kind].get()
                if event is END:
                    return
                chunk(json.dumps(event).encode() + b"\n")
                if isinstance(event, dict) and event["type"] == "ERROR":
                    return
        finally:
            chunk(b"")


NRT_PATH = "/apis/topology.node.k8s.io/v1alpha2/noderesourcetopologies"


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
            "reason": reason, "code": code}  # fmt: skip


def reply(handler: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def node(name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": uid}}


def pod(name: str, namespace: str, uid: str, containers: dict[str, str], *, node: str = "gpu-1",
        labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        priority: int = 0, qos: str = "Burstable") -> dict[str, Any]:  # fmt: skip
    """A Pod as the API server returns it (the fields nodeagent reads, and the required)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid,
                     "labels": labels or {}, "annotations": annotations or {},
                     "creationTimestamp": "2026-12-01T09:00:00Z"},
        "spec": {
            "nodeName": node,
            "priority": priority,
            "containers": [{"name": c, "image": "registry.example/train:1"} for c in containers],
        },
        "status": {
            "phase": "Running",
            "qosClass": qos,
            "containerStatuses": [
                {"name": c, "containerID": f"containerd://{cid}", "ready": True,
                 "restartCount": 0, "image": "registry.example/train:1",
                 "imageID": "registry.example/train@sha256:" + "0" * 64}
                for c, cid in containers.items()
            ],
        },
    }  # fmt: skip


def namespace(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "uid": f"ns-{name}", "labels": labels or {}}}  # fmt: skip


class KubeletStandIn:
    """Labelled stand-in for the kubelet's PodResources v1 service, on a Unix socket."""

    def __init__(self, socket: str, answers: dict[str, Any]) -> None:
        self.socket = socket
        self.answers = answers
        self.calls: list[str] = []
        self.delay = 0.0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handlers = {
            "List": self._handler("List", "ListPodResourcesRequest", "ListPodResourcesResponse"),
            "GetAllocatableResources": self._handler(
                "GetAllocatableResources", "AllocatableResourcesRequest",
                "AllocatableResourcesResponse",
            ),
        }  # fmt: skip
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        self.server.add_insecure_port(f"unix://{socket}")

    def _handler(self, name: str, request: str, response: str) -> grpc.RpcMethodHandler[Any, Any]:
        def answer(_: object, context: grpc.ServicerContext) -> object:
            self.calls.append(name)
            if self.delay:
                threading.Event().wait(self.delay)
            message = MESSAGES[response]()
            _fill(message, self.answers[name])
            return message

        return grpc.unary_unary_rpc_method_handler(
            answer,
            request_deserializer=MESSAGES[request].FromString,
            response_serializer=MESSAGES[response].SerializeToString,
        )

    def __enter__(self) -> KubeletStandIn:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)


def _fill(message: Any, data: dict[str, Any]) -> None:
    """A message from the JSON the kubelet's answer prints as (grpcurl's field names)."""
    fields = message.DESCRIPTOR.fields_by_name
    for key, value in data.items():
        name = {"podResources": "pod_resources", "resourceName": "resource_name",
                "deviceIds": "device_ids", "cpuIds": "cpu_ids"}.get(key, key)  # fmt: skip
        if name not in fields:
            continue  # a field this client does not declare (memory, dynamic resources)
        number = fields[name].type in (fields[name].TYPE_INT64, fields[name].TYPE_UINT64)
        target = getattr(message, name)
        if isinstance(value, list):
            for item in value:
                if isinstance(item, dict):
                    _fill(target.add(), item)
                else:
                    target.append(int(item) if number else item)
        elif isinstance(value, dict):
            _fill(target, value)
        else:
            setattr(message, name, int(value) if number else value)


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / name).read_text())
    return data


@contextmanager
def kubelet(tmp_path: Path, answers: dict[str, Any]) -> Iterator[KubeletStandIn]:
    with KubeletStandIn(str(tmp_path / "kubelet.sock"), answers) as k:
        yield k
