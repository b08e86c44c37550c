"""The API server's view of this node's pods and of the namespaces, kept current by
list-then-watch, as a client-go informer keeps it.

Each kind (pods with spec.nodeName=<this node>, namespaces) is listed once, then watched
from the list's resourceVersion; each event moves the resourceVersion on (bookmarks
too), and a watch the server ends is made again from it. A 410 Gone (the version is
older than the server keeps) lists afresh. Any other failure is logged once and retried
with backoff, the last good view standing meanwhile. Runs in a thread per kind with the
official `kubernetes` client; the loop only reads `directory()`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from nodeagent.errors import NodeagentError, one_line
from nodeagent.identity import QosTier
from nodeagent.kube.pods import Pod, PodDirectory
from nodeagent.reach import Reachability

log = structlog.get_logger("nodeagent.kubernetes")
GONE = 410
BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0)


def pod_of(obj: Any) -> Pod:
    """A V1Pod as nodeagent needs it: who it is, its labels, and its containers' ids."""
    meta, spec, status = obj.metadata, obj.spec, obj.status
    containers: dict[str, str] = {}
    found = []
    if status is not None:  # a pod just made may have no status yet
        found = [*(status.container_statuses or ()), *(status.init_container_statuses or ())]
    for s in found:
        if s.container_id:
            containers[s.container_id.split("://", 1)[-1]] = s.name
    qos = (status.qos_class or "").lower() if status else ""
    asked = [*(spec.containers or ()), *(spec.init_containers or ())] if spec else []
    images = {c.name: c.image for c in asked if c.name and c.image}
    return Pod(
        uid=meta.uid,
        namespace=meta.namespace,
        name=meta.name,
        labels=dict(meta.labels or {}),
        annotations=dict(meta.annotations or {}),
        priority=spec.priority if spec else None,
        qos=QosTier(qos) if qos in QosTier.__members__.values() else None,
        containers=containers,
        images=images,
    )


class Informer:
    """One kind, listed and watched; `items` is replaced whole, never changed in place."""

    def __init__(
        self,
        kind: str,
        lister: Callable[..., Any],
        key: Callable[[Any], tuple[str, Any]],
        *,
        timeout: float,
        watch_timeout: float,
        changed: Callable[[], None],
        stop: threading.Event,
        reach: Reachability,
        address: str,
        **selectors: str,
    ) -> None:
        """`reach`: where each list and watch says how it went, as api-server/KIND at
        `address` (the server's URL)."""
        from kubernetes import watch  # noqa: PLC0415 (only in Kubernetes mode)

        self.kind = kind
        self._lister = lister
        self._key = key
        self._timeout = timeout
        self._watch_timeout = watch_timeout
        self._changed = changed
        self._stop = stop
        self._selectors = selectors
        self._reach, self._address = reach, address
        make: Any = watch.Watch  # untyped
        self._watch: Any = make()
        self.items: dict[str, Any] = {}
        self.resource_version: str | None = None
        self.events = 0
        self.lists = 0
        """Lists made (the first, and one after each 410 Gone): for the tests and the log."""
        self.synced = threading.Event()

    def relist(self) -> None:
        answer = self._lister(**self._selectors, _request_timeout=self._timeout)
        self.items = dict(self._key(o) for o in answer.items)
        self.resource_version = answer.metadata.resource_version
        self.lists += 1
        self._answered()
        self._changed()
        self.synced.set()

    def _answered(self) -> None:
        self._reach.ok(f"api-server/{self.kind}", self._address)

    def watch_once(self) -> None:
        """One watch, until the server ends it, from the last resourceVersion."""
        events: Iterator[dict[str, Any]] = self._watch.stream(
            self._lister,
            **self._selectors,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=int(self._watch_timeout),
            _request_timeout=self._watch_timeout + self._timeout,
        )
        for event in events:
            if self._stop.is_set():
                self._watch.stop()
                return
            self.events += 1
            self._answered()
            kind, obj = event["type"], event["object"]
            if kind in ("ADDED", "MODIFIED"):
                name, value = self._key(obj)
                self.items = {**self.items, name: value}
            elif kind == "DELETED":
                name, _ = self._key(obj)
                self.items = {k: v for k, v in self.items.items() if k != name}
            self.resource_version = self._watch.resource_version or self.resource_version
            if kind != "BOOKMARK":
                self._changed()

    def run(self) -> None:
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        failures = 0
        while not self._stop.is_set():
            seen = self.events
            try:
                if self.resource_version is None:
                    self.relist()
                self.watch_once()
                self._answered()  # the server ended it, as it does every watch_timeout
                failures = 0
            except ApiException as e:
                if self.events != seen:
                    failures = 0  # it went well until now: a first failure again
                if e.status == GONE and failures == 0:
                    log.info("kubernetes.relist", kind=self.kind, reason="410 Gone: "
                             + str(e.reason or "resource version too old"))  # fmt: skip
                    self.resource_version = None
                    failures = 1  # a second 410 in a row (a server that keeps saying it) waits
                    continue
                if e.status == GONE:
                    self.resource_version = None
                failures = self._failed(failures, f"{e.status} {e.reason}")
            except Exception as e:  # the server unreachable, a bad answer: retried
                failures = self._failed(failures, one_line(e))

    def _failed(self, failures: int, why: str) -> int:
        self._reach.failed(f"api-server/{self.kind}", self._address, why)
        if failures == 0:
            log.warning("kubernetes.watch_failed", kind=self.kind, error=why,
                        action="keeping the last view, retrying")  # fmt: skip
        self._stop.wait(BACKOFF[min(failures, len(BACKOFF) - 1)])
        return failures + 1


