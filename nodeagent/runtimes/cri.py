"""The CRI (containerd, CRI-O): the kubelet's own gRPC API on the runtime's socket, read-only.

A container's pod sandbox, name, labels and annotations come from `ListContainers` (filtered by
its id), the image as the pod spec names it from `ContainerStatus`, and the pod (namespace,
name, UID, labels, annotations: the kubelet copies a pod's onto its sandbox) from
`PodSandboxStatus`, kept by sandbox id. A pod's own cgroup is found by its UID with
`ListPodSandbox`. All of it is fixed when the kubelet creates the pod, so there are no events to
follow. One deadline covers all the calls of one lookup; an answer larger than MAX_ANSWER_BYTES
or with invalid UTF-8 is refused by gRPC's own checks.

grpcio is imported at the first call, so a node without a CRI runtime never loads it.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, TypeVar

from nodeagent.meta import (
    MAX_ANSWER_BYTES,
    BadAnswer,
    ContainerMeta,
    PodMeta,
    Unavailable,
    labels,
    name,
    optional_name,
)

if TYPE_CHECKING:
    import grpc
    from cri_api.v1 import api_pb2

    from nodeagent.runtimes.base import Creations

SERVICE = "/runtime.v1.RuntimeService/"
POD_UID_LABEL = "io.kubernetes.pod.uid"
SANDBOX_READY = 0
Reply = TypeVar("Reply")


class CriAdapter:
    def __init__(self, runtime: str, socket: str, timeout: float) -> None:
        self.name = runtime
        self.socket = socket
        self.timeout = timeout
        self._channel: grpc.Channel | None = None
        self._pods: dict[str, PodMeta] = {}
        """Pods by sandbox id: a pod's metadata never changes."""

    # -- the calls --------------------------------------------------------------------------

    def _call(self, method: str, request: Any, reply: type[Reply], deadline: float) -> Reply | None:
        """One unary call within what is left of `deadline`; None for NOT_FOUND."""
        import grpc  # noqa: PLC0415 (only on nodes with a CRI runtime)

        left = deadline - time.monotonic()
        if left <= 0:
            raise Unavailable(f"{self.socket} did not answer in {self.timeout * 1000:.0f} ms")
        if self._channel is None:
            if not os.path.exists(self.socket):
                raise Unavailable(f"no socket at {self.socket}")
            self._channel = grpc.insecure_channel(
                f"unix://{self.socket}",
                options=[
                    ("grpc.max_receive_message_length", MAX_ANSWER_BYTES),
                    ("grpc.max_send_message_length", 1 << 16),
                    ("grpc.enable_http_proxy", 0),
                    ("grpc.enable_retries", 0),
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
        stub: grpc.UnaryUnaryMultiCallable[Any, Reply] = self._channel.unary_unary(
            SERVICE + method,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=reply.FromString,  # type: ignore[attr-defined]
        )
        try:
            return stub(request, timeout=left)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            detail = e.details() if isinstance(e, grpc.Call) else str(e)
            if code is grpc.StatusCode.NOT_FOUND:
                return None
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                self.close()  # a fresh connection next time: this one may be wedged
                raise Unavailable(
                    f"{self.socket} did not answer in {self.timeout * 1000:.0f} ms"
                ) from None
            if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL):
                # too large, or not decodable (invalid UTF-8 in a string): this answer only
                raise BadAnswer(f"{method}: {' '.join(str(detail).split())[:200]}") from None
            self.close()
            if code is grpc.StatusCode.UNIMPLEMENTED:
                raise Unavailable(f"{self.socket} does not speak CRI v1 ({method})") from None
            raise Unavailable(
                f"{self.socket}: {code}: {' '.join(str(detail).split())[:200]}"
            ) from None

    # -- the adapter -------------------------------------------------------------------------

    def ping(self) -> None:
        from cri_api.v1 import api_pb2  # noqa: PLC0415

        deadline = time.monotonic() + self.timeout
        self._call("Version", api_pb2.VersionRequest(), api_pb2.VersionResponse, deadline)

    def container(self, container_id: str) -> ContainerMeta | None:
        from cri_api.v1 import api_pb2  # noqa: PLC0415

        deadline = time.monotonic() + self.timeout
        listed = self._call(
            "ListContainers",
            api_pb2.ListContainersRequest(filter=api_pb2.ContainerFilter(id=container_id)),
            api_pb2.ListContainersResponse,
            deadline,
        )
        found = [c for c in (listed.containers if listed else ()) if c.id == container_id]
        if not found:
            return self._sandbox(container_id, deadline)
        c = found[0]
        status = self._call(
            "ContainerStatus",
            api_pb2.ContainerStatusRequest(container_id=container_id),
            api_pb2.ContainerStatusResponse,
            deadline,
        )
        image = asked_image(status.status.image if status is not None else None, c.image)
        return ContainerMeta(
            runtime=self.name,
            name=optional_name(c.metadata.name, "metadata.name"),
            image=optional_name(image, "image"),
            labels=labels(dict(c.labels)),
            annotations=labels(dict(c.annotations), "annotations"),
            pod=self._pod_of(c.pod_sandbox_id, deadline),
        )

    def _sandbox(self, sandbox_id: str, deadline: float) -> ContainerMeta | None:
        """A pod's sandbox ("pause") container has a cgroup like any container."""
        pod = self._pod_of(sandbox_id, deadline)
        if pod is None:
            return None
        return ContainerMeta(runtime=self.name, pod=pod, sandbox=True)

    def _pod_of(self, sandbox_id: str, deadline: float) -> PodMeta | None:
        from cri_api.v1 import api_pb2  # noqa: PLC0415

        if sandbox_id in self._pods:
            return self._pods[sandbox_id]
        status = self._call(
            "PodSandboxStatus",
            api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id),
            api_pb2.PodSandboxStatusResponse,
            deadline,
        )
        if status is None or not status.status.id:
            return None
        pod = _pod(status.status)
        if len(self._pods) > 4096:  # bounded: forget the oldest half
            for key in list(self._pods)[:2048]:
                del self._pods[key]
        self._pods[sandbox_id] = pod
        return pod

    def pod(self, pod_uid: str) -> ContainerMeta | None:
        from cri_api.v1 import api_pb2  # noqa: PLC0415

        deadline = time.monotonic() + self.timeout
        listed = self._call(
            "ListPodSandbox",
            api_pb2.ListPodSandboxRequest(
                filter=api_pb2.PodSandboxFilter(label_selector={POD_UID_LABEL: pod_uid})
            ),
            api_pb2.ListPodSandboxResponse,
            deadline,
        )
        items = [i for i in (listed.items if listed else ()) if i.metadata.uid == pod_uid]
        if not items:
            return None
        ready = [i for i in items if i.state == SANDBOX_READY] or items
        newest = max(ready, key=lambda i: i.created_at)
        return ContainerMeta(runtime=self.name, pod=_pod(newest))

    def creations(self) -> Creations | None:
        return None  # the kubelet creates a pod's containers through this very API

    def changed(self, since: float, until: float) -> set[str] | None:
        return None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def asked_image(status: api_pb2.ImageSpec | None, listed: api_pb2.ImageSpec) -> str:
    """The image as the pod spec names it: the kubelet's `user_specified_image` where the
    runtime keeps it (Kubernetes 1.30 and later), else the image the runtime reports, which
    containerd gives as the image's first tag: another tag of the same image than the pod
    asked for when it has several (the API server's watch then gives the pod's own)."""
    for spec in (status, listed):
        if spec is not None and spec.user_specified_image:
            return spec.user_specified_image
    return (status.image if status is not None else "") or listed.image


def _pod(sandbox: api_pb2.PodSandboxStatus | api_pb2.PodSandbox) -> PodMeta:
    meta = sandbox.metadata
    return PodMeta(
        namespace=name(meta.namespace, "the pod's namespace"),
        name=name(meta.name, "the pod's name"),
        uid=optional_name(meta.uid, "the pod's uid"),
        labels=labels(dict(sandbox.labels), "pod labels"),
        annotations=labels(dict(sandbox.annotations), "pod annotations"),
    )
