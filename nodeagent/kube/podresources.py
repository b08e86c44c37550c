"""The kubelet's PodResources API (v1), over gRPC on its Unix socket: which devices the
device plugins gave each container (`List`), and which the node has (`GetAllocatableResources`).

The messages are declared here, field for field as the kubelet's
k8s.io/kubelet/pkg/apis/podresources/v1 api.proto numbers them (only those nodeagent
reads; protobuf skips the rest), and built with protobuf's descriptor pool: no generated
code and no protoc. Every call has a deadline; any failure is one PodResourcesError
naming the socket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from nodeagent.errors import NodeagentError

SERVICE = "v1.PodResourcesLister"
_T = descriptor_pb2.FieldDescriptorProto
_MESSAGES: dict[str, list[tuple[str, int, int, str | None, bool]]] = {
    # message: [(field, number, type, message type, repeated)]
    "ListPodResourcesRequest": [],
    "AllocatableResourcesRequest": [],
    "ListPodResourcesResponse": [("pod_resources", 1, _T.TYPE_MESSAGE, "PodResources", True)],
    "AllocatableResourcesResponse": [
        ("devices", 1, _T.TYPE_MESSAGE, "ContainerDevices", True),
        ("cpu_ids", 2, _T.TYPE_INT64, None, True),
    ],
    "PodResources": [
        ("name", 1, _T.TYPE_STRING, None, False),
        ("namespace", 2, _T.TYPE_STRING, None, False),
        ("containers", 3, _T.TYPE_MESSAGE, "ContainerResources", True),
    ],
    "ContainerResources": [
        ("name", 1, _T.TYPE_STRING, None, False),
        ("devices", 2, _T.TYPE_MESSAGE, "ContainerDevices", True),
        ("cpu_ids", 3, _T.TYPE_INT64, None, True),
    ],
    "ContainerDevices": [
        ("resource_name", 1, _T.TYPE_STRING, None, False),
        ("device_ids", 2, _T.TYPE_STRING, None, True),
        ("topology", 3, _T.TYPE_MESSAGE, "TopologyInfo", False),
    ],
    "TopologyInfo": [("nodes", 1, _T.TYPE_MESSAGE, "NUMANode", True)],
    "NUMANode": [("ID", 1, _T.TYPE_INT64, None, False)],
}


def _classes() -> dict[str, Any]:
    proto = descriptor_pb2.FileDescriptorProto(
        name="nodeagent/kubelet/podresources/v1.proto", package="v1", syntax="proto3"
    )
    for name, fields in _MESSAGES.items():
        message = proto.message_type.add(name=name)
        for field, number, kind, type_name, repeated in fields:
            f = message.field.add(name=field, number=number, type=kind)
            f.label = _T.LABEL_REPEATED if repeated else _T.LABEL_OPTIONAL
            if type_name is not None:
                f.type_name = f".v1.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{n}")) for n in
            _MESSAGES}  # fmt: skip


MESSAGES = _classes()
"""The message classes by name, for this client and for stand-ins of the kubelet."""


class PodResourcesError(NodeagentError):
    pass


@dataclass(frozen=True, slots=True)
class Devices:
    resource: str
    ids: tuple[str, ...]
    numa_nodes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ContainerDevices:
    namespace: str
    pod: str
    container: str
    devices: tuple[Devices, ...]


def _devices(items: Sequence[Any]) -> tuple[Devices, ...]:
    return tuple(
        Devices(d.resource_name, tuple(d.device_ids), tuple(n.ID for n in d.topology.nodes))
        for d in items
    )


class PodResourcesClient:
    """One channel to the kubelet's socket for the agent's life; grpc reconnects by itself
    when the kubelet restarts (and the socket with it)."""

    def __init__(self, socket: str, timeout: float) -> None:
        self.socket = socket
        self.timeout = timeout
        self._channel = grpc.insecure_channel(f"unix://{socket}")
        self._list = self._method("List", "ListPodResourcesRequest", "ListPodResourcesResponse")
        self._allocatable = self._method(
            "GetAllocatableResources", "AllocatableResourcesRequest", "AllocatableResourcesResponse"
        )

    def _method(self, name: str, request: str, response: str) -> Any:
        return self._channel.unary_unary(
            f"/{SERVICE}/{name}",
            request_serializer=MESSAGES[request].SerializeToString,
            response_deserializer=MESSAGES[response].FromString,
        )

    def _call(self, name: str, method: Any, request: str) -> Any:
        try:
            return method(MESSAGES[request](), timeout=self.timeout)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            detail = e.details() if isinstance(e, grpc.Call) else str(e)
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                why = f"no answer within {self.timeout:g}s"
            else:
                why = f"{getattr(code, 'name', code)}: {' '.join(str(detail).split())}"
            raise PodResourcesError(
                f"kubelet PodResources {name} on {self.socket}: {why}"
            ) from None

    def list(self) -> tuple[ContainerDevices, ...]:
        """Every container of every pod on the node that holds devices."""
        answer = self._call("List", self._list, "ListPodResourcesRequest")
        return tuple(
            ContainerDevices(p.namespace, p.name, c.name, _devices(c.devices))
            for p in answer.pod_resources
            for c in p.containers
            if c.devices
        )

    def allocatable(self) -> tuple[Devices, ...]:
        """The devices the kubelet may hand out (healthy ones; those in use included)."""
        answer = self._call(
            "GetAllocatableResources", self._allocatable, "AllocatableResourcesRequest"
        )
        return _devices(answer.devices)

    def close(self) -> None:
        self._channel.close()
