"""The CRI adapter against a STAND-IN CRI server (grpcio, on a Unix socket) serving the calls it
makes, answered as the test sets them; the real containerd is in tests/kernel/test_runtimes.py."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from nodeagent.meta import BadAnswer, Unavailable
from nodeagent.runtimes.cri import CriAdapter
from nodeagent.runtimes.metadata import RuntimeMetadata

CID = "c" * 64
SANDBOX = "s" * 64
UID = "0d6f6d1e-8a8b-4c1e-9b1a-1c2d3e4f5a6b"


def _sandbox_status(labels: dict[str, str] | None = None) -> bytes:
    status = pb.PodSandboxStatus(
        id=SANDBOX,
        metadata=pb.PodSandboxMetadata(name="web-0", uid=UID, namespace="prod"),
        labels=labels or {"app": "web"},
        annotations={"owner": "ops"},
    )
    return pb.PodSandboxStatusResponse(status=status).SerializeToString()


def _containers() -> bytes:
    c = pb.Container(
        id=CID,
        pod_sandbox_id=SANDBOX,
        metadata=pb.ContainerMetadata(name="app"),
        image=pb.ImageSpec(image="sha256:" + "0" * 64),
        labels={"io.kubernetes.container.name": "app"},
    )
    return pb.ListContainersResponse(containers=[c]).SerializeToString()


def _status() -> bytes:
    status = pb.ContainerStatus(id=CID, image=pb.ImageSpec(image="registry/app:2"))
    return pb.ContainerStatusResponse(status=status).SerializeToString()


class StandInCri(grpc.GenericRpcHandler):
    """Answers each method with the bytes in `answers` (or NOT_FOUND when absent)."""

    def __init__(self, path: str) -> None:
        self.answers: dict[str, bytes | Callable[[], bytes]] = {
            "ListContainers": _containers(),
            "ContainerStatus": _status(),
            "PodSandboxStatus": _sandbox_status(),
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers([self])
        self.server.add_insecure_port(f"unix://{path}")
        self.server.start()

    def service(
        self, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        method = details.method.rsplit("/", 1)[-1]

        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            answer = self.answers.get(method)
            if answer is None:
                context.abort(grpc.StatusCode.NOT_FOUND, "not found")
            return answer() if callable(answer) else answer

        return grpc.unary_unary_rpc_method_handler(
            handle, request_deserializer=None, response_serializer=None
        )


@pytest.fixture
def cri(tmp_path: Path) -> Iterator[tuple[StandInCri, str]]:
    path = str(tmp_path / "cri.sock")
    server = StandInCri(path)
    yield server, path
    server.server.stop(0)


def test_a_container_with_its_pod(cri: tuple[StandInCri, str]) -> None:
    meta = CriAdapter("containerd", cri[1], 0.5).container(CID)
    assert meta is not None and meta.pod is not None
    assert (meta.name, meta.image) == ("app", "registry/app:2"), "the image as the pod names it"
    assert (meta.pod.namespace, meta.pod.name, meta.pod.uid) == ("prod", "web-0", UID)
    assert dict(meta.pod.labels) == {"app": "web"} and meta.pod.annotations["owner"] == "ops"


def test_the_image_is_the_one_the_pod_asked_for_where_the_kubelet_said_it(
    cri: tuple[StandInCri, str],
) -> None:
    """containerd reports an image by its first tag: a pod that asked for registry/app:stable,
    another tag of the same image, read registry/app:2 (issue 35 item 5). The kubelet's
    user_specified_image (Kubernetes 1.30 and later) is the pod's own: taken first."""
    server, path = cri
    asked = pb.ImageSpec(image="registry/app:2", user_specified_image="registry/app:stable")
    status = pb.ContainerStatus(id=CID, image=asked)
    server.answers["ContainerStatus"] = pb.ContainerStatusResponse(
        status=status
    ).SerializeToString()
    meta = CriAdapter("containerd", path, 0.5).container(CID)
    assert meta is not None and meta.image == "registry/app:stable"


def test_a_sandbox_is_known_as_the_pods(cri: tuple[StandInCri, str]) -> None:
    server, path = cri
    server.answers["ListContainers"] = pb.ListContainersResponse().SerializeToString()
    meta = CriAdapter("containerd", path, 0.5).container(SANDBOX)
    assert meta is not None and meta.sandbox and meta.pod is not None and meta.name is None


def test_a_pod_by_its_uid(cri: tuple[StandInCri, str]) -> None:
    server, path = cri
    item = pb.PodSandbox(
        id=SANDBOX, metadata=pb.PodSandboxMetadata(name="web-0", uid=UID, namespace="prod")
    )
    server.answers["ListPodSandbox"] = pb.ListPodSandboxResponse(items=[item]).SerializeToString()
    meta = CriAdapter("containerd", path, 0.5).pod(UID)
    assert meta is not None and meta.pod is not None and meta.pod.name == "web-0"


def test_unknown_is_none(cri: tuple[StandInCri, str]) -> None:
    server, path = cri
    server.answers = {"ListContainers": pb.ListContainersResponse().SerializeToString()}
    assert CriAdapter("containerd", path, 0.5).container(CID) is None


def test_invalid_utf8_and_too_many_labels_are_refused(cri: tuple[StandInCri, str]) -> None:
    server, path = cri
    good = _sandbox_status()
    server.answers["PodSandboxStatus"] = good.replace(b"web-0", b"we\xff-0")
    with pytest.raises(BadAnswer):
        CriAdapter("containerd", path, 0.5).container(CID)
    server.answers["PodSandboxStatus"] = _sandbox_status({f"k{n}": "v" for n in range(10_000)})
    with pytest.raises(BadAnswer, match="10000 pod labels"):
        CriAdapter("containerd", path, 0.5).container(CID)
    server.answers["PodSandboxStatus"] = _sandbox_status({"big": "v" * (5 << 20)})
    with pytest.raises(BadAnswer, match=r"PodSandboxStatus: .*(larger|exceed|received)"):
        CriAdapter("containerd", path, 0.5).container(CID)


def test_a_socket_that_never_answers_costs_one_deadline(tmp_path: Path) -> None:
    path = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(8)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="did not answer in 200 ms"):
        CriAdapter("containerd", path, 0.2).container(CID)
    assert time.monotonic() - t0 < 1.0
    listener.close()


def test_a_slow_runtime_is_down_then_back(cri: tuple[StandInCri, str]) -> None:
    server, path = cri

    def slow() -> bytes:
        time.sleep(0.5)
        return _containers()

    server.answers["ListContainers"] = slow
    clock = [100.0]
    meta = RuntimeMetadata(
        {"containerd": CriAdapter("containerd", path, 0.2)}, clock=lambda: clock[0]
    )
    from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity

    w = WorkloadIdentity(
        f"kubepods/pod{UID}/{CID}", Kind.CONTAINER, Runtime.CONTAINERD, Owner.CGROUPFS,
        CID[:12], container_id=CID, pod_uid=UID,
    )  # fmt: skip
    assert "did not answer" in (meta.attach([w])[0].meta_problem or "")
    server.answers["ListContainers"] = _containers()
    clock[0] += 10
    assert meta.attach([w])[0].meta is not None, "back, on a fresh connection"
