"""What the node tells the scheduler: its static GPU topology as node-feature-discovery
labels (a features.d file, read by NFD's local source: no RBAC needed), and optionally
a NodeResourceTopology (v1alpha2) object with each NUMA zone's GPUs.

Labels carry the `nodeagent.io/` prefix (NFD's master must allow that namespace:
`-extra-label-ns=nodeagent.io`). Values keep to what a label value may hold (63
characters of [A-Za-z0-9._-], alphanumeric at both ends). A simulated node says so in
`nodeagent.io/gpu.simulated=true`, so that nothing simulated passes for real hardware.
The file is written atomically (a hidden temp file, which NFD skips, renamed over it) and
only when its text changes.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import structlog

from nodeagent.errors import NodeagentError, one_line
from nodeagent.gpu.model import Device, GpuState, Topology
from nodeagent.kube.podresources import ContainerDevices, Devices, PodResourcesClient
from nodeagent.logs import audit_event
from nodeagent.policyfile.glob import glob_matches
from nodeagent.policyfile.model import PolicySpec
from nodeagent.regular_file import write_atomically

log = structlog.get_logger("nodeagent.kubernetes")
REFRESH = 10.0
"""Seconds between two updates of the NodeResourceTopology object, at most."""

PREFIX = "nodeagent.io/"
NRT_API = ("topology.node.k8s.io", "v1alpha2", "noderesourcetopologies")
MANAGED_BY = "app.kubernetes.io/managed-by"
_BAD = re.compile(r"[^A-Za-z0-9._-]+")


def label_value(text: str) -> str:
    """`text` as a label value: other characters become '-', at most 63, alphanumeric ends."""
    value = _BAD.sub("-", text.strip())[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def nvlink_islands(devices: Sequence[Device], topology: Topology) -> list[list[int]]:
    """GPUs joined by NVLink (directly or through NVSwitch), as groups of indices, largest
    first; a GPU without NVLink is an island of one."""
    indices = [d.index for d in devices]
    parent = {i: i for i in indices}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a in indices:
        for b in indices:
            if a < b and topology.link(a, b).nvlinks > 0:
                parent[root(a)] = root(b)
    groups: dict[int, list[int]] = {}
    for i in indices:
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values(), key=lambda g: (-len(g), g))


def feature_labels(state: GpuState) -> dict[str, str]:
    """The node's static GPU topology as labels (names without the prefix's namespace)."""
    devices = state.devices
    models = Counter(d.name for d in devices)
    islands = nvlink_islands(devices, state.topology)
    numa = Counter(d.numa_node for d in devices if d.numa_node is not None)
    memory = [d.memory_total for d in devices if d.memory_total]
    nvswitch = any(
        state.topology.link(a.index, b.index).nvswitch
        for a in devices
        for b in devices
        if a.index < b.index
    )
    labels = {
        "gpu.present": "true",
        "gpu.count": str(len(devices)),
        "gpu.model": label_value(models.most_common(1)[0][0]) if len(models) == 1 else "mixed",
        "nvlink.islands": str(len(islands)),
        "nvlink.island-sizes": "_".join(str(len(g)) for g in islands),
        "nvlink.largest-island": str(len(islands[0])) if islands else "0",
        "nvlink.nvswitch": str(nvswitch).lower(),
        "gpu.numa-nodes": str(len(numa)),
    }
    if memory:
        labels["gpu.memory-mib"] = str(min(memory) >> 20)
    for node, count in sorted(numa.items()):
        labels[f"numa-node{node}.gpus"] = str(count)
    mig = [d for d in devices if d.mig_enabled]
    if any(d.mig_enabled is not None for d in devices):
        labels["gpu.mig-capable"] = "true"
        labels["gpu.mig-enabled"] = str(len(mig))
    if state.simulated:
        labels["gpu.simulated"] = "true"
    return {PREFIX + k: v for k, v in labels.items()}


def render_features(labels: Mapping[str, str]) -> str:
    lines = [
        "# Written by nodeagent: the node's GPU topology for node-feature-discovery's local",
        "# source. Rewritten whole when the GPUs change; edits here are lost.",
    ]
    lines += [f"{k}={v}" for k, v in sorted(labels.items())]
    return "\n".join(lines) + "\n"


def _numa(devices: Devices) -> int | None:
    return devices.numa_nodes[0] if len(devices.numa_nodes) == 1 else None


def node_resource_topology(
    node: str,
    state: GpuState,
    allocatable: Iterable[Devices],
    listing: Iterable[ContainerDevices],
    *,
    gpu_resources: Sequence[str],
    owner: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The NodeResourceTopology (v1alpha2) object for `node`: a zone per NUMA node, with
    each GPU resource's capacity (the node's GPUs there, for whole GPUs; else what the
    kubelet can allocate), allocatable (what the kubelet says it can hand out there) and
    available (allocatable less what pods hold). `owner`: the Node's name and uid, so that
    the object goes with the Node."""
    is_gpu = [d for d in allocatable if any(glob_matches(g, d.resource) for g in gpu_resources)]
    held = {u for c in listing for d in c.devices for u in d.ids}
    zones: dict[int, dict[str, list[str]]] = {}
    for d in is_gpu:
        numa = _numa(d)
        if numa is not None:
            zones.setdefault(numa, {}).setdefault(d.resource, []).extend(d.ids)
    gpus_on = Counter(dv.numa_node for dv in state.devices if dv.numa_node is not None)
    for numa in gpus_on:
        zones.setdefault(numa, {})
    out_zones = []
    for numa in sorted(zones):
        resources = []
        for resource, ids in sorted(zones[numa].items()):
            whole = resource == "nvidia.com/gpu"
            resources.append(
                {
                    "name": resource,
                    "capacity": gpus_on[numa] if whole else len(ids),
                    "allocatable": len(ids),
                    "available": len([u for u in ids if u not in held]),
                }
            )
        out_zones.append({"name": f"node-{numa}", "type": "Node", "resources": resources})
    metadata: dict[str, Any] = {
        "name": node,
        "labels": {MANAGED_BY: "nodeagent"},
    }
    if state.simulated:
        metadata["annotations"] = {"nodeagent.io/simulated": "true"}
    if owner is not None:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": owner["name"], "uid": owner["uid"]}
        ]
    return {
        "apiVersion": f"{NRT_API[0]}/{NRT_API[1]}",
        "kind": "NodeResourceTopology",
        "metadata": metadata,
        "zones": out_zones,
    }


