"""The GPUs a container runtime gave its containers (`docker run --gpus`), as holds: so that a
process of such a container on its own GPUs is no GPU violation, while one on another GPU is.

Only Docker: dockerd keeps what it gave in the container's inspect answer
(nodeagent.gpu.grants). podman gives GPUs through CDI (`--device nvidia.com/gpu=...`), and
containerd without the kubelet through its own clients: neither is read, so their GPU
processes stay violations unless a reservation holds their GPUs (docs/gpus.md).

Asked lazily: only about a Docker container with a process on a GPU that no hold already
covers for it, so a node without such processes asks dockerd nothing. By then the container
runs, so its inspect does not wait on its start (dockerd holds a container it starts:
nodeagent.runtimes.docker). The answer is kept for the container's life (what it was given
does not change) and forgotten when its cgroup goes. A dockerd that does not answer makes no
holds for what it was not asked yet, said once per outage; asked again RETRY_S later. A
malformed answer is refused for that container alone, said once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import structlog

from nodeagent.discovery.layouts import delegated_uid
from nodeagent.errors import one_line
from nodeagent.gpu.grants import NO_GPUS, GpuGrant, granted, uuid_indices
from nodeagent.gpu.model import GpuState, Hold, HoldKind, holders
from nodeagent.identity import Kind, Runtime, WorkloadIdentity
from nodeagent.meta import Unavailable

log = structlog.get_logger("nodeagent.runtimes")

RETRY_S = 5.0
"""How long a dockerd that did not answer is left alone."""
BUDGET_S = 1.0
"""Seconds of asking in one tick; what is left waits for the next."""


class Grants(Protocol):
    """What is asked: Docker's adapter (nodeagent.runtimes.docker)."""

    socket: str

    def gpus(self, container_id: str) -> GpuGrant | None: ...


def _closest(cgroup: str, containers: Mapping[str, WorkloadIdentity]) -> WorkloadIdentity | None:
    """The container whose cgroup is `cgroup` or the closest one above it: its path's
    parents looked up, not every container tried."""
    path = cgroup
    while path:
        found = containers.get(path)
        if found is not None:
            return found
        path = path.rpartition("/")[0]
    return None


def owner(identity: WorkloadIdentity) -> str:
    """A Docker container's hold's owner: `docker:NAME` (its id's first 12 digits unnamed)."""
    meta = identity.meta
    named = meta.name if meta is not None and meta.name else None
    return f"docker:{named or (identity.container_id or '')[:12]}"


def _docker(i: WorkloadIdentity) -> bool:
    return (
        i.kind is Kind.CONTAINER
        and i.runtime is Runtime.DOCKER
        and i.container_id is not None
        and delegated_uid(i.path) is None  # a rootless dockerd's: not root's to answer for
    )


class RuntimeGpus:
    def __init__(self, clock: Callable[[], float] = time.monotonic, say: bool = True) -> None:
        self.clock = clock
        self.say = say
        self._grants: dict[str, GpuGrant] = {}
        """What dockerd gave each container asked about, by container id."""
        self._down: tuple[str, float] | None = None
        """Why dockerd did not answer, and when to ask it again."""
        self._said: set[tuple[str, str]] = set()
        self.asked = 0
        """Inspects asked (for the tests)."""

    def holds(
        self,
        docker: Grants | None,
        state: GpuState,
        identities: Sequence[WorkloadIdentity],
        classes: Mapping[str, str],
        held: Sequence[Hold],
    ) -> tuple[Hold, ...]:
        """A hold of kind runtime for each Docker container given GPUs, of those asked.
        `held`: the holds already known this tick (the ledger's, the pods'): a process they
        cover asks nothing. `classes`: each claimed workload's class, by cgroup."""
        containers = {i.path: i for i in identities if _docker(i)}
        live = {i.container_id for i in containers.values()}
        for cid in self._grants.keys() - live:
            del self._grants[cid]
        self._said = {s for s in self._said if s[0] in live}
        if docker is not None:
            self._ask(docker, state, containers, held)
        index = uuid_indices(state)
        out: list[Hold] = []
        for path, i in sorted(containers.items()):
            assert i.container_id is not None
            grant = self._grants.get(i.container_id)
            if grant is None or grant.none:
                continue
            uuids, foreign = granted(grant, state)
            if foreign:
                self._once(
                    i.container_id,
                    "runtime.gpus_unknown",
                    f"{owner(i)} was given {', '.join(foreign)} ({grant.via}),"
                    " which is no GPU this node has",
                )
            if not uuids:
                continue
            out.append(
                Hold(
                    owner(i),
                    HoldKind.RUNTIME,
                    uuids,
                    tuple(sorted({index[u] for u in uuids})),
                    shared_memory=None,
                    cgroup=path,
                    workload_class=classes.get(path),
                )
            )
        return tuple(out)

    def _ask(
        self,
        docker: Grants,
        state: GpuState,
        containers: Mapping[str, WorkloadIdentity],
        held: Sequence[Hold],
    ) -> None:
        """Ask dockerd about each container with a process on a GPU no hold covers for it."""
        parents = state.parents()
        now = self.clock()
        if self._down is not None and now < self._down[1]:
            return
        end = now + BUDGET_S
        for p in state.processes:
            if p.cgroup is None:
                continue
            container = _closest(p.cgroup, containers)
            if container is None:
                continue
            cid = container.container_id
            assert cid is not None
            if cid in self._grants:
                continue
            if any(h.covers(p.device_uuid, parents) for h in holders(p, held)):
                continue
            if self.clock() >= end:
                return
            if not self._inspect(docker, cid):
                return

    def _inspect(self, docker: Grants, cid: str) -> bool:
        """Ask about one container; False when dockerd does not answer."""
        self.asked += 1
        try:
            grant = docker.gpus(cid)
        except Unavailable as e:
            reason = one_line(e)
            if self._down is None and self.say:
                log.warning(
                    "runtime.gpus_unavailable",
                    runtime="docker",
                    socket=docker.socket,
                    error=reason,
                    action=(
                        "its containers' GPUs are not known, so their processes on GPUs count"
                        f" as violations; asking again every {RETRY_S:g} s"
                    ),
                )
            self._down = (reason, self.clock() + RETRY_S)
            return False
        except Exception as e:  # BadAnswer; an adapter's bug must not cost the tick either
            self._grants[cid] = NO_GPUS
            self._once(
                cid,
                "runtime.gpus_refused",
                f"dockerd's inspect of container {cid[:12]} was refused: {one_line(e)}",
            )
            return True
        if self._down is not None:
            if self.say:
                log.info("runtime.gpus_available", runtime="docker", socket=docker.socket)
            self._down = None
        self._grants[cid] = NO_GPUS if grant is None else grant
        return True

    def _once(self, cid: str, event: str, message: str) -> None:
        if (cid, event) in self._said:
            return
        self._said.add((cid, event))
        if self.say:
            log.warning(event, message=message, container=cid[:64])
