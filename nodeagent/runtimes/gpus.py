"""The GPUs whoever started a workload gave it, as holds: a container's runtime (`docker run
--gpus`) or Slurm (a job's GRES), so that a process of such a workload on its own GPUs is no GPU
violation, while one on another GPU is.

Docker keeps what it gave in the container's inspect answer (nodeagent.gpu.grants); Slurm in
the job's record (`scontrol show job -d`: nodeagent.gpu.gres, asked by nodeagent.slurm). podman
gives GPUs through CDI (`--device nvidia.com/gpu=...`), and containerd without the kubelet through
its own clients: neither is read, so their GPU processes stay violations unless a reservation
holds their GPUs (docs/gpus.md).

Asked lazily: only about a workload with a process on a GPU that no hold already covers for it,
so a node without such processes asks nothing. By then the workload runs, so its answer does not
wait on its start (dockerd holds a container it starts: nodeagent.runtimes.docker). The answer is
kept for the workload's life (what it was given does not change) and forgotten when its cgroup
goes. A giver that does not answer makes no holds for what it was not asked yet, said once per
outage; asked again its `retry_s` later. A malformed answer is refused for that workload alone,
said once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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


class Giver(Protocol):
    """Who gave its workloads GPUs and answers for what it gave each."""

    @property
    def runtime(self) -> str:
        """Who it is, in logs: `docker`, `slurm`."""

    @property
    def where(self) -> str:
        """Where it is asked (a socket, a command), in logs."""

    @property
    def retry_s(self) -> float:
        """How long it is left alone after it did not answer."""

    def key(self, identity: WorkloadIdentity) -> str | None:
        """The id it knows the workload by (a container's, a job's); None: not one of its."""

    def owner(self, identity: WorkloadIdentity) -> str:
        """The hold's owner, as `nodeagent gpus` shows it (`docker:NAME`, `slurm:JOBID`)."""

    def gpus(self, identity: WorkloadIdentity) -> GpuGrant | None:
        """What it gave the workload; None: it does not know it. Unavailable when it does not
        answer; BadAnswer for an answer that is not what it says."""

    def uuids(self, grant: GpuGrant, state: GpuState) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the UUIDs of the GPUs `grant` names on this node; the ids it names that are not)."""


def _closest(cgroup: str, workloads: Mapping[str, WorkloadIdentity]) -> WorkloadIdentity | None:
    """The workload whose cgroup is `cgroup` or the closest one above it: its path's parents
    looked up, not every workload tried."""
    path = cgroup
    while path:
        found = workloads.get(path)
        if found is not None:
            return found
        path = path.rpartition("/")[0]
    return None


def owner(identity: WorkloadIdentity) -> str:
    """A Docker container's hold's owner: `docker:NAME` (its id's first 12 digits unnamed)."""
    meta = identity.meta
    named = meta.name if meta is not None and meta.name else None
    return f"docker:{named or (identity.container_id or '')[:12]}"


class Grants(Protocol):
    """What Docker is asked: its adapter (nodeagent.runtimes.docker)."""

    socket: str

    def gpus(self, container_id: str) -> GpuGrant | None: ...


@dataclass(frozen=True, slots=True)
class DockerGpus:
    """Docker as a Giver: rootful dockerd's containers, asked by their inspect."""

    docker: Grants
    runtime: str = "docker"
    retry_s: float = RETRY_S

    @property
    def where(self) -> str:
        return self.docker.socket

    def key(self, identity: WorkloadIdentity) -> str | None:
        i = identity
        docker = i.kind is Kind.CONTAINER and i.runtime is Runtime.DOCKER
        # a rootless dockerd's container is not root's dockerd's to answer for
        return i.container_id if docker and delegated_uid(i.path) is None else None

    def owner(self, identity: WorkloadIdentity) -> str:
        return owner(identity)

    def gpus(self, identity: WorkloadIdentity) -> GpuGrant | None:
        assert identity.container_id is not None
        return self.docker.gpus(identity.container_id)

    def uuids(self, grant: GpuGrant, state: GpuState) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return granted(grant, state)


class RuntimeGpus:
    """The holds of one Giver's workloads, asked lazily and kept for their lives."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, say: bool = True) -> None:
        self.clock = clock
        self.say = say
        self._grants: dict[str, GpuGrant] = {}
        """What the giver gave each workload asked about, by its key."""
        self._down: tuple[str, float] | None = None
        """Why the giver did not answer, and when to ask it again."""
        self._said: set[tuple[str, str]] = set()
        self.asked = 0
        """Questions asked (for the tests)."""

    def holds(
        self,
        giver: Giver | None,
        state: GpuState,
        identities: Sequence[WorkloadIdentity],
        classes: Mapping[str, str],
        held: Sequence[Hold],
    ) -> tuple[Hold, ...]:
        """A hold of kind runtime for each of the giver's workloads given GPUs, of those
        asked. `held`: the holds already known this tick (the ledger's, the pods', another
        giver's): a process they cover asks nothing. `classes`: each claimed workload's
        class, by cgroup. Without a giver (turned off), nothing is held or kept."""
        keys: dict[str, str] = {}
        workloads: dict[str, WorkloadIdentity] = {}
        for i in identities:
            key = None if giver is None else giver.key(i)
            if key is not None:
                keys[i.path], workloads[i.path] = key, i
        live = set(keys.values())
        for key in self._grants.keys() - live:
            del self._grants[key]
        self._said = {s for s in self._said if s[0] in live}
        if giver is None:
            return ()
        self._ask(giver, state, workloads, keys, held)
        index = uuid_indices(state)
        out: list[Hold] = []
        for path, i in sorted(workloads.items()):
            key = keys[path]
            grant = self._grants.get(key)
            if grant is None or grant.none:
                continue
            uuids, foreign = giver.uuids(grant, state)
            if foreign:
                self._once(
                    giver,
                    key,
                    "runtime.gpus_unknown",
                    f"{giver.owner(i)} was given {', '.join(foreign)} ({grant.via}),"
                    " which maps to no GPU NVML lists here",
                )
            if not uuids:
                continue
            out.append(
                Hold(
                    giver.owner(i),
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
        giver: Giver,
        state: GpuState,
        workloads: Mapping[str, WorkloadIdentity],
        keys: Mapping[str, str],
        held: Sequence[Hold],
    ) -> None:
        """Ask about each workload with a process on a GPU no hold covers for it."""
        parents = state.parents()
        now = self.clock()
        if self._down is not None and now < self._down[1]:
            return
        end = now + BUDGET_S
        for p in state.processes:
            if p.cgroup is None:
                continue
            workload = _closest(p.cgroup, workloads)
            if workload is None:
                continue
            key = keys[workload.path]
            if key in self._grants:
                continue
            if any(h.covers(p.device_uuid, parents) for h in holders(p, held)):
                continue
            if self.clock() >= end:
                return
            if not self._inspect(giver, workload, key):
                return

    def _inspect(self, giver: Giver, workload: WorkloadIdentity, key: str) -> bool:
        """Ask about one workload; False when the giver does not answer."""
        self.asked += 1
        try:
            grant = giver.gpus(workload)
        except Unavailable as e:
            reason = one_line(e)
            if self._down is None and self.say:
                log.warning(
                    "runtime.gpus_unavailable",
                    runtime=giver.runtime,
                    at=giver.where,
                    error=reason,
                    action=(
                        f"the GPUs of {giver.runtime}'s workloads are not known, so their"
                        " processes on GPUs count as violations; asking again every"
                        f" {giver.retry_s:g} s"
                    ),
                )
            self._down = (reason, self.clock() + giver.retry_s)
            return False
        except Exception as e:  # BadAnswer; an adapter's bug must not cost the tick either
            self._grants[key] = NO_GPUS
            self._once(
                giver,
                key,
                "runtime.gpus_refused",
                f"{giver.runtime}'s answer for {giver.owner(workload)} was refused: {one_line(e)}",
            )
            return True
        if self._down is not None:
            if self.say:
                log.info("runtime.gpus_available", runtime=giver.runtime, at=giver.where)
            self._down = None
        self._grants[key] = NO_GPUS if grant is None else grant
        return True

    def _once(self, giver: Giver, key: str, event: str, message: str) -> None:
        if (key, event) in self._said:
            return
        self._said.add((key, event))
        if self.say:
            log.warning(event, message=message, runtime=giver.runtime, workload=key[:64])
