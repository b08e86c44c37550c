"""The daemon's GPU side: one backend for its life, the sensor, the ledger of holds, the
API routes for GPU requests and reservations, and applying power limits.

The loop calls `sense` before planning (the GPU state goes into the snapshot, with the
holds as they were) and `apply` after (power limits from the plan); `exec` asks through
the routes and claims its grant when its job starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from nodeagent.api.server import ApiBadRequest, ApiConflict, ApiNotFound, Request, Routes
from nodeagent.errors import NodeagentError, one_line
from nodeagent.gpu.backend import GpuBackend
from nodeagent.gpu.ledger import GpuLedger, holdings
from nodeagent.gpu.model import GpuState, Hold
from nodeagent.gpu.placing import BadQuestion, answer, from_query
from nodeagent.gpu.report import read_report
from nodeagent.logs import audit_event
from nodeagent.policy.gpu_checks import violations, within
from nodeagent.policy.placement import (
    GpuRequest,
    NodeGpus,
    Placement,
    impossible,
    node_gpus,
    place,
)
from nodeagent.policy.plan import Plan
from nodeagent.sense.gpus import GpuSensor
from nodeagent.spec.model import AgentMode, PolicySpec, WorkloadClass
from nodeagent.spec.units import parse_duration

log = structlog.get_logger("nodeagent.gpu")

MAX_GPUS = 64


def node_of(state: GpuState | None) -> NodeGpus | None:
    return None if state is None else node_gpus(state)


def refuse_impossible(want: GpuRequest, node: NodeGpus) -> None:
    """A request this node could never satisfy is refused now, not left in the queue."""
    never = impossible(want, node)
    if never is not None:
        raise ApiBadRequest(f"{never.reason}; the request can never be placed here")


def environment(hold: Hold) -> dict[str, str]:
    """What a job's process sees: only its own GPUs, in PCI bus order."""
    visible = ",".join(hold.uuids)
    return {
        "CUDA_VISIBLE_DEVICES": visible,
        "NVIDIA_VISIBLE_DEVICES": visible,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


def _request(body: Mapping[str, Any]) -> GpuRequest:
    count = body.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_GPUS:
        raise ApiBadRequest(f"count must be a whole number of GPUs from 1 to {MAX_GPUS}")
    memory = body.get("memory")
    if memory is not None and (
        isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0
    ):
        raise ApiBadRequest("memory must be a positive number of bytes")
    shared = body.get("shared", False)
    mig = body.get("mig")
    if not isinstance(shared, bool) or (mig is not None and not isinstance(mig, str)):
        raise ApiBadRequest("shared must be true or false, and mig a MIG profile name")
    if shared and memory is None:
        raise ApiBadRequest("a shared GPU request needs the memory it uses, to pack it")
    return GpuRequest(count, memory, shared, mig)


class GpuService:
    def __init__(
        self,
        backend: GpuBackend,
        spec: Callable[[], PolicySpec],
        fairness: Callable[[str], float],
        exists: Callable[[str], bool],
    ) -> None:
        self.backend = backend
        self.sensor = GpuSensor(backend)
        self.ledger = GpuLedger()
        self._spec = spec
        self._fairness = fairness
        self._exists = exists
        self.state: GpuState | None = None
        self._power_failed: dict[str, str] = {}
        self.pod_holds: tuple[Hold, ...] = ()
        """Kubernetes mode: the GPUs the device plugin gave each container (kind "pod"),
        from the kubelet, beside the ledger's (which stays empty in that mode)."""

    # --- the loop ---------------------------------------------------------------------

    def holds(self) -> tuple[Hold, ...]:
        return self.ledger.holds() + self.pod_holds

    def sense(
        self, now: float, pods: Callable[[GpuState], tuple[Hold, ...]] | None = None
    ) -> GpuState | None:
        """Read the GPUs; bind reservations to the workloads seen on them; lapse and grant.
        `pods`: in Kubernetes mode, the pods' holds on the GPUs just read."""
        state = self.sensor.read(self.ledger.holds())
        self.pod_holds = () if state is None or pods is None else pods(state)
        if state is not None:
            parents = state.parents()
            for p in state.processes:
                for h in state.holds:
                    if (
                        h.kind == "reservation"
                        and h.cgroup is None
                        and p.cgroup
                        and h.covers(p.device_uuid, parents)
                    ):
                        self.ledger.bind(h.owner, p.cgroup)
                        log.info("gpu.reservation_bound", reservation=h.owner, cgroup=p.cgroup)
        for h in self.ledger.holds():
            if h.kind == "reservation" and h.cgroup is not None and not self._exists(h.cgroup):
                self.ledger.release(h.owner)
                audit_event(
                    "gpu.released",
                    owner=h.owner,
                    uuids=list(h.uuids),
                    reason=f"its workload {h.cgroup} is gone",
                )
        for h in self.ledger.step(node_of(state), now, self._spec().gpu.claim_timeout):
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

    def apply(self, plan: Plan, dry_run: bool) -> None:
        """Set the power limits the plan wants, read them back, audit each change."""
        current = {t.uuid: t.power_limit_mw for t in (self.state.telemetry if self.state else ())}
        for d in plan.devices:
            if d.setting != "power_limit_mw" or dry_run:
                continue
            try:
                result = self.backend.set_power_limit(d.uuid, d.value)
            except NodeagentError as e:
                if self._power_failed.get(d.uuid) != str(e):
                    log.warning(
                        "gpu.power_failed", gpu=d.uuid, target_mw=d.value, error=one_line(e)
                    )
                    self._power_failed[d.uuid] = str(e)
                continue
            self._power_failed.pop(d.uuid, None)
            audit_event(
                "gpu.power_limit",
                gpu=d.uuid,
                old_mw=current.get(d.uuid),
                new_mw=result.applied_mw,
                requested_mw=d.value,
                reason=d.reason,
                simulated=result.simulated,
            )

    # --- jobs -------------------------------------------------------------------------

    def claim(self, request_id: object, job: str, cgroup: str) -> Hold:
        if not isinstance(request_id, str):
            raise ApiBadRequest("gpu_request must be the id a GPU request answered")
        try:
            return self.ledger.claim(request_id, job, cgroup)
        except KeyError as e:
            raise ApiConflict(str(e.args[0])) from None

    def release(self, owner: str) -> None:
        hold = self.ledger.release(owner)
        if hold is not None:
            audit_event("gpu.released", owner=owner, uuids=list(hold.uuids), reason="its job ended")

    # --- the API ----------------------------------------------------------------------

    def routes(self) -> Routes:
        return {
            "/v1/gpus": {"GET": self._report},
            "/v1/gpus/requests": {"POST": self._ask, "GET": self._status, "DELETE": self._cancel},
            "/v1/gpus/reservations": {"POST": self._reserve, "DELETE": self._unreserve},
            "/v1/gpus/place": {"GET": self._place},
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
            raise ApiBadRequest(str(e)) from None

    def _node(self) -> NodeGpus:
        node = node_of(self.state)
        if node is None:
            why = self.backend.reason or "none read yet"
            raise ApiNotFound(f"this node has no GPUs the agent can use ({why})")
        return node

    def _refuse_in_kubernetes(self, what: str) -> None:
        if self._spec().agent.mode is AgentMode.KUBERNETES:
            raise ApiBadRequest(
                f"{what} is refused: agent.mode is kubernetes, where the kubelet's device"
                " plugin assigns GPUs; request nvidia.com/gpu in a pod spec instead"
            )

    def _ask(self, request: Request) -> object:
        self._refuse_in_kubernetes("nodeagent exec --gpus")
        body = request.body
        spec = self._spec()
        want = _request(body)
        refuse_impossible(want, self._node())
        owner = str(body.get("name", ""))
        if not owner:
            raise ApiBadRequest("name the job the GPUs are for")
        try:
            cls = WorkloadClass(body.get("class") or spec.jobs.default_class)
        except ValueError:
            raise ApiBadRequest(f"unknown class {body.get('class')!r}") from None
        tenant = str(body.get("tenant") or spec.jobs.default_tenant or "")
        deadline = body.get("deadline")
        try:
            answer = self.ledger.ask(
                owner,
                want,
                priority=spec.classes[cls].priority,
                deadline=float(deadline) if isinstance(deadline, int | float) else None,
                fairness=self._fairness(tenant),
                workload_class=str(cls),
                node=self._node(),
                now=time.time(),
                claim_timeout=spec.gpu.claim_timeout,
            )
        except ValueError as e:
            raise ApiConflict(str(e)) from None
        if answer.status == "granted" and answer.hold is not None:
            audit_event(
                "gpu.granted", owner=owner, uuids=list(answer.hold.uuids), request=answer.id
            )
        return answer.to_json()

    def _status(self, request: Request) -> object:
        answer = self.ledger.status(request.query.get("id", ""), time.time())
        if answer is None:
            raise ApiNotFound(f"no GPU request {request.query.get('id', '')!r} (lapsed or unknown)")
        return answer.to_json()

    def _cancel(self, request: Request) -> object:
        self.ledger.cancel(str(request.body.get("id", "")))
        return {"cancelled": True}

    def _reserve(self, request: Request) -> object:
        self._refuse_in_kubernetes("nodeagent gpus reserve")
        body = request.body
        owner = str(body.get("name", ""))
        if not owner:
            raise ApiBadRequest("name the reservation (the container it is for)")
        ttl = body.get("ttl", 600)
        try:
            seconds = parse_duration(ttl)
        except ValueError as e:
            raise ApiBadRequest(f"ttl: {e}") from None
        want = _request(body)
        refuse_impossible(want, self._node())
        result = place(want, self._node(), holdings(self.ledger.holds()))
        if not isinstance(result, Placement):
            raise ApiConflict(f"no GPUs fit now: {result.reason}")
        hold = Hold(
            owner,
            "reservation",
            result.uuids,
            result.indices,
            (want.memory or 0) if want.shared else None,
            until=time.time() + seconds,
        )
        try:
            self.ledger.reserve(owner, hold)
        except ValueError as e:
            raise ApiConflict(str(e)) from None
        audit_event("gpu.reserved", owner=owner, uuids=list(hold.uuids), ttl=seconds)
        return {
            "name": owner,
            "uuids": list(hold.uuids),
            "indices": list(hold.indices),
            "score": result.score,
            "fraction": result.fraction,
            "until": hold.until,
        }

    def _unreserve(self, request: Request) -> object:
        owner = str(request.body.get("name", ""))
        hold = self.ledger.release(owner)
        if hold is None:
            raise ApiNotFound(f"no reservation named {owner!r}")
        audit_event(
            "gpu.released", owner=owner, uuids=list(hold.uuids), reason="released by request"
        )
        return {"released": owner}

    def _report(self, _: Request) -> object:
        state = self.state
        report = read_report(self.backend)
        holds = self.holds()
        found = violations(state) if state is not None else []
        for gpu in report["gpus"]:
            gpu["assigned"] = [
                {
                    "owner": h.owner,
                    "kind": h.kind,
                    "cgroup": h.cgroup,
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
        report["queue"] = [
            {
                "id": w.id,
                "owner": w.owner,
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
