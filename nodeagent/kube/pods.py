"""What nodeagent knows of the pods on its node, whoever told it (the API server's watch,
or CRI): frozen, so the pure policies can read it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from nodeagent.identity import QosTier


@dataclass(frozen=True, slots=True)
class Pod:
    uid: str
    namespace: str
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    priority: int | None = None
    qos: QosTier | None = None
    containers: Mapping[str, str] = field(default_factory=dict)
    """Container id (without the runtime's `containerd://`) to the container's name."""
    images: Mapping[str, str] = field(default_factory=dict)
    """Container name to the image its spec asks for (the tag the pod names, where the
    runtime may report another tag of the same image)."""

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class PodDirectory:
    pods: Mapping[str, Pod] = field(default_factory=dict)
    """By pod uid."""
    namespaces: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Namespace name to its labels (only known through the API server)."""
    version: int = 0
    """Grows whenever anything in it changes: the assignments are made again then."""

    def by_name(self, namespace: str, name: str) -> Pod | None:
        return next(
            (p for p in self.pods.values() if p.namespace == namespace and p.name == name), None
        )


EMPTY = PodDirectory()
