"""The daemon's GPU side: one backend for its life, the sensor and the ledger of holds.

Each tick the loop calls `read` (I/O only: the GPUs, the holds outside the ledger, whose
the workloads reservations name are), `decide` (pure: binds, drops, lapses and grants, as a
value, and the GPU state with the holds as decided, which goes into the snapshot), then
`apply` (the ledger's changes and their audit events, and a new view); `sense` is the
three in one. After the plan, `executor.apply` (`nodeagent.actgpu`, the act layer's) sets
the power limits the plan decides, on the same backend. The /v1/gpus routes are the API's
(`nodeagent.routes.gpus`), over this service: its commands change the ledger on the loop's
thread; its reads answer from `view`, which `publish` replaces whole after each change.
`exec` asks through them and claims its grant when its job starts.
"""

from __future__ import annotations

import os
import queue
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import structlog

from nodeagent.actgpu import GpuExecutor
from nodeagent.gpu.backend import GpuBackend
from nodeagent.gpu.model import GpuState, Hold, HoldKind
from nodeagent.gpualloc.ledger import (
    UNBOUNDED,
    GpuLedger,
    LedgerChanges,
    LedgerView,
    UserBounds,
)
from nodeagent.gpualloc.placement import NodeGpus, node_gpus
from nodeagent.identity import Kind, WorkloadIdentity
from nodeagent.logs import audit_event
from nodeagent.policyfile.model import GpuSettings, PolicySpec
from nodeagent.sense.gpus import GpuSensor

if TYPE_CHECKING:
    from nodeagent.jobs import Job

log = structlog.get_logger("nodeagent.gpu")

_HEX_ID = re.compile(r"[0-9a-f]{12,64}")
_USER_MANAGER = re.compile(r"user\.slice/user-([0-9]+)\.slice/user@\1\.service/.+")
_BINDABLE = frozenset({Kind.CONTAINER, Kind.POD, Kind.SERVICE})
MAX_PIDS = 4096
"""Processes read to tell whose a workload is; one with more is nobody's but the operator's."""


def node_of(state: GpuState | None) -> NodeGpus | None:
    return None if state is None else node_gpus(state)