class ApiWatch:
    """This node's pods and every namespace, from the API server."""

    def __init__(self, api_client: Any, node: str, *, timeout: float, watch_timeout: float):
        from kubernetes import client  # noqa: PLC0415

        core = client.CoreV1Api(api_client)
        self.stop = threading.Event()
        self.reach = Reachability()
        """How each kind's last list, watch event or watch went (its threads write it)."""
        self._lock = threading.Lock()
        self._version = 0
        self._directory = PodDirectory()
        address = str(getattr(getattr(api_client, "configuration", None), "host", None)
                      or "the API server")  # fmt: skip
        common = {"timeout": timeout, "watch_timeout": watch_timeout, "changed": self._bump,
                  "stop": self.stop, "reach": self.reach, "address": address}  # fmt: skip
        self.pods = Informer(
            "pods",
            core.list_pod_for_all_namespaces,
            lambda o: (o.metadata.uid, pod_of(o)),
            field_selector=f"spec.nodeName={node}",
            **common,  # type: ignore[arg-type]
        )
        self.namespaces = Informer(
            "namespaces",
            core.list_namespace,
            lambda o: (o.metadata.name, dict(o.metadata.labels or {})),
            **common,  # type: ignore[arg-type]
        )
        self._threads = [
            threading.Thread(target=i.run, name=f"kube-{i.kind}", daemon=True)
            for i in (self.pods, self.namespaces)
        ]

    def _bump(self) -> None:
        with self._lock:
            self._version += 1

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def close(self) -> None:
        self.stop.set()

    def directory(self) -> PodDirectory:
        """The view now, as one frozen PodDirectory (made again only after a change)."""
        with self._lock:
            version = self._version
        if version != self._directory.version:
            self._directory = PodDirectory(
                dict(self.pods.items), dict(self.namespaces.items), version
            )
        return self._directory


def in_cluster() -> Any:
    """An API client with the pod's service account (in-cluster configuration). A missing
    client or service account is one line, not a traceback at start."""
    needs = "kubernetes.api_server.watch and publish.node_resource_topology"
    try:
        from kubernetes import client, config  # noqa: PLC0415
    except ImportError as e:
        raise NodeagentError(
            f"{needs} need the kubernetes client, which this install lacks:"
            f" pip install 'nodeagent[kubernetes]' ({one_line(e)})"
        ) from e
    configuration = client.Configuration()
    load: Any = config.load_incluster_config  # untyped
    try:
        load(client_configuration=configuration)
    except config.ConfigException as e:
        raise NodeagentError(
            f"{needs} use the pod's service account (in-cluster), which is not there:"
            f" {one_line(e).rstrip('.')}; outside a pod set both false"
        ) from e
    return client.ApiClient(configuration)
