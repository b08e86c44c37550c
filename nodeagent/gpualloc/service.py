"""The daemon's GPU side: one backend for its life, the sensor, the ledger of holds and
the API routes for GPU requests and reservations.

The loop calls `sense` before planning (the GPU state goes into the snapshot, with the
holds as they were) and, after it, `executor.apply` (`nodeagent.actgpu`, the act layer's:
the power limits the plan decides, on the same backend); `exec` asks through the routes
and claims its grant when its job starts.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Annotated

import structlog
from pydantic import BeforeValidator, Field

from nodeagent.access import tenant_and_class
from nodeagent.actgpu import GpuExecutor
from nodeagent.api.bodies import (
    MAX_TTL,
    Body,
    Classed,
    Container,
    Cpus,
    GpuCount,
    GpuMemory,
    Instant,
    MigProfile,
    Name,
    Text,
    Token,
    Work,
    check_future,
    parse,
)
from nodeagent.api.server import Request, Routes
from nodeagent.errors import (
    BadRequest,
    Conflict,
    NotFound,
)
from nodeagent.gpu.backend import GpuBackend
from nodeagent.gpu.model import GpuState, Hold, HoldKind
from nodeagent.gpu.report import read_report
from nodeagent.gpualloc.ledger import GpuLedger, holdings
from nodeagent.gpualloc.placing import BadQuestion, answer, from_query
from nodeagent.identity import Kind, WorkloadIdentity
from nodeagent.logs import audit_event
from nodeagent.policy.gpu_checks import violations, within
from nodeagent.policy.gpu_durations import declared_duration
from nodeagent.policy.placement import GpuRequest, NodeGpus, Refusal, impossible, node_gpus
from nodeagent.policyfile.model import AgentMode, PolicySpec
from nodeagent.policyfile.units import parse_duration
from nodeagent.sense.gpus import GpuSensor

if TYPE_CHECKING:
    from nodeagent.jobs import Job

log = structlog.get_logger("nodeagent.gpu")

_HEX_ID = re.compile(r"[0-9a-f]{12,64}")
_USER_MANAGER = re.compile(r"user\.slice/user-([0-9]+)\.slice/user@\1\.service/.+")
_BINDABLE = frozenset({Kind.CONTAINER, Kind.POD, Kind.SERVICE})


def node_of(state: GpuState | None) -> NodeGpus | None:
    return None if state is None else node_gpus(state)


def refuse_impossible(want: GpuRequest, node: NodeGpus) -> None:
    """A request this node could never satisfy is refused now, not left in the queue."""
    never = impossible(want, node)
    if never is not None:
        raise BadRequest(f"{never.reason}; the request can never be placed here")


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


class _Want(Classed):
    name: Name
    count: GpuCount = 1
    memory: GpuMemory | None = None
    shared: bool = False
    mig: MigProfile | None = None

    def request(self) -> GpuRequest:
        if self.shared and self.memory is None:
            raise BadRequest("a shared GPU request needs the memory it uses, to pack it")
        return GpuRequest(self.count, self.memory, self.shared, self.mig)


class AskBody(_Want):
    """POST /v1/gpus/requests. The job's deadline orders the queue; with its work and CPUs
    it also says how long the job is expected to hold the GPUs."""

    deadline: Instant | None = None
    work: Work | None = None
    cpus: Cpus | None = None


class ReserveBody(_Want):
    """POST /v1/gpus/reservations."""

    ttl: Annotated[float, BeforeValidator(parse_duration), Field(gt=0, le=MAX_TTL)] = 600.0
    container: Container | None = None


class AttachBody(Body):
    """POST /v1/gpus/reservations/container."""

    name: Text
    container: Container


class IdBody(Body):
    id: Token


class NameBody(Body):
    name: Text


class GpuService:
    def __init__(
        self,
        backend: GpuBackend,
        spec: Callable[[], PolicySpec],
        fairness: Callable[[str], float],
        exists: Callable[[str], bool],
        workloads: Callable[[], Iterable[WorkloadIdentity]] = lambda: (),
    ) -> None:
        self.backend = backend
        self.sensor = GpuSensor(backend)
        self.executor = GpuExecutor(backend)
        """Sets the power limits each plan decides (the loop calls it after the plan)."""
        self.ledger = GpuLedger()
        self._spec = spec
        self._fairness = fairness
        self._exists = exists
        self._workloads = workloads
        self.state: GpuState | None = None
        self._ambiguous: dict[str, tuple[str, ...]] = {}
        self.pod_holds: tuple[Hold, ...] = ()
        """Kubernetes mode: the GPUs the device plugin gave each container (kind pod), from
        the kubelet, beside the ledger's (which stays empty in that mode)."""

    # --- the loop ---------------------------------------------------------------------

    def holds(self) -> tuple[Hold, ...]:
        return self.ledger.holds() + self.pod_holds

    def sense(
        self, now: float, pods: Callable[[GpuState], tuple[Hold, ...]] | None = None
    ) -> GpuState | None:
        """Read the GPUs; bind reservations to their containers, release those whose
        container is gone; lapse and grant. `now` is the monotonic clock. `pods`: in
        Kubernetes mode, the pods' holds on the GPUs just read."""
        state = self.sensor.read(self.ledger.holds())
        self.pod_holds = () if state is None or pods is None else pods(state)
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
        for h in self.ledger.step(node_of(state), now, gpu.claim_timeout, gpu.patience):
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
        discovery shows exactly one workload of that name that its uid may hold GPUs for."""
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
            found = tuple(
                w.path for w in workloads if names(h.container, w) and may_bind(w.path, h.uid)
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

    # --- the API ----------------------------------------------------------------------

    def routes(self) -> Routes:
        return {
            "/v1/gpus": {"GET": self._report},
            "/v1/gpus/requests": {"POST": self._ask, "GET": self._status, "DELETE": self._cancel},
            "/v1/gpus/reservations": {"POST": self._reserve, "DELETE": self._unreserve},
            "/v1/gpus/place": {"GET": self._place},
            "/v1/gpus/reservations/container": {"POST": self._attach},
        }

    def _place(self, request: Request) -> object:
        """`gpus place` against the live holds: read-only, nothing reserved."""
        node = self._node()
        held = holdings(self.holds())
        try:
            return answer(
                from_query(request.query),
                node,
                held,
                source=self.backend.source,
                simulated=self.backend.simulated,
                holds_considered=True,
            )
        except BadQuestion as e:
            raise BadRequest(str(e)) from None

    def _node(self) -> NodeGpus:
        node = node_of(self.state)
        if node is None:
            why = self.backend.reason or "none read yet"
            raise NotFound(f"this node has no GPUs the agent can use ({why})")
        return node

    def _refuse_in_kubernetes(self, what: str) -> None:
        if self._spec().agent.mode is AgentMode.KUBERNETES:
            raise BadRequest(
                f"{what} is refused: agent.mode is kubernetes, where the kubelet's device"
                " plugin assigns GPUs; request nvidia.com/gpu in a pod spec instead"
            )

    def _ask(self, request: Request) -> object:
        self._refuse_in_kubernetes("nodeagent exec --gpus")
        body = parse(AskBody, request.body)
        spec = self._spec()
        want = body.request()
        refuse_impossible(want, self._node())
        tenant, cls = tenant_and_class(spec, request.peer, body.tenant, body.workload_class)
        wall = time.time()
        check_future(body.deadline, wall)
        due = None if body.deadline is None else body.deadline - wall
        answer = self.ledger.ask(
            body.name,
            want,
            uid=request.peer.uid,
            tenant=tenant,
            priority=spec.classes[cls].priority,
            deadline=body.deadline,
            fairness=self._fairness(tenant),
            workload_class=str(cls),
            node=self._node(),
            now=time.monotonic(),
            claim_timeout=spec.gpu.claim_timeout,
            max_waiting=spec.gpu.max_waiting_per_user,
            declared=declared_duration(due, body.work, body.cpus),
            patience=spec.gpu.patience,
        )
        if answer.status == "granted" and answer.hold is not None:
            audit_event(
                "gpu.granted",
                owner=body.name,
                uid=request.peer.uid,
                uuids=list(answer.hold.uuids),
                request=answer.id,
            )
        return answer.to_json()

    def _status(self, request: Request) -> object:
        rid = request.query.get("id", "")
        return self.ledger.status(rid, request.peer.uid, time.monotonic()).to_json()

    def _cancel(self, request: Request) -> object:
        body = parse(IdBody, request.body)
        self.ledger.cancel(body.id, request.peer.uid)
        return {"cancelled": True}

    def _reserve(self, request: Request) -> object:
        self._refuse_in_kubernetes("nodeagent gpus reserve")
        body = parse(ReserveBody, request.body)
        want = body.request()
        refuse_impossible(want, self._node())
        tenant, cls = tenant_and_class(self._spec(), request.peer, body.tenant, body.workload_class)
        got = self.ledger.reserve(
            body.name,
            want,
            uid=request.peer.uid,
            tenant=tenant,
            workload_class=str(cls),
            container=body.container,
            node=self._node(),
            until=time.monotonic() + body.ttl,
        )
        if isinstance(got, Refusal):
            raise Conflict(f"no GPUs fit now: {got.reason}")
        hold, result = got
        audit_event(
            "gpu.reserved",
            owner=hold.owner,
            uid=hold.uid,
            uuids=list(hold.uuids),
            ttl=body.ttl,
            container=hold.container,
        )
        return {
            "name": hold.owner,
            "uuids": list(hold.uuids),
            "indices": list(hold.indices),
            "score": result.score,
            "fraction": result.fraction,
            "until": time.time() + body.ttl,
            "container": hold.container,
        }

    def _attach(self, request: Request) -> object:
        body = parse(AttachBody, request.body)
        hold = self.ledger.attach(body.name, request.peer.uid, body.container)
        audit_event("gpu.reservation_container", owner=hold.owner, container=hold.container)
        return {"name": hold.owner, "container": hold.container}

    def _unreserve(self, request: Request) -> object:
        body = parse(NameBody, request.body)
        hold = self.ledger.release_reservation(body.name, request.peer.uid)
        audit_event(
            "gpu.released",
            owner=hold.owner,
            uid=request.peer.uid,
            uuids=list(hold.uuids),
            reason="released by request",
        )
        return {"released": hold.owner}

    def _report(self, request: Request) -> object:
        state = self.state
        report = read_report(self.backend)
        holds = self.holds()
        found = violations(state) if state is not None else []
        for gpu in report["gpus"]:
            gpu["assigned"] = [
                {
                    "owner": h.owner,
                    "kind": str(h.kind),
                    "uid": h.uid,
                    "tenant": h.tenant,
                    "class": h.workload_class,
                    "cgroup": h.cgroup,
                    "container": h.container,
                    "uuids": list(h.uuids),
                    "shared_memory": h.shared_memory,
                }
                for h in holds
                if gpu["index"] in h.indices
            ]
            on = {gpu["uuid"], *(m["uuid"] for m in gpu["mig_devices"])}
            gpu["violations"] = [
                {
                    "pid": p.pid,
                    "cgroup": p.cgroup,
                    "device": p.device_uuid,
                    "kind": kind,
                    "holder": None if h is None else h.owner,
                }
                for p, kind, h in found
                if p.device_uuid in on
            ]
        uid = request.peer.uid
        report["queue"] = [
            {
                # a request's id is shown to its asker and root only
                "id": w.id if uid in (0, w.uid) else None,
                "owner": w.owner,
                "uid": w.uid,
                "count": w.request.count,
                "class": w.workload_class,
                "reason": w.reason,
            }
            for w in self.ledger.queue()
        ]
        return report

    def cgroup_gpus(self) -> dict[str, tuple[int, ...]]:
        """GPU indices per workload cgroup, for allocations."""
        return {h.cgroup: h.indices for h in self.holds() if h.cgroup is not None}

    def holder_of(self, cgroup: str) -> Hold | None:
        return next(
            (h for h in self.holds() if h.cgroup is not None and within(cgroup, h.cgroup)),
            None,
        )
