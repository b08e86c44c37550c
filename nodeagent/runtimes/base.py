"""The one interface every runtime adapter implements (as the GPU backend does for NVML).

An adapter is read-only: it asks its runtime about a container (or a pod, by UID) and turns the
answer into a checked `ContainerMeta`. Every call has a deadline. It raises `Unavailable` when
the runtime does not answer (the whole runtime is then treated as down for a while, said once)
and `BadAnswer` when the answer about that one container is unusable (that container gets no
metadata; the others are not affected).
"""

from __future__ import annotations

from typing import Protocol

from nodeagent.meta import ContainerMeta


class Creations(Protocol):
    """A runtime's stream of the containers it creates, read by the loop when its fd is
    readable."""

    @property
    def ended(self) -> bool:
        """The runtime closed it: open another later."""
        ...

    def fileno(self) -> int: ...

    def created(self) -> dict[str, ContainerMeta | None]:
        """Containers created since the last call (never blocks), each with what the event
        said of it (None: it said too little, ask). Raises Unavailable or BadAnswer when the
        stream broke: close it."""
        ...

    def close(self) -> None: ...


class Adapter(Protocol):
    name: str
    """The runtime, as `agent.runtimes` and the logs name it: docker, podman, containerd, crio."""
    socket: str

    def container(self, container_id: str) -> ContainerMeta | None:
        """The container (or a pod's sandbox) with this id, or None when the runtime does not
        know it (gone, or made by another runtime)."""
        ...

    def pod(self, pod_uid: str) -> ContainerMeta | None:
        """A pod's own cgroup, by the pod's UID (None: not a pod this runtime runs)."""
        ...

    def ping(self) -> None:
        """Raises Unavailable when the runtime does not answer; asks about no container, so
        it waits for none (a runtime holds a container it is starting: dockerd its inspect,
        podman all of it)."""
        ...

    def creations(self) -> Creations | None:
        """A stream of the containers the runtime creates, opened now (within the deadline), so
        that a container's answer can be had before its cgroup appears; None when the runtime
        has none to follow. Raises Unavailable or BadAnswer."""
        ...

    def changed(self, since: float, until: float) -> set[str] | None:
        """Ids of containers whose metadata may have changed between the two times (a rename),
        from the runtime's events; None when the runtime's metadata never changes (CRI)."""
        ...

    def close(self) -> None: ...
