"""The daemon's Kubernetes side, in `agent.mode: kubernetes`: the kubelet's PodResources
(which GPUs each container holds), the API server's watch when configured (pods' labels
and annotations as they are now, namespaces' labels), and what the loop asks of them.

PodResources is asked again when the node's pod containers change (a pod started or went)
and every REFRESH seconds otherwise; a kubelet that does not answer in time costs a tick
at most `kubernetes.pod_resources_timeout`, is logged once, and the last good answer
stands. GPUs that cannot be tied to a cgroup are logged once each, as warnings in the
audit stream (a pod's refused tenant claim is the rule's `refused`, logged by the loop).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from nodeagent.errors import NodeagentError, one_line
from nodeagent.gpu.model import GpuState, Hold
from nodeagent.identity import Kind, WorkloadIdentity
from nodeagent.kube import gpus
from nodeagent.kube.apiwatch import ApiWatch, in_cluster
from nodeagent.kube.podresources import ContainerDevices, PodResourcesClient, PodResourcesError
from nodeagent.kube.pods import EMPTY, PodDirectory
from nodeagent.kube.publish import Publisher
from nodeagent.logs import audit_warning
from nodeagent.policyfile.model import PolicySpec
from nodeagent.reach import Reach, Reachability

log = structlog.get_logger("nodeagent.kubernetes")
REFRESH = 10.0


def node_name(spec: PolicySpec) -> str | None:
    return spec.kubernetes.node_name or os.environ.get("NODE_NAME") or None


class KubernetesNode:
    def __init__(
        self,
        spec: PolicySpec,
        *,
        pod_resources: PodResourcesClient | None = None,
        api_client: Any = None,
    ) -> None:
        """`api_client`: a `kubernetes` ApiClient (default: in-cluster, made only when the
        policy watches the API server or publishes a NodeResourceTopology)."""
        k = spec.kubernetes
        self.node = node_name(spec)
        wanted = k.api_server.watch or spec.publish.node_resource_topology
        if wanted and self.node is None:
            raise NodeagentError(
                "kubernetes.api_server.watch and publish.node_resource_topology need this"
                " node's name: set NODE_NAME (the DaemonSet sets it from the downward API)"
                " or kubernetes.node_name"
            )
        self.pod_resources = pod_resources or PodResourcesClient(
            k.pod_resources_socket, k.pod_resources_timeout
        )
        self.api_client = api_client if api_client is not None or not wanted else in_cluster()
        self.api: ApiWatch | None = None
        if k.api_server.watch and self.node is not None:
            self.api = ApiWatch(self.api_client, self.node, timeout=k.api_server.timeout,
                                watch_timeout=k.api_server.watch_timeout)  # fmt: skip
        self.publisher = Publisher(self.pod_resources, self.api_client, self.node,
                                   lambda: self.listing)  # fmt: skip
        self.listing: tuple[ContainerDevices, ...] = ()
        self.reach = Reachability()
        """How the last PodResources call went (the API watch keeps its own)."""
        self._asked: tuple[float, object] = (-REFRESH, None)
        self._failing: str | None = None
        self._said: set[str] = set()

    def start(self) -> None:
        if self.api is not None:
            self.api.start()

    def close(self) -> None:
        if self.api is not None:
            self.api.close()
        self.pod_resources.close()

    def peers(self) -> tuple[Reach, ...]:
        """The kubelet's PodResources and the API server's watch, as they last answered."""
        return (*self.reach.now(), *(() if self.api is None else self.api.reach.now()))

    def pods(self) -> PodDirectory:
        return self.api.directory() if self.api is not None else EMPTY

    def gpu_holds(
        self,
        state: GpuState,
        spec: PolicySpec,
        identities: Sequence[WorkloadIdentity],
        classes: Mapping[str, str],
    ) -> tuple[Hold, ...]:
        """The GPUs the kubelet gave each container, as holds. `classes`: each workload's class
        by path, from the loop's assignments (kube imports no policy code: policy.classify
        reads kube.pods and kube.owners)."""
        containers = frozenset(i.path for i in identities if i.kind is Kind.CONTAINER and i.pod_uid)
        now = time.monotonic()
        if containers != self._asked[1] or now - self._asked[0] >= REFRESH:
            self._ask()
            self._asked = (now, containers)
        joined = gpus.join(self.listing, self.pods(), identities,
                           gpu_resources=spec.kubernetes.gpu_resources, gpus=state,
                           classes=classes)  # fmt: skip
        self._once("kubernetes.gpus_unjoined", joined.unjoined)
        return joined.holds

    def _ask(self) -> None:
        socket = self.pod_resources.socket
        try:
            self.listing = self.pod_resources.list()
        except PodResourcesError as e:
            message = one_line(e)
            self.reach.failed("pod-resources", socket, message)
            if message != self._failing:
                log.warning("kubernetes.pod_resources_failed", error=message,
                            action="keeping the last answer")  # fmt: skip
                self._failing = message
            return
        self.reach.ok("pod-resources", socket)
        if self._failing is not None:
            log.info("kubernetes.pod_resources_recovered")
            self._failing = None

    def publish(self, state: GpuState | None, spec: PolicySpec) -> None:
        """Tell the scheduler what the node has (publish in the policy)."""
        if state is not None:
            self.publisher.publish(state, spec)

    def _once(self, event: str, messages: Sequence[str]) -> None:
        for message in messages:
            if message not in self._said:
                self._said.add(message)
                audit_warning(event, message=message)