def environment(hold: Hold) -> dict[str, str]:
    """What a job's process sees: only its own GPUs, in PCI bus order."""
    visible = ",".join(hold.uuids)
    return {
        "CUDA_VISIBLE_DEVICES": visible,
        "NVIDIA_VISIBLE_DEVICES": visible,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


def names(container: str, w: WorkloadIdentity) -> bool:
    """Whether a reservation's `container` names workload `w`: its container id (in full,
    or its first 12 or more hex digits) or its name as `nodeagent workloads` lists it."""
    if w.container_id is not None and _HEX_ID.fullmatch(container):
        return w.container_id.startswith(container)
    return container == w.name


def _in_user_slice(path: str) -> bool:
    return path == "user.slice" or path.startswith("user.slice/")


def may_bind(path: str, uid: int) -> bool:
    """Whether a reservation made by `uid` may follow the cgroup at `path`: anywhere outside
    user.slice (what users cannot make), and inside it only that uid's own user manager's
    subtree; never a login session's scope, never another user's delegated cgroups."""
    if not _in_user_slice(path):
        return True
    m = _USER_MANAGER.fullmatch(path)
    return m is not None and int(m.group(1)) == uid


def bounds(gpu: GpuSettings) -> UserBounds:
    """Each uid's bounds (root has none) as the policy's gpu section sets them."""
    gpus = UNBOUNDED.gpus if gpu.max_gpus_per_user is None else gpu.max_gpus_per_user
    return UserBounds(gpu.max_holds_per_user, gpu.max_held_gpu_hours_per_user, gpus)


def process_uids(root: str, path: str, proc_root: str = "/proc") -> frozenset[int] | None:
    """The real uids of the processes in the cgroup at `path` (under cgroup root `root`)
    and its descendants, from /proc/<pid>/status; None past MAX_PIDS processes. A process
    gone since its cgroup.procs was read is not counted."""
    pids: list[int] = []
    for here, _, files in os.walk(os.path.join(root, path)):
        if "cgroup.procs" in files:
            try:
                with open(os.path.join(here, "cgroup.procs"), encoding="ascii") as f:
                    pids += [int(p) for p in f.read().split()]
            except (OSError, ValueError):
                continue
        if len(pids) > MAX_PIDS:
            return None
    uids: set[int] = set()
    for pid in pids:
        try:
            with open(os.path.join(proc_root, str(pid), "status"), encoding="ascii") as f:
                uids.update(int(ln.split()[1]) for ln in f if ln.startswith("Uid:"))
        except (OSError, ValueError, IndexError):
            continue
    return frozenset(uids)


def owner_of(path: str, uids: Callable[[str], frozenset[int] | None]) -> int | None:
    """Whose the workload at `path` is: user N's inside N's own user manager
    (user.slice/user-N.slice/user@N.service/), elsewhere the one uid every process in it
    runs as (`uids`); nobody's but the operator's where its processes run as several uids,
    as none yet, or in a login session."""
    m = _USER_MANAGER.fullmatch(path)
    if m is not None:
        return int(m.group(1))
    if _in_user_slice(path):
        return None
    running = uids(path)
    return next(iter(running)) if running is not None and len(running) == 1 else None


def may_own(hold: Hold, path: str, uids: Callable[[str], frozenset[int] | None]) -> bool:
    """Whether reservation `hold` may bind to the workload at `path`: one its uid owns, or,
    named by root (the operator), any (what may_bind allows). Another user's workload
    never: a hold bound there would stand for its GPUs, and keep the reservation as long
    as that workload lives."""
    if not may_bind(path, hold.uid):
        return False
    if 0 in (hold.uid, hold.named_by):
        return True
    return owner_of(path, uids) == hold.uid


@dataclass(frozen=True, slots=True)
class GpuReading:
    """What `GpuService.read` found this tick (I/O only, nothing changed)."""

    state: GpuState | None
    """The GPUs as read, with the ledger's holds; None: none the agent can use."""
    outside: tuple[Hold, ...]
    """The holds outside the ledger on them (the pods', Docker containers', Slurm jobs')."""
    gone: frozenset[str]
    """The cgroups of bound reservations that no longer exist."""
    named: Mapping[str, tuple[str, ...]]
    """Per reservation waiting to bind (by hold id): the workloads its container names."""
    uids: Mapping[str, frozenset[int] | None]
    """Per such workload outside user.slice: the uids its processes run as (process_uids)."""
    asked: Mapping[str, float]
    """Waiting requests asked about since the last read: request id -> when."""


NOTHING_READ = GpuReading(None, (), frozenset(), {}, {}, {})
"""A read of a node with no GPUs the agent can use, nothing held and nobody asking."""


@dataclass(frozen=True, slots=True)
class GpuDecisions:
    """What `GpuService.decide` decided (pure), for `apply` to make so."""

    ledger: LedgerChanges
    state: GpuState | None
    """The GPUs with the holds as decided (the grants of this step included, and the
    holds outside the ledger): what the policies see this tick."""
    outside: tuple[Hold, ...]
    unowned: tuple[tuple[Hold, tuple[str, ...]], ...]
    """Reservations whose container names only other users' workloads: those."""
    ambiguous: tuple[tuple[Hold, tuple[str, ...]], ...]
    """Reservations whose container names several workloads they may bind to: those."""


@dataclass(frozen=True, slots=True)
class GpuView:
    """What the /v1/gpus reads answer from, on the API's threads (`GpuService.view`):
    the ledger as last published, and the GPUs and outside holds of the last tick."""

    ledger: LedgerView
    state: GpuState | None
    outside: tuple[Hold, ...]

    def holds(self) -> tuple[Hold, ...]:
        return self.ledger.holds + self.outside


def binds(
    holds: Iterable[Hold], reading: GpuReading
) -> tuple[
    tuple[tuple[Hold, str], ...],
    tuple[tuple[Hold, tuple[str, ...]], ...],
    tuple[tuple[Hold, tuple[str, ...]], ...],
]:
    """Each reservation that names a container follows that container's cgroup once
    discovery shows exactly one workload of that name that its uid owns (or, named by root,
    any); one of that name that is another user's is never bound. The binds, then the
    reservations that name only others' workloads, and those that name several."""
    bound, unowned, ambiguous = [], [], []
    uids = reading.uids.get
    for h in holds:
        named = reading.named.get(h.id)
        if named is None:
            continue
        found = tuple(p for p in named if may_own(h, p, uids))
        theirs = tuple(p for p in named if p not in found)
        if not found and theirs:
            unowned.append((h, theirs))
        if len(found) == 1:
            bound.append((h, found[0]))
        elif len(found) > 1:
            ambiguous.append((h, found))
    return tuple(bound), tuple(unowned), tuple(ambiguous)


class GpuService:
    def __init__(
        self,
        backend: GpuBackend,
        spec: Callable[[], PolicySpec],
        exists: Callable[[str], bool],
        workloads: Callable[[], Iterable[WorkloadIdentity]] = lambda: (),
        uids: Callable[[str], frozenset[int] | None] = lambda path: None,
    ) -> None:
        """`uids`: the uids a workload's processes run as (process_uids), which say
        whose it is."""
        self.backend = backend
        self.sensor = GpuSensor(backend)
        self.executor = GpuExecutor(backend)
        """Sets the power limits each plan decides (the loop calls it after the plan)."""
        self.ledger = GpuLedger()
        self._spec = spec
        self._exists = exists
        self._workloads = workloads
        self.uids = uids
        """Whose a workload's processes are: `process_uids` over the host's /proc."""
        self._asked: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
        """Status calls, from the API's threads, for the loop's next read."""
        self._not_owned: dict[str, tuple[str, ...]] = {}
        self._ambiguous: dict[str, tuple[str, ...]] = {}
        self.state: GpuState | None = None
        self.outside_holds: tuple[Hold, ...] = ()
        """The holds read each tick outside the ledger: in Kubernetes mode the GPUs the
        device plugin gave each container (kind pod), from the kubelet (the ledger then
        stays empty); on any node the GPUs dockerd gave a container (kind runtime)."""
        self.view = GpuView(self.ledger.view(), None, ())
        """What the API's reads answer from; `publish` replaces it whole."""
        self._bounds: tuple[GpuSettings | None, UserBounds] = (None, UNBOUNDED)
        """The policy's gpu section last decided under, and the bounds it sets."""
        self._idle = GpuDecisions(self.ledger.decide(None, 0.0, 0.0), None, (), (), ())
        """An idle step's decisions (`NOTHING_READ`), kept while the ledger gives the same."""

    # --- the loop ---------------------------------------------------------------------

    def sense(
        self, now: float, pods: Callable[[GpuState], tuple[Hold, ...]] | None = None
    ) -> GpuState | None:
        """`read`, `decide`, `apply` and `publish` in one: the GPUs with the holds as
        decided. `now` is the monotonic clock."""
        decided = self.decide(self.read(pods), self._spec().gpu, now)
        self.apply(decided)
        self.publish()
        return decided.state

    def read(self, pods: Callable[[GpuState], tuple[Hold, ...]] | None = None) -> GpuReading:
        """Read the GPUs, and what the ledger's step needs to know of the rest: the holds
        outside the ledger on the GPUs just read (`pods`: the Kubernetes pods', Docker
        containers', Slurm jobs', given the state with the ledger's holds; never weighed
        when the ledger grants), which bound reservations' cgroups are gone, which
        workloads the unbound ones name and whose those are, and the status calls since
        the last read. Changes nothing."""
        held = self.ledger.holds()
        state = self.sensor.read(held)
        if state is None and not held and self._asked.empty():
            return NOTHING_READ  # no GPUs, nothing held, nobody asking: most nodes' tick
        outside = () if state is None or pods is None else pods(state)
        gone = frozenset(
            h.cgroup for h in held
            if h.kind is HoldKind.RESERVATION and h.cgroup and not self._exists(h.cgroup)
        )  # fmt: skip
        waiting = [
            h for h in held
            if h.kind is HoldKind.RESERVATION and h.cgroup is None and h.container is not None
        ]  # fmt: skip
        named: dict[str, tuple[str, ...]] = {}
        if waiting:
            workloads = [w for w in self._workloads() if w.kind in _BINDABLE]
            for h in waiting:
                assert h.container is not None
                named[h.id] = tuple(w.path for w in workloads if names(h.container, w))
        paths = {p for found in named.values() for p in found if not _in_user_slice(p)}
        asked: dict[str, float] = {}
        while not self._asked.empty():  # only the loop takes from it: not empty, it has one
            rid, when = self._asked.get_nowait()
            asked[rid] = max(when, asked.get(rid, when))
        return GpuReading(state, outside, gone, named, {p: self.uids(p) for p in paths}, asked)

    def decide(self, reading: GpuReading, gpu: GpuSettings, now: float) -> GpuDecisions:
        """This tick's decisions for the ledger, as a value (no I/O, no clock, nothing
        changed): reservations bound to their workloads or dropped with them, unclaimed
        holds lapsed, the queue served under the policy's `gpu` settings."""
        if self._bounds[0] is not gpu:
            self._bounds = (gpu, bounds(gpu))
        if reading is NOTHING_READ:
            changes = self.ledger.decide(None, now, gpu.claim_timeout, gpu.patience,
                                         self._bounds[1], backfill=gpu.backfill)  # fmt: skip
            if self._idle.ledger is not changes:
                self._idle = GpuDecisions(changes, None, (), (), ())
            return self._idle  # the same decisions as long as the ledger stays empty
        held = self.ledger.holds()
        bound, unowned, ambiguous = binds(held, reading)
        dropped = [
            h for h in held
            if h.kind is HoldKind.RESERVATION and h.cgroup and h.cgroup in reading.gone
        ]  # fmt: skip
        changes = self.ledger.decide(
            node_of(reading.state), now, gpu.claim_timeout, gpu.patience, self._bounds[1],
            bind=bound, drop=dropped, asked=reading.asked, backfill=gpu.backfill,
        )  # fmt: skip
        state = reading.state
        if state is not None:
            state = replace(state, holds=changes.holds + reading.outside)
        return GpuDecisions(changes, state, reading.outside, unowned, ambiguous)

    def apply(self, decided: GpuDecisions) -> None:
        """Make the decisions so: the ledger's changes, their audit events and log lines
        (a reservation that names another user's workload, or several, said once until
        that changes). The view the API reads is published by whoever applies them, once
        it is done (the loop: with the agent's own, at the end of the tick)."""
        changes = decided.ledger
        self.ledger.commit(changes)
        for h, cgroup in changes.bound:
            log.info("gpu.reservation_bound", reservation=h.owner, cgroup=cgroup)
        for h in changes.dropped:
            audit_event(
                "gpu.released",
                owner=h.owner,
                uuids=list(h.uuids),
                reason=f"its workload {h.cgroup} is gone",
            )
        for h in changes.lapsed:
            audit_event(
                "gpu.released", owner=h.owner, uuids=list(h.uuids), reason="not claimed in time"
            )
        for h, theirs in decided.unowned:
            if self._not_owned.get(h.id) != theirs:
                self._not_owned[h.id] = theirs
                log.warning(
                    "gpu.reservation_not_owned",
                    reservation=h.owner,
                    uid=h.uid,
                    container=h.container,
                    workloads=list(theirs[:10]),
                    action="not bound: a reservation binds only to its uid's own workload,"
                    " or to one root names (gpus attach as root)",
                )
        for h, found in decided.ambiguous:
            if self._ambiguous.get(h.id) != found:
                self._ambiguous[h.id] = found
                log.warning(
                    "gpu.reservation_ambiguous",
                    reservation=h.owner,
                    container=h.container,
                    matches=list(found[:10]),
                    action="bound to none until exactly one workload has that name",
                )
        self.state, self.outside_holds = decided.state, decided.outside

    def publish(self) -> GpuView:
        """A new view for the API's reads, made on the loop's thread after each tick and
        each change of the ledger, and swapped in whole."""
        ledger, was = self.ledger.view(), self.view
        if (
            ledger is not was.ledger
            or self.state is not was.state
            or (self.outside_holds is not was.outside)
        ):  # else the same three (an empty ledger, no GPUs): the same view
            self.view = GpuView(ledger, self.state, self.outside_holds)
        return self.view

    def seen(self, rid: str, now: float) -> None:
        """Request `rid`'s asker asked about it (`exec` does while it waits; one nobody
        asks about for ledger.STALE_AFTER is dropped). On an API thread: the loop's next
        read takes it."""
        self._asked.put((rid, now))

    # --- jobs -------------------------------------------------------------------------

    def claim(self, request_id: str, job: Job) -> Hold:
        """The job's own hold, from the grant its request got: the same uid (or root), the
        tenant and class the grant was for, and a name no other hold has."""
        hold = self.ledger.claim(
            request_id,
            uid=job.uid,
            owner=job.name,
            cgroup=job.cgroup,
            tenant=job.tenant,
            workload_class=str(job.workload_class),
        )
        self.publish()
        return hold

    def release_job(self, job: Job) -> None:
        """A job has ended: its own hold goes back, and nothing else."""
        if job.gpu_hold is None:
            return
        hold = self.ledger.release_job(job.gpu_hold, job.uid, time.monotonic())
        if hold is not None:
            audit_event(
                "gpu.released", owner=hold.owner, uuids=list(hold.uuids), reason="its job ended"
            )
            self.publish()
