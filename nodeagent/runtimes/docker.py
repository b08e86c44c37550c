"""Docker: the Engine API on its Unix socket (`/run/docker.sock`), read-only, stdlib only.

A container's name, image (as it was asked for, `Config.Image`) and labels (a compose project
and service are labels) come from `GET /containers/{id}/json`; renames from `GET /events` with
`until` set, which answers at once with what happened since `since` instead of streaming.
Containers that cri-dockerd runs for the kubelet carry their pod in `io.kubernetes.*` labels.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from urllib.parse import quote

from nodeagent.meta import (
    BadAnswer,
    ContainerMeta,
    PodMeta,
    labels,
    name,
    optional_name,
)
from nodeagent.runtimes import unixhttp

POD_NAMESPACE = "io.kubernetes.pod.namespace"
POD_NAME = "io.kubernetes.pod.name"
POD_UID = "io.kubernetes.pod.uid"


def _mapping(value: object, what: str) -> Mapping[str, object]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadAnswer(f"{what} is not an object")
    return value


def _pod_from_labels(found: Mapping[str, str]) -> PodMeta | None:
    if POD_NAMESPACE in found and POD_NAME in found:
        return PodMeta(found[POD_NAMESPACE], found[POD_NAME], found.get(POD_UID))
    return None


def event_ids(body: bytes) -> set[str]:
    """Container ids in a stream of JSON events (one object after another)."""
    ids: set[str] = set()
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
            return ids
        try:
            event, at = decoder.raw_decode(text, at)
        except ValueError:
            raise BadAnswer("the events are not JSON") from None
        if isinstance(event, Mapping):
            actor = event.get("Actor")
            cid = event.get("id") or (actor.get("ID") if isinstance(actor, Mapping) else None)
            if isinstance(cid, str):
                ids.add(cid)


class DockerAdapter:
    """Docker's Engine API. Also the base of podman's, whose libpod API is shaped alike."""

    name = "docker"

    def __init__(self, socket: str, timeout: float) -> None:
        self.socket = socket
        self.timeout = timeout

    def _get(self, target: str) -> unixhttp.Response:
        return unixhttp.get(self.socket, target, self.timeout)

    def _inspect(self, target: str) -> tuple[Mapping[str, object], Mapping[str, object]] | None:
        """A container's inspect answer and its Config (podman's libpod API is shaped as
        Docker's); None for a container the runtime does not know."""
        response = self._get(target)
        if response.status == 404:
            return None
        if response.status != 200:
            raise BadAnswer(f"{self.name} answered HTTP {response.status}")
        found = _mapping(response.json(), "the answer")
        return found, _mapping(found.get("Config"), "Config")

    def container(self, container_id: str) -> ContainerMeta | None:
        inspected = self._inspect(f"/containers/{quote(container_id, safe='')}/json")
        if inspected is None:
            return None
        found, config = inspected
        own = labels(config.get("Labels"))
        raw_name = found.get("Name")
        return ContainerMeta(
            runtime=self.name,
            name=None if raw_name is None else name(raw_name, "Name").lstrip("/"),
            image=optional_name(config.get("Image"), "Config.Image"),
            labels=own,
            pod=_pod_from_labels(own),
        )

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
