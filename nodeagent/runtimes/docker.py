"""Docker: the Engine API on its Unix socket (`/run/docker.sock`), read-only, stdlib only.

A container's name, image (as it was asked for) and labels (a compose project and service are
labels) come from the container list filtered to its id, `GET /containers/json?all=1&filters=`,
not from its inspect (`GET /containers/{id}/json`): dockerd holds a container while it starts it,
and an inspect asked the moment the container's cgroup appears waits for the whole start (2.4 to
3.7 s measured in the VM, where the list answered in 7 to 46 ms: issue 16). The list reads
dockerd's snapshot of its containers and takes no container's lock. Its `Image` is the image as
asked for, or the image's id once that name points to another image.
A new container is known before its cgroup appears: the loop follows dockerd's `create` events,
whose attributes carry the container's name, image and labels (`told`); the list confirms them
at the next tick. Renames come from `GET /events` with `until` set, which answers at once with
what happened since `since` instead of streaming. Containers that cri-dockerd runs for the
kubelet carry their pod in `io.kubernetes.*` labels.
The GPUs a container was given (`docker run --gpus`) are in its inspect alone: asked (`gpus`)
only of a container with a process on a GPU, which runs, so dockerd holds nothing there
(nodeagent.runtimes.gpus).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import quote

from nodeagent.gpu.grants import GpuGrant, docker_gpus
from nodeagent.meta import (
    BadAnswer,
    ContainerMeta,
    PodMeta,
    labels,
    name,
    optional_name,
)
from nodeagent.runtimes import unixhttp
from nodeagent.runtimes.base import Creations

POD_NAMESPACE = "io.kubernetes.pod.namespace"
POD_NAME = "io.kubernetes.pod.name"
POD_UID = "io.kubernetes.pod.uid"
_ID = re.compile(r"[0-9a-f]{12,64}")
"""A container id as dockerd makes them; its list filter takes a regular expression."""


def _pod_from_labels(found: Mapping[str, str]) -> PodMeta | None:
    if POD_NAMESPACE in found and POD_NAME in found:
        return PodMeta(found[POD_NAMESPACE], found[POD_NAME], found.get(POD_UID))
    return None


def _begins(value: object, prefix: str) -> bool:
    return isinstance(value, str) and value.startswith(prefix)


def _events(body: bytes) -> Iterator[Mapping[str, Any]]:
    """The JSON objects of a stream of events, one after another."""
    decoder = json.JSONDecoder()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadAnswer("the events are not valid UTF-8") from None
    at = 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at >= len(text):
            return
        try:
            event, at = decoder.raw_decode(text, at)
        except ValueError:
            raise BadAnswer("the events are not JSON") from None
        if isinstance(event, Mapping):
            yield event


def _event_id(event: Mapping[str, Any]) -> str | None:
    actor = event.get("Actor")
    cid = event.get("id") or (actor.get("ID") if isinstance(actor, Mapping) else None)
    return cid if isinstance(cid, str) else None


def event_ids(body: bytes) -> set[str]:
    """Container ids in a stream of JSON events (one object after another)."""
    return {cid for e in _events(body) if (cid := _event_id(e)) is not None}


HIDDEN = ("image", "name")
"""Attributes dockerd writes over the labels of the same keys in a container's events."""


def told(event: Mapping[str, Any]) -> ContainerMeta | None:
    """What a container's `create` event says of it, or None when it says too little or too
    much (then the container is asked). dockerd copies the container's labels into the event's
    attributes, then its `image` (as asked for) and `name` over them (moby's
    `LogContainerEventWithAttributes`): a label named `image` or `name` is hidden there, so the
    caller asks the list again off the fast path to be sure."""
    actor = event.get("Actor")
    found = actor.get("Attributes") if isinstance(actor, Mapping) else None
    if event.get("Action") != "create" or not isinstance(found, Mapping) or "name" not in found:
        return None
    try:
        own = labels({k: v for k, v in found.items() if k not in HIDDEN}, "the event's labels")
        return ContainerMeta(
            runtime="docker",
            name=name(found["name"], "the event's name").lstrip("/"),
            image=optional_name(found.get("image"), "the event's image"),
            labels=own,
            pod=_pod_from_labels(own),
        )
    except BadAnswer:
        return None  # asked: the list's answer is refused and said once, as any other


