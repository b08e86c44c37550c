"""The /v1/gpus routes: GPU requests (`nodeagent exec --gpus`), reservations, `gpus place`
and the `nodeagent gpus` report, over the daemon's GPU service (its ledger, its last GPU
state, its backend). The request bodies are here, as strict models; the ledger refuses with
nodeagent.errors' kinds, which the API server answers as HTTP statuses.

The reads (GET) answer on the API's threads from the service's frozen view (GpuView), which
the loop replaces whole; the handlers that change the ledger run on the loop's thread (the
daemon posts every POST and DELETE to it, nodeagent.commands) and publish a new view.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated

from pydantic import BeforeValidator, Field

from nodeagent.access import check_deadline, tenant_and_class
from nodeagent.api import answers
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
)
from nodeagent.api.server import Checked, Request, Routes
from nodeagent.errors import BadRequest, Conflict, NotFound
from nodeagent.gpu.model import GpuState
from nodeagent.gpu.report import read_report
from nodeagent.gpualloc.ledger import Answer, Reserved, holdings
from nodeagent.gpualloc.placement import GpuRequest, NodeGpus, Refusal, impossible
from nodeagent.gpualloc.placement.durations import declared_duration
from nodeagent.gpualloc.placing import BadQuestion, answer, from_query
from nodeagent.gpualloc.service import GpuService, bounds, node_of
from nodeagent.logs import audit_event
from nodeagent.policy.gpu_checks import violations
from nodeagent.policyfile.model import AgentMode, PolicySpec
from nodeagent.policyfile.units import parse_duration


def refuse_impossible(want: GpuRequest, node: NodeGpus) -> None:
    """A request this node could never satisfy is refused now, not left in the queue."""
    never = impossible(want, node)
    if never is not None:
        raise BadRequest(f"{never.reason}; the request can never be placed here")


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


class GpuRoutes:
    """The handlers of /v1/gpus over `gpus`; `spec` is the policy in force, `fairness` how
    far a tenant is ahead of its share (a waiting request's place among equal priorities
    and deadlines: lower first). The POST and DELETE handlers change the ledger, which has
    no lock: they run on the loop's thread (the daemon posts them there), one at a time."""

    def __init__(
        self,
        gpus: GpuService,
        spec: Callable[[], PolicySpec],
        fairness: Callable[[str], float],
    ) -> None:
        self._gpus = gpus
        self._spec = spec
        self._fairness = fairness

    def routes(self) -> Routes:
        """The handlers; those that change the ledger leave its view as it was: whoever
        serves them publishes a new one after each (Commands.serve's `then`)."""
        return {
            "/v1/gpus": {"GET": self._report},
            "/v1/gpus/requests": {
                "POST": Checked(AskBody, self._ask),
                "GET": self._status,
                "DELETE": Checked(IdBody, self._cancel),
            },
            "/v1/gpus/reservations": {
                "POST": Checked(ReserveBody, self._reserve),
                "DELETE": Checked(NameBody, self._unreserve),
            },
            "/v1/gpus/place": {"GET": self._place},
            "/v1/gpus/reservations/container": {"POST": Checked(AttachBody, self._attach)},
        }

    def _place(self, request: Request) -> answers.Placement:
        """`gpus place` against the holds as last published: read-only, nothing reserved."""
        view = self._gpus.view
        try:
            placed = answer(
                from_query(request.query),
                self._node(view.state),
                holdings(view.holds()),
                source=self._gpus.backend.source,
                simulated=self._gpus.backend.simulated,
                holds_considered=True,
            )
        except BadQuestion as e:
            raise BadRequest(str(e)) from None
        return answers.Placement.model_validate(placed)

    def _node(self, state: GpuState | None) -> NodeGpus:
        node = node_of(state)
        if node is None:
            why = self._gpus.backend.reason or "none read yet"
            raise NotFound(f"this node has no GPUs the agent can use ({why})")
        return node

    def _refuse_in_kubernetes(self, what: str) -> None:
        if self._spec().agent.mode is AgentMode.KUBERNETES:
            raise BadRequest(
                f"{what} is refused: agent.mode is kubernetes, where the kubelet's device"
                " plugin assigns GPUs; request nvidia.com/gpu in a pod spec instead"
            )

    def _ask(self, request: Request, body: AskBody) -> answers.GpuGrant:
        self._refuse_in_kubernetes("nodeagent exec --gpus")
        spec = self._spec()
        want = body.request()
        node = self._node(self._gpus.state)
        refuse_impossible(want, node)
        tenant, cls = tenant_and_class(spec, request.peer, body.tenant, body.workload_class)
        wall = time.time()
        check_future(body.deadline, wall)
        if body.deadline is not None:  # it orders the queue: granted as a job's is
            check_deadline(spec, request.peer, cls)
        due = None if body.deadline is None else body.deadline - wall
        answer = self._gpus.ledger.ask(
            body.name,
            want,
            uid=request.peer.uid,
            tenant=tenant,
            priority=spec.classes[cls].priority,
            deadline=body.deadline,
            fairness=self._fairness(tenant),
            workload_class=str(cls),
            node=node,
            now=time.monotonic(),
            claim_timeout=spec.gpu.claim_timeout,
            max_waiting=spec.gpu.max_waiting_per_user,
            declared=declared_duration(due, body.work, body.cpus),
            patience=spec.gpu.patience,
            bounds=bounds(spec.gpu),
            backfill=spec.gpu.backfill,
        )
        if answer.status == "granted" and answer.hold is not None:
            audit_event(
                "gpu.granted",
                owner=body.name,
                uid=request.peer.uid,
                uuids=list(answer.hold.uuids),
                request=answer.id,
            )
        return _grant(answer, self._gpus.ledger.reserved)

    def _status(self, request: Request) -> answers.GpuGrant:
        rid = request.query.get("id", "")
        view = self._gpus.view.ledger
        got = view.status(rid, request.peer.uid)
        if got.status == "waiting":  # its exec still waits: keep it in the queue
            self._gpus.seen(rid, time.monotonic())
        return _grant(got, view.reserved)

    def _cancel(self, request: Request, body: IdBody) -> answers.Cancelled:
        self._gpus.ledger.cancel(body.id, request.peer.uid)
        return answers.Cancelled(cancelled=True)

    def _reserve(self, request: Request, body: ReserveBody) -> answers.Reservation:
        self._refuse_in_kubernetes("nodeagent gpus reserve")
        want = body.request()
        node = self._node(self._gpus.state)
        refuse_impossible(want, node)
        spec = self._spec()
        tenant, cls = tenant_and_class(spec, request.peer, body.tenant, body.workload_class)
        now = time.monotonic()
        got = self._gpus.ledger.reserve(
            body.name,
            want,
            uid=request.peer.uid,
            tenant=tenant,
            workload_class=str(cls),
            container=body.container,
            node=node,
            now=now,
            until=now + body.ttl,
            bounds=bounds(spec.gpu),
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
        return answers.Reservation(
            name=hold.owner,
            uuids=list(hold.uuids),
            indices=list(hold.indices),
            score=result.score,
            fraction=result.fraction,
            until=time.time() + body.ttl,
            container=hold.container,
        )

    def _attach(self, request: Request, body: AttachBody) -> answers.Attached:
        hold = self._gpus.ledger.attach(body.name, request.peer.uid, body.container)
        audit_event("gpu.reservation_container", owner=hold.owner, container=hold.container)
        return answers.Attached(name=hold.owner, container=hold.container)

    def _unreserve(self, request: Request, body: NameBody) -> answers.Released:
        hold = self._gpus.ledger.release_reservation(body.name, request.peer.uid)
        audit_event(
            "gpu.released",
            owner=hold.owner,
            uid=request.peer.uid,
            uuids=list(hold.uuids),
            reason="released by request",
        )
        return answers.Released(released=hold.owner)

    def _report(self, request: Request) -> answers.GpuList:
        view = self._gpus.view
        state = view.state
        report = read_report(self._gpus.backend)
        holds = view.holds()
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
        head = view.ledger.reserved
        report["queue"] = [
            {
                # a request's id is shown to its asker and root only
                "id": w.id if uid in (0, w.uid) else None,
                "owner": w.owner,
                "uid": w.uid,
                "count": w.request.count,
                "class": w.workload_class,
                "reason": w.reason,
                **(_kept(head) if head is not None and head.request == w.id else {}),
            }
            for w in view.ledger.queue()
        ]
        return answers.GpuList.model_validate(report)


def _grant(answer: Answer, head: Reserved | None) -> answers.GpuGrant:
    """A request's answer; first in line, with when the GPUs kept for it are expected free."""
    body = answer.to_json()
    if head is not None and head.request == answer.id and answer.status == "waiting":
        body["expected_start"] = _kept(head)["expected_start"]
    return answers.GpuGrant.model_validate(body)


def _kept(head: Reserved) -> dict[str, object]:
    """The head of the queue's GPUs and expected start, on the wall clock."""
    start = None if head.start is None else time.time() + head.start - time.monotonic()
    return {"kept": list(head.indices), "expected_start": start}