class Publisher:
    """Writes the features file when its text changes, and keeps the NodeResourceTopology
    object as the node is (read, then replaced or created), at most every REFRESH seconds.
    A failure is logged once (until it changes or clears) and tried again later."""

    def __init__(
        self,
        pod_resources: PodResourcesClient,
        api_client: Any,
        node: str | None,
        listing: Callable[[], Sequence[ContainerDevices]],
    ) -> None:
        self._pod_resources = pod_resources
        self._api_client = api_client
        self._node = node
        self._listing = listing
        self._written: tuple[str, str] | None = None
        self._published: dict[str, Any] | None = None
        self._published_at = -REFRESH
        self._owner: dict[str, str] | None = None
        self._failing: dict[str, str] = {}
        self._late: _Call | None = None
        """A call to the API server that ran past its deadline, until it ends."""

    def publish(self, state: GpuState, spec: PolicySpec) -> None:
        path = spec.publish.node_features
        if path is not None:
            self._guarded("features", lambda: self._features(path, state))
        if spec.publish.node_resource_topology and time.monotonic() - self._published_at >= (
            REFRESH
        ):
            self._published_at = time.monotonic()
            self._guarded("topology", lambda: self._topology(state, spec))

    def _guarded(self, what: str, step: Callable[[], None]) -> None:
        try:
            step()
        except (OSError, NodeagentError) as e:
            self._fail(what, one_line(e))
        except Exception as e:  # the API server's answer, the client's errors
            self._fail(what, f"{type(e).__name__}: {one_line(e)}")
        else:
            if self._failing.pop(what, None) is not None:
                log.info("publish.recovered", what=what)

    def _fail(self, what: str, error: str) -> None:
        if self._failing.get(what) != error:
            log.warning("publish.failed", what=what, error=error, action="retrying later")
            self._failing[what] = error

    def _features(self, path: str, state: GpuState) -> None:
        text = render_features(feature_labels(state))
        if self._written == (path, text):
            return
        try:
            with open(path, encoding="utf-8") as f:
                same = f.read(1 << 16) == text
        except (OSError, UnicodeDecodeError):
            same = False
        if not same:
            try:
                write_atomically(path, text)
            except OSError as e:
                raise NodeagentError(
                    f"publish.node_features {path}: cannot write it: {e.strerror or e}"
                ) from None
            audit_event("publish.node_features", file=path, labels=text.count("\n") - 2)
        self._written = (path, text)

    def _topology(self, state: GpuState, spec: PolicySpec) -> None:
        """Bring the object to what the node is now. The API server is asked on a worker
        thread, and the loop's thread waits for it `api_server.timeout` at most in all: the
        client's own `_request_timeout` is per read (a server trickling a byte a second held
        `read_node` 119 s, issue 34). A call past its deadline is left to end on its own
        (each of its reads has the deadline); none other is made until it has, and what it
        brings is dropped (it makes no further request): the object is read again at the next
        refresh. State changes only
        here, on the loop's thread."""
        node = self._node
        assert node is not None, "checked when the Kubernetes side was made"
        deadline = spec.kubernetes.api_server.timeout
        late = self._late
        if late is not None and late.is_alive():
            raise NodeagentError(
                f"NodeResourceTopology {node}: the API server has not finished answering a"
                f" call that ran past its {deadline:g} s deadline: none other is made until it"
                " has"
            )
        self._late = None
        allocatable, listing = self._pod_resources.allocatable(), self._listing()

        def body(owner: dict[str, str]) -> dict[str, Any]:
            return node_resource_topology(
                node, state, allocatable, listing,
                gpu_resources=spec.kubernetes.gpu_resources, owner=owner,
            )  # fmt: skip

        if self._owner is not None and body(self._owner) == self._published:
            return
        owner = self._owner
        api_client = self._api_client
        call = _Call(
            lambda c: _exchange(c, api_client, node, owner=owner, body=body, deadline=deadline)
        )
        call.start()
        call.join(deadline)
        if call.is_alive():
            call.abandoned.set()
            self._late = call
            raise NodeagentError(
                f"NodeResourceTopology {node}: the API server did not answer in {deadline:g}"
                " s in all (timed out): left to end on its own"
            )
        self._owner = call.owner or self._owner
        if call.error is not None:
            raise call.error
        assert call.sent is not None, "a call that ended without error sent its body"
        audit_event("publish.node_resource_topology", node=node, zones=len(call.sent["zones"]))
        self._published = call.sent


