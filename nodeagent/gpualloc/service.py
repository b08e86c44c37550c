"""The daemon's GPU side: one backend for its life, the sensor and the ledger of holds.

The loop calls `sense` before planning (the GPU state goes into the snapshot, with the
holds as they were) and, after it, `executor.apply` (`nodeagent.actgpu`, the act layer's:
the power limits the plan decides, on the same backend). The /v1/gpus routes are the
API's (`nodeagent.routes.gpus`), over this service: `exec` asks through them and claims
its grant when its job starts.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import structlog

from nodeagent.actgpu import GpuExecutor
from nodeagent.gpu.backend import GpuBackend
from nodeagent.gpu.model import GpuState, Hold, HoldKind
from nodeagent.gpualloc.ledger import UNBOUNDED, GpuLedger, UserBounds
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


def may_bind(path: str, uid: int) -> bool:
    """Whether a reservation made by `uid` may follow the cgroup at `path`: anywhere outside
    user.slice (what users cannot make), and inside it only that uid's own user manager's
    subtree; never a login session's scope, never another user's delegated cgroups."""
    if path != "user.slice" and not path.startswith("user.slice/"):
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
    if path == "user.slice" or path.startswith("user.slice/"):
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
        self._uids = uids
        self._not_owned: dict[str, tuple[str, ...]] = {}
        self.state: GpuState | None = None
        self._ambiguous: dict[str, tuple[str, ...]] = {}
        self.outside_holds: tuple[Hold, ...] = ()
        """The holds read each tick outside the ledger: in Kubernetes mode the GPUs the
        device plugin gave each container (kind pod), from the kubelet (the ledger then
        stays empty); on any node the GPUs dockerd gave a container (kind runtime)."""

    # --- the loop ---------------------------------------------------------------------

    def holds(self) -> tuple[Hold, ...]:
        return self.ledger.holds() + self.outside_holds

    def sense(
        self, now: float, pods: Callable[[GpuState], tuple[Hold, ...]] | None = None
    ) -> GpuState | None:
        """Read the GPUs; bind reservations to their containers, release those whose
        container is gone; lapse and grant. `now` is the monotonic clock. `pods`: the holds
        outside the ledger on the GPUs just read (Kubernetes pods', Docker containers'), given
        the state with the ledger's holds; they are not weighed when the ledger grants."""
        state = self.sensor.read(self.ledger.holds())
        self.outside_holds = () if state is None or pods is None else pods(state)
        self._bind()
        for h in self.ledger.holds():
            gone = h.kind is HoldKind.RESERVATION and h.cgroup and not self._exists(h.cgroup)
            if gone and self.ledger.drop(h.id) is not None:
                audit_event(
                    "gpu.released",
                    owner=h.owner,
                    uuids=list(h.uuids),
                    reason=f"its workload {h.cgroup} is gone",
                )
        gpu = self._spec().gpu
        lapsed = self.ledger.step(node_of(state), now, gpu.claim_timeout, gpu.patience, bounds(gpu))
        for h in lapsed:
            audit_event(
                "gpu.released", owner=h.owner, uuids=list(h.uuids), reason="not claimed in time"
            )
        if state is not None:
            state = GpuState(
                state.devices,
                state.topology,
                state.telemetry,
                state.processes,
                self.holds(),
                state.source,
                state.simulated,
            )
        self.state = state
        return state

    def _bind(self) -> None:
        """Each reservation that names a container follows that container's cgroup once
        discovery shows exactly one workload of that name that its uid owns (or, named by
        root, any); one of that name that is another user's is never bound, and said once."""
        waiting = [
            h
            for h in self.ledger.holds()
            if h.kind is HoldKind.RESERVATION and h.cgroup is None and h.container is not None
        ]
        if not waiting:
            return
        workloads = [w for w in self._workloads() if w.kind in _BINDABLE]
        for h in waiting:
            assert h.container is not None
            named = [w.path for w in workloads if names(h.container, w)]
            found = tuple(p for p in named if may_own(h, p, self._uids))
            theirs = tuple(p for p in named if p not in found)
            if not found and theirs and self._not_owned.get(h.id) != theirs:
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
            if len(found) == 1:
                self.ledger.bind(h.id, found[0])
                log.info("gpu.reservation_bound", reservation=h.owner, cgroup=found[0])
            elif len(found) > 1 and self._ambiguous.get(h.id) != found:
                self._ambiguous[h.id] = found
                log.warning(
                    "gpu.reservation_ambiguous",
                    reservation=h.owner,
                    container=h.container,
                    matches=list(found[:10]),
                    action="bound to none until exactly one workload has that name",
                )

    # --- jobs -------------------------------------------------------------------------

    def claim(self, request_id: str, job: Job) -> Hold:
        """The job's own hold, from the grant its request got: the same uid (or root), the
        tenant and class the grant was for, and a name no other hold has."""
        return self.ledger.claim(
            request_id,
            uid=job.uid,
            owner=job.name,
            cgroup=job.cgroup,
            tenant=job.tenant,
            workload_class=str(job.workload_class),
        )

    def release_job(self, job: Job) -> None:
        """A job has ended: its own hold goes back, and nothing else."""
        if job.gpu_hold is None:
            return
        hold = self.ledger.release_job(job.gpu_hold, job.uid, time.monotonic())
        if hold is not None:
            audit_event(
                "gpu.released", owner=hold.owner, uuids=list(hold.uuids), reason="its job ended"
            )