class _Created:
    """The containers in a stream of Docker's `create` events, one JSON object a line."""

    def __init__(self, stream: unixhttp.Stream) -> None:
        self.stream = stream

    @property
    def ended(self) -> bool:
        return self.stream.ended

    def fileno(self) -> int:
        return self.stream.fileno()

    def created(self) -> dict[str, ContainerMeta | None]:
        lines = self.stream.lines()
        out: dict[str, ContainerMeta | None] = {}
        for event in _events(b"\n".join(lines)) if lines else ():
            cid = _event_id(event)
            if cid is not None:
                out[cid] = told(event)
        return out

    def close(self) -> None:
        self.stream.close()


class DockerAdapter:
    """Docker's Engine API. Also the base of podman's, whose libpod API is shaped alike."""

    name = "docker"
    _ping_target = "/_ping"

    def __init__(self, socket: str, timeout: float) -> None:
        self.socket = socket
        self.timeout = timeout

    def _get(self, target: str) -> unixhttp.Response:
        return unixhttp.get(self.socket, target, self.timeout)

    def container(self, container_id: str) -> ContainerMeta | None:
        if not _ID.fullmatch(container_id):
            return None  # not an id dockerd makes, and not to be sent as its filter's regexp
        filters = quote(json.dumps({"id": [container_id]}), safe="")
        response = self._get(f"/containers/json?all=1&filters={filters}")
        if response.status != 200:
            raise BadAnswer(f"{self.name}'s container list answered HTTP {response.status}")
        found = response.json()
        if not isinstance(found, list):
            raise BadAnswer("the container list is not a list")
        # the filter matches ids that contain it: the container is the one whose id begins so
        mine = [c for c in found if isinstance(c, Mapping) and _begins(c.get("Id"), container_id)]
        if len(mine) != 1:
            return None  # unknown (gone, or another runtime's), or a prefix of more than one
        entry = mine[0]
        own = labels(entry.get("Labels"))
        names = entry.get("Names")
        first = names[0] if isinstance(names, list) and names else None
        return ContainerMeta(
            runtime=self.name,
            name=None if first is None else name(first, "Names[0]").lstrip("/"),
            image=optional_name(entry.get("Image"), "Image"),
            labels=own,
            pod=_pod_from_labels(own),
        )

    def gpus(self, container_id: str) -> GpuGrant | None:
        """The GPUs dockerd gave the container (`docker run --gpus`, or the nvidia runtime's
        environment: nodeagent.gpu.grants), from its inspect, the one answer that has them.
        Asked only of a container with a process on a GPU, so started: dockerd holds an
        inspect only while it starts the container. None: dockerd does not know it."""
        if not _ID.fullmatch(container_id):
            return None
        response = self._get(f"/containers/{container_id}/json")
        if response.status == 404:
            return None
        if response.status != 200:
            raise BadAnswer(f"{self.name}'s inspect answered HTTP {response.status}")
        return docker_gpus(response.json())

    def ping(self) -> None:
        self._get(self._ping_target)

    def creations(self) -> Creations | None:
        """dockerd's `create` events: a container is created before it is started, and the
        start makes its cgroup; the event carries the container's name, image and labels, so
        its cgroup's fast path needs no answer from a dockerd busy starting it."""
        filters = quote(json.dumps({"type": ["container"], "event": ["create"]}), safe="")
        return _Created(unixhttp.Stream(self.socket, f"/events?filters={filters}", self.timeout))

    def pod(self, pod_uid: str) -> ContainerMeta | None:
        return None  # a pod's own cgroup is the kubelet's; its sandbox is a container here

    def changed(self, since: float, until: float) -> set[str] | None:
        filters = quote(json.dumps({"type": ["container"], "event": ["rename"]}), safe="")
        response = self._get(f"/events?since={since:.3f}&until={until:.3f}&filters={filters}")
        if response.status != 200:
            raise BadAnswer(f"{self.name}'s events answered HTTP {response.status}")
        return event_ids(response.body)

    def close(self) -> None:
        pass