class _Call(threading.Thread):
    """One exchange with the API server, on its own thread: what it learnt (the Node's
    owner reference, the body it sent) or the error it met, for the loop's thread to take."""

    def __init__(self, exchange: Callable[[_Call], None]) -> None:
        super().__init__(name="nodeagent-publish", daemon=True)
        self._exchange = exchange
        self.owner: dict[str, str] | None = None
        self.sent: dict[str, Any] | None = None
        self.error: Exception | None = None
        self.abandoned = threading.Event()
        """Set by the loop's thread past the deadline: the call makes no further request."""

    def run(self) -> None:
        try:
            self._exchange(self)
        except Exception as e:  # handed to the loop's thread, which logs it
            self.error = e


def _exchange(
    call: _Call,
    api_client: Any,
    node: str,
    *,
    owner: dict[str, str] | None,
    body: Callable[[dict[str, str]], dict[str, Any]],
    deadline: float,
) -> None:
    """The exchange itself, on `call`'s thread (read the Node once, then the object, then
    create or replace it), each request with the deadline on each of its reads as well; what
    it learns goes into `call`."""
    from kubernetes import client  # noqa: PLC0415

    if owner is None:
        found: Any = client.CoreV1Api(api_client).read_node(node, _request_timeout=deadline)
        owner = call.owner = {"name": node, "uid": str(found.metadata.uid)}
        if call.abandoned.is_set():
            return
    wanted = body(owner)
    api = client.CustomObjectsApi(api_client)
    group, version, plural = NRT_API
    try:
        current: Any = api.get_cluster_custom_object(
            group, version, plural, node, _request_timeout=deadline
        )
    except client.ApiException as e:
        if e.status != 404:
            raise
        if call.abandoned.is_set():
            return
        api.create_cluster_custom_object(group, version, plural, wanted, _request_timeout=deadline)
    else:
        if call.abandoned.is_set():
            return
        producer = (current["metadata"].get("labels") or {}).get(MANAGED_BY)
        if producer != "nodeagent":
            raise NodeagentError(
                f"NodeResourceTopology {node} has another producer ({MANAGED_BY}:"
                f" {producer or 'not set'}): left as it is; turn"
                " publish.node_resource_topology off, or that producer"
            )
        version_now = current["metadata"]["resourceVersion"]
        replaced = {
            **wanted, "metadata": {**wanted["metadata"], "resourceVersion": version_now}
        }  # fmt: skip
        api.replace_cluster_custom_object(
            group, version, plural, node, replaced, _request_timeout=deadline
        )
    call.sent = wanted
