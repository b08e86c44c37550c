"""podman: its libpod API on the socket of `podman system service`, when one is there;
otherwise what podman keeps on disk for the container.

The API gives the name, the image as it was asked for, labels, annotations and the podman pod.
Without the service (podman has no daemon: it is often not running), the container store's
`containers.json` under the storage root still names the container and its image; labels are
only in podman's own database, so a rule on labels does not match such a container, and
`nodeagent workloads` says so.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from urllib.parse import quote

from nodeagent.errors import NodeagentError
from nodeagent.meta import (
    BadAnswer,
    ContainerMeta,
    PodMeta,
    Unavailable,
    labels,
    name,
    optional_name,
)
from nodeagent.regular_file import read_regular_file
from nodeagent.runtimes.base import Creations
from nodeagent.runtimes.docker import DockerAdapter, event_ids

API = "/v4.0.0/libpod"
STORE_LIMIT = 32 << 20
NO_LABELS = "labels unknown: podman's API socket is absent, and its store on disk keeps none"


def _mapping(value: object, what: str) -> Mapping[str, object]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadAnswer(f"{what} is not an object")
    return value


class PodmanAdapter(DockerAdapter):
    name = "podman"
    _ping_target = f"{API}/_ping"

    def __init__(self, socket: str, timeout: float, storage: str | None) -> None:
        super().__init__(socket, timeout)
        self.storage = storage

    def _inspect(self, target: str) -> tuple[Mapping[str, object], Mapping[str, object]] | None:
        """A container's inspect answer and its Config; None for a container podman does not
        know."""
        response = self._get(target)
        if response.status == 404:
            return None
        if response.status != 200:
            raise BadAnswer(f"{self.name} answered HTTP {response.status}")
        found = _mapping(response.json(), "the answer")
        return found, _mapping(found.get("Config"), "Config")

    def container(self, container_id: str) -> ContainerMeta | None:
        try:
            inspected = self._inspect(f"{API}/containers/{quote(container_id, safe='')}/json")
        except Unavailable:
            if self.storage is None or os.path.exists(self.socket):
                raise  # a service that is there and does not answer: the runtime is down
            return self._from_store(container_id)
        if inspected is None:
            return None
        found, config = inspected
        pod = None
        pod_id = found.get("Pod")
        if isinstance(pod_id, str) and pod_id:
            pod = self._pod(pod_id)
        return ContainerMeta(
            runtime=self.name,
            name=optional_name(found.get("Name"), "Name"),
            image=optional_name(found.get("ImageName"), "ImageName"),
            labels=labels(config.get("Labels")),
            annotations=labels(config.get("Annotations"), "annotations"),
            pod=pod,
        )

    def _pod(self, pod_id: str) -> PodMeta | None:
        response = self._get(f"{API}/pods/{quote(pod_id, safe='')}/json")
        if response.status != 200:
            return None
        found = _mapping(response.json(), "the pod")
        pod_name = name(found.get("Name", ""), "the pod's Name")
        # a podman pod has no namespace: "podman" stands for one, so rules can still tell
        return PodMeta("podman", pod_name, pod_id, labels(found.get("Labels"), "pod labels"))

    def _from_store(self, container_id: str) -> ContainerMeta | None:
        assert self.storage is not None
        for store in sorted(glob.glob(os.path.join(glob.escape(self.storage), "*-containers"))):
            path = os.path.join(store, "containers.json")
            try:
                data = read_regular_file(path, STORE_LIMIT)
            except FileNotFoundError:
                continue
            except (OSError, NodeagentError) as e:
                raise Unavailable(f"{path}: {e}") from None
            if len(data) > STORE_LIMIT:
                raise Unavailable(f"{path} is larger than {STORE_LIMIT} bytes")
            try:
                entries = json.loads(data)
            except (ValueError, UnicodeDecodeError, RecursionError):
                raise Unavailable(f"{path} is not JSON") from None
            for entry in entries if isinstance(entries, list) else ():
                if isinstance(entry, Mapping) and entry.get("id") == container_id:
                    return _store_entry(entry)
        return None

    def creations(self) -> Creations | None:
        return None  # its events come from a log it tails: a late retry finds its containers

    def changed(self, since: float, until: float) -> set[str] | None:
        if self.storage is not None and not os.path.exists(self.socket):
            return set()  # no service, no events (and no renames to miss: nothing is cached)
        filters = quote(json.dumps({"type": ["container"], "event": ["rename"]}), safe="")
        target = f"{API}/events?stream=false&since={since:.0f}&until={until:.0f}&filters={filters}"
        response = self._get(target)
        if response.status != 200:
            raise BadAnswer(f"podman's events answered HTTP {response.status}")
        return event_ids(response.body)


def _store_entry(entry: Mapping[str, object]) -> ContainerMeta:
    names = entry.get("names")
    first = names[0] if isinstance(names, list) and names else None
    image = None
    metadata = entry.get("metadata")
    if isinstance(metadata, str):
        try:
            meta = json.loads(metadata)
        except ValueError:
            meta = None
        if isinstance(meta, Mapping):
            image = optional_name(meta.get("image-name"), "image-name")
    return ContainerMeta(
        runtime="podman", name=optional_name(first, "names[0]"), image=image, incomplete=NO_LABELS
    )
