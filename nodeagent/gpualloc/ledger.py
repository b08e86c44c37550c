"""Who holds which GPUs, and who waits for some: the daemon's GPU assignments.

A request that fits now is granted at once, as a hold that lapses unless a job claims it
within `gpu.claim_timeout`; one that does not fit waits. Waiting requests are served in
order of their class's priority, then their deadline (earliest first, none last), then
fair share (the tenant that used least for its shares first), then arrival; one that
does not fit yet is passed over for later ones that do (backfill). A waiting request
that is not asked about for `STALE_AFTER` seconds (its `exec` died) is dropped.
Placement itself is the pure `placement.place`.

Every hold has an unguessable id and records who asked (uid), its tenant and class; its
name (a job's or a reservation's) is a label, unique among live holds and waiting
requests. Request ids are unguessable too, and only their asker (or root) may see,
cancel or claim them; a claim must come with the tenant and class the grant was for.
A job's hold is released by its id when that job ends; only reservations are released by
name, by the uid that made them or root. A reservation names its container; the daemon
binds it to that container's cgroup once discovery shows it and releases it when the
cgroup goes, or it lapses after its time to live.

Every uid but root is bounded (`UserBounds`, from the policy's gpu section): its
reservations and unclaimed grants together may number `max_holds_per_user`, and hold
`max_held_gpu_hours_per_user` GPU-hours ahead of use (each unbound one's GPUs times the
time it has left to live); and where the policy sets `max_gpus_per_user`, all its holds,
jobs' included, may hold that many GPUs at once. A reservation past any is refused, naming
the bound; a waiting request past any is not granted, and waits with the bound as its
reason, until one of the uid's holds is claimed, released or lapses (one that asks for more
GPUs than the last bound allows at all is refused when asked). A waiting request holds no
GPU: what bounds it is the count of them (`max_waiting`), and these bounds at its grant.

Durations: a request carries the duration its job declared (deadline, work and CPUs), or
its class's recent holds give one (placement.durations, kept here and in the state file); its
hold records when it is expected back. Placement sees those moments, and a request that
already waits may wait up to `gpu.patience` of its expected duration for a better set
expected free by then (placement).

The queue is served in full only when that can change its answer (a hold released or
lapsed, the GPUs changed, a request waiting for a better set): otherwise every waiting
request was tried against the holds as they are, and only a new request can fit. Times
are the monotonic clock's, so a step of the wall clock lapses nothing; the state file keeps
Unix times, converted at dump and load.

Only the loop's thread changes the ledger (the API's commands run there too), so it has no
lock: each tick's step is decided as a value (`decide`, on a copy) and made (`commit`), and
the API's reads answer from a frozen `LedgerView` the loop publishes after each change.
"""

from __future__ import annotations

import bisect
import secrets
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Annotated, Any

import structlog
from pydantic import Field, TypeAdapter, ValidationError

from nodeagent.api.bodies import (
    Body,
    CgroupPath,
    Container,
    GpuMemory,
    Instant,
    Name,
    Text,
    Token,
    Uid,
    problem,
)
from nodeagent.errors import Conflict, Forbidden, NotFound
from nodeagent.gpu.model import Hold, HoldKind
from nodeagent.gpualloc.placement import (
    GpuRequest,
    Holdings,
    NodeGpus,
    Placement,
    Refusal,
    durations,
    place,
)
from nodeagent.policyfile.model import Backfill, WorkloadClass

log = structlog.get_logger("nodeagent.gpu")

STALE_AFTER = 15.0


def new_id() -> str:
    return secrets.token_urlsafe(16)


QueueKey = tuple[int, float, float, float, str]
"""A waiting request's place in the queue (sorted ascending); it ends in its id."""


@dataclass(frozen=True, slots=True)
class Waiting:
    id: str
    owner: str
    uid: int
    tenant: str
    request: GpuRequest
    priority: int
    deadline: float | None
    fairness: float
    """Lower goes first: the tenant's decayed usage per share."""
    workload_class: str
    asked: float
    reason: str = ""
    expected: float | None = None
    """Seconds its job is expected to hold the GPUs; None: unknown."""
    held_back: float | None = None
    """When it first passed over a set to wait for a better one."""

    def key(self) -> QueueKey:
        """Its place in the queue (sorted ascending)."""
        deadline = self.deadline if self.deadline is not None else float("inf")
        return (-self.priority, deadline, self.fairness, self.asked, self.id)


@dataclass(frozen=True, slots=True)
class Answer:
    id: str
    status: str
    """'granted' or 'waiting'."""
    hold: Hold | None = None
    position: int | None = None
    reason: str = ""
    placement: Placement | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "status": self.status, "reason": self.reason}
        if self.hold is not None:
            out |= {"uuids": list(self.hold.uuids), "indices": list(self.hold.indices)}
        if self.position is not None:
            out["position"] = self.position
        if self.placement is not None:
            out |= {"score": self.placement.score, "fraction": self.placement.fraction}
        return out


Queued = tuple[QueueKey, Waiting]
"""A waiting request in the queue, after its key."""


@dataclass(frozen=True, slots=True)
class Reserved:
    """GPUs kept for the head of the queue (EASY backfill): the first waiting request that
    fits nowhere now is promised the set it will get at its earliest expected start (when
    the holds in its way are expected back), and a later request may take any of those GPUs
    only if it is expected to give them back by then. Without that, a stream of small
    requests that each fit would backfill in front of a big one forever."""

    request: str
    """The head's request id."""
    key: QueueKey
    """Its place in the queue: a request placed before it is served first."""
    owner: str
    uid: int
    uuids: tuple[str, ...]
    indices: tuple[int, ...]
    start: float | None
    """When the set is expected free (monotonic clock); None: a hold in its way has no
    expected end (no declared duration, no history of its class), or runs past it."""
    waits_for: tuple[str, ...]
    """The holders whose holds are in its way, by name."""


def waiting_answer(w: Waiting, position: int) -> Answer:
    return Answer(w.id, "waiting", position=position, reason=w.reason)


def check_uid(rid: str, uid: int, owner: int) -> None:
    if not _mine(uid, owner):
        raise Forbidden(f"GPU request {rid!r} belongs to uid {owner}")


@dataclass(frozen=True)
class LedgerView:
    """The ledger as the loop last published it (`GpuLedger.view`): what the API's reads
    answer from, on their own threads, while the loop goes on changing the ledger. Its
    tuples and map are its own, which nothing changes once it is made (so that making one
    after each command costs a copy of the queue, not of an index by request id: that is
    made on the first status read of the view)."""

    holds: tuple[Hold, ...]
    queued: tuple[Queued, ...]
    """The queue, in order."""
    granted: Mapping[str, Answer]
    """By request id."""
    reserved: Reserved | None = None
    """The GPUs kept for the head of the queue."""

    @cached_property
    def _positions(self) -> dict[str, int]:
        return {w.id: i for i, (_, w) in enumerate(self.queued)}

    def queue(self) -> list[Waiting]:
        return [w for _, w in self.queued]

    def status(self, rid: str, uid: int) -> Answer:
        """What request `rid` has, for its asker (or root) only."""
        if rid in self.granted:
            answer = self.granted[rid]
            assert answer.hold is not None, "a grant holds GPUs"
            check_uid(rid, uid, answer.hold.uid)
            return answer
        i = self._positions.get(rid)
        if i is None:
            raise NotFound(f"no GPU request {rid!r} (lapsed or unknown)")
        w = self.queued[i][1]
        check_uid(rid, uid, w.uid)
        return waiting_answer(w, i + 1)


EMPTY_VIEW = LedgerView((), (), {})
"""An empty ledger's view."""


@dataclass(frozen=True, slots=True)
class LedgerChanges:
    """One step of the loop for the ledger, decided (`GpuLedger.decide`) and not yet made
    (`GpuLedger.commit`): what it binds, drops, lapses, forgets and grants."""

    bound: tuple[tuple[Hold, str], ...]
    """Reservations that follow their workload now: each with its cgroup."""
    dropped: tuple[Hold, ...]
    """Reservations whose workload is gone."""
    lapsed: tuple[Hold, ...]
    """Holds not claimed (or reservations not bound) in time."""
    granted: tuple[Answer, ...]
    """Waiting requests granted, by request id, each with its new hold."""
    forgotten: tuple[str, ...]
    """Waiting requests nobody asked about for STALE_AFTER."""
    settled: tuple[str, ...]
    """Grants whose hold is gone (claimed, released or lapsed)."""
    waiting: tuple[Waiting, ...]
    """Waiting requests with a new reason or time held back."""
    asked: Mapping[str, float]
    """Waiting requests asked about: request id -> when."""
    holds: tuple[Hold, ...]
    """The ledger's holds once the step is made."""
    bounds: UserBounds
    served: NodeGpus | None
    stale: bool
    freed: int
    """The ledger's count of frees when decided."""
    reserved: Reserved | None = None
    """The head of the queue's GPUs, as the step leaves them."""
    backfill: Backfill = Backfill.RESERVE


def closest_cpus(node: NodeGpus, indices: Iterable[int]) -> tuple[int, ...]:
    wanted = set(indices)
    return tuple(sorted({c for d in node.devices if d.index in wanted for c in d.cpus}))


def holdings(holds: Iterable[Hold], now: float | None = None) -> Holdings:
    """What the holds take; with `now`, also when each held GPU is expected back."""
    exclusive: set[str] = set()
    shared: dict[str, int] = {}
    listed = tuple(holds)
    for h in listed:
        if h.shared_memory is None:
            exclusive.update(h.uuids)
        else:
            for u in h.uuids:
                shared[u] = shared.get(u, 0) + h.shared_memory
    if now is None:
        return Holdings(frozenset(exclusive), shared)
    back = durations.releases(
        (h.uuids, None if h.expected_end is None else h.expected_end - now) for h in listed
    )
    return Holdings(frozenset(exclusive), shared, back)


def _mine(uid: int, owner: int) -> bool:
    return uid in (0, owner)


@dataclass(frozen=True, slots=True)
class UserBounds:
    """What one uid other than root may hold: that no job uses yet, a count and GPU-hours
    ahead of use (gpu.max_holds_per_user, gpu.max_held_gpu_hours_per_user); and GPUs at
    once, in use or not (gpu.max_gpus_per_user)."""

    holds: int = 1 << 30
    gpu_hours: float = float("inf")
    gpus: int = 1 << 30

    def never_granted(self, uid: int, gpus: int) -> bool:
        """Whether one hold of `gpus` GPUs is more than `uid` may hold at once at all, so
        that nothing it releases makes room for it (root is not bounded)."""
        return uid != 0 and gpus > self.gpus


UNBOUNDED = UserBounds()


def gpu_hours_ahead(hold: Hold, now: float) -> float:
    """GPU-hours an unused hold keeps from others from now on: its GPUs times the time it
    has left to live; a job's, or a reservation bound to its workload (in use), none."""
    if hold.until is None or hold.kind is HoldKind.JOB:
        return 0.0
    return len(hold.uuids) * max(hold.until - now, 0.0) / 3600.0


class HoldRecord(Body):
    """A hold as the state file keeps it: checked field by field when restored."""

    owner: Name
    kind: Annotated[HoldKind, Field(strict=False)]
    uuids: Annotated[list[Text], Field(min_length=1, max_length=64)]
    indices: Annotated[list[Annotated[int, Field(ge=0, le=1023)]], Field(max_length=64)]
    shared_memory: GpuMemory | None = None
    cgroup: CgroupPath | None = None
    workload_class: Annotated[WorkloadClass, Field(strict=False)] | None = None
    until: Instant | None = None
    """Unix time."""
    cpus: Annotated[list[Annotated[int, Field(ge=0, le=1 << 20)]], Field(max_length=1 << 16)] = (
        Field(default_factory=list)
    )
    id: Token | None = None
    """Absent in files written before holds had ids: one is made."""
    uid: Uid = 0
    tenant: Text | None = None
    container: Container | None = None
    since: Instant | None = None
    """Unix time."""
    expected_end: Instant | None = None
    """Unix time."""
    named_by: Uid | None = None


_Seconds = Annotated[float, Field(gt=0, le=10 * 365 * 86400)]
_HISTORY = TypeAdapter(
    dict[
        Annotated[WorkloadClass, Field(strict=False)],
        Annotated[list[_Seconds], Field(max_length=durations.HISTORY)],
    ]
)
"""The classes' hold durations as the state file keeps them."""


class GpuLedger:
    def __init__(self) -> None:
        self._holds: dict[str, Hold] = {}
        """By hold id."""
        self._waiting: dict[str, Waiting] = {}
        """By request id."""
        self._order: list[Queued] = []
        """The waiting requests after their keys, sorted: the queue."""
        self._seen: dict[str, float] = {}
        """By request id: when each waiting request was last asked about (asked, or by its
        asker's status call)."""
        self._waiting_names: dict[str, str] = {}
        self._waiting_uids: Counter[int] = Counter()
        self._granted: dict[str, Answer] = {}
        """By request id: what a claim takes (the answer's hold id must still be held)."""
        self._stale = True
        """Something was freed (or the GPUs changed) since the whole queue was last tried."""
        self._served: NodeGpus | None = None
        self._history: dict[str, list[float]] = {}
        """Per class: how long its last jobs held their GPUs, oldest first."""
        self._bounds = UNBOUNDED
        """Each uid's but root's, as the last ask or step was given them."""
        self._freed = 0
        """How many times something was freed: a step worked out before a free (`decide`)
        is committed with the queue still to serve again."""
        self._nothing: LedgerChanges | None = None
        """The last step that changed nothing (`_unchanged`)."""
        self._reserved: Reserved | None = None
        """The head of the queue's GPUs (`Reserved`), worked out at each full serve."""
        self._backfill = Backfill.RESERVE
        """gpu.backfill, as the last ask or step was given it."""

    # --- asking -----------------------------------------------------------------------

    def ask(
        self,
        owner: str,
        request: GpuRequest,
        *,
        uid: int,
        tenant: str,
        priority: int,
        deadline: float | None,
        fairness: float,
        workload_class: str,
        node: NodeGpus,
        now: float,
        claim_timeout: float,
        max_waiting: int,
        declared: float | None = None,
        patience: float = durations.PATIENCE,
        bounds: UserBounds = UNBOUNDED,
        backfill: Backfill = Backfill.RESERVE,
    ) -> Answer:
        """A request for GPUs: granted now if a set fits, else waiting. `declared`: what its
        job declared of its duration (else its class's recent holds say); `patience`:
        gpu.patience, for it and the others waiting; `bounds`: each uid's (root has none);
        `backfill`: gpu.backfill."""
        self._bounds = bounds
        if backfill is not self._backfill:
            self._backfill, self._stale = backfill, True
        self._check_name(owner)
        if bounds.never_granted(uid, request.count):
            raise Conflict(
                f"request {owner!r} asks for {request.count} GPUs; one uid may hold"
                f" {bounds.gpus} at once (gpu.max_gpus_per_user), so it could never be"
                " granted"
            )
        if uid != 0 and self._waiting_uids[uid] >= max_waiting:
            raise Conflict(
                f"uid {uid} has {self._waiting_uids[uid]} GPU requests waiting, the most"
                " gpu.max_waiting_per_user allows; cancel one or wait"
            )
        rid = new_id()
        expected = durations.expected_duration(declared, self._history.get(workload_class, []))
        w = Waiting(
            rid, owner, uid, tenant, request, priority, deadline, fairness,
            workload_class, now, expected=expected,
        )  # fmt: skip
        self._add(w)
        ahead = self._reserved is not None and w.key() < self._reserved.key
        if self._stale or node != self._served or ahead:  # ahead: the head may change
            self._serve(node, now, claim_timeout, patience)
        else:  # every other waiter was tried against these holds: only this one can fit
            self._try([w], node, now, claim_timeout, patience)
        answer = self._answer(rid)
        assert answer is not None, "just asked: granted or waiting"
        return answer

    def cancel(self, rid: str, uid: int) -> None:
        w = self._waiting.get(rid)
        if w is not None:
            check_uid(rid, uid, w.uid)
            self._drop(rid)
            return
        answer = self._granted.get(rid)
        if answer is None or answer.hold is None:
            raise NotFound(f"no GPU request {rid!r} (lapsed or unknown)")
        check_uid(rid, uid, answer.hold.uid)
        del self._granted[rid]
        held = self._holds.get(answer.hold.id)
        if held is not None and held.kind is HoldKind.REQUEST:
            self._pop(held.id)

    def claim(
        self, rid: str, *, uid: int, owner: str, cgroup: str, tenant: str, workload_class: str
    ) -> Hold:
        """A job takes the GPUs granted to its request; they are its own until it ends."""
        answer = self._granted.get(rid)
        held = None if answer is None or answer.hold is None else answer.hold
        if held is None or self._holds.get(held.id) != held:
            raise NotFound(f"no GPUs are granted to request {rid!r} (lapsed or unknown)")
        check_uid(rid, uid, held.uid)
        if (held.tenant, held.workload_class) != (tenant, workload_class):
            raise Conflict(
                f"GPU request {rid!r} was granted for tenant {held.tenant!r} and class"
                f" {held.workload_class}; the job asks for tenant {tenant!r} and class"
                f" {workload_class}"
            )
        if owner != held.owner:
            self._check_name(owner)
        del self._granted[rid]
        hold = replace(held, owner=owner, kind=HoldKind.JOB, cgroup=cgroup, until=None, uid=uid)
        self._holds[hold.id] = hold
        self._free()  # a request its uid's bounds held back may be granted now
        return hold

    def reserve(
        self,
        owner: str,
        request: GpuRequest,
        *,
        uid: int,
        tenant: str,
        workload_class: str,
        container: str | None,
        node: NodeGpus,
        now: float,
        until: float,
        bounds: UserBounds = UNBOUNDED,
    ) -> tuple[Hold, Placement] | Refusal:
        """Place and hold GPUs for a container, in one step (two callers never get the same
        GPUs), around those kept for the head of the queue (a reservation is bound to run
        for as long as its container does); a Refusal when none fit now, Conflict past the
        uid's `bounds` (root has none)."""
        self._check_name(owner)
        hours = request.count * max(until - now, 0.0) / 3600.0
        over = self._over(uid, request.count, hours, now, bounds)
        if over is not None:
            raise Conflict(f"reservation {owner!r} refused: {over}")
        result = _placed(request, node, holdings(self._holds.values()), self._reserved)
        if isinstance(result, Refusal):
            return result
        hold = Hold(
            owner,
            HoldKind.RESERVATION,
            result.uuids,
            result.indices,
            (request.memory or 0) if request.shared else None,
            workload_class=workload_class,
            until=until,
            cpus=closest_cpus(node, result.indices),
            id=new_id(),
            uid=uid,
            tenant=tenant,
            container=container,
            named_by=None if container is None else uid,
        )
        self._holds[hold.id] = hold
        return hold, result

    def attach(self, owner: str, uid: int, container: str) -> Hold:
        """Name the container of a reservation made without one (its id known only once the
        runtime created it). Named by root (the operator), it may bind to a workload of any
        owner; named by its uid, only to one of that uid's (GpuService)."""
        hold = self._reservation(owner, uid)
        if hold.cgroup is not None:
            raise Conflict(f"reservation {owner!r} is bound to {hold.cgroup} already")
        hold = replace(hold, container=container, named_by=uid)
        self._holds[hold.id] = hold
        return hold

    # --- releasing --------------------------------------------------------------------

    def release_reservation(self, owner: str, uid: int) -> Hold:
        return self._pop(self._reservation(owner, uid).id)

    def release_job(self, hold_id: str, uid: int, now: float | None = None) -> Hold | None:
        """A job's end: exactly its own hold, never another kind or another uid's. With
        `now`, how long it held the GPUs joins its class's history."""
        hold = self._holds.get(hold_id)
        if hold is None or hold.kind is not HoldKind.JOB or hold.uid != uid:
            return None
        if now is not None and hold.since is not None and hold.workload_class is not None:
            recent = self._history.setdefault(hold.workload_class, [])
            recent.append(max(now - hold.since, 1e-3))
            del recent[: -durations.HISTORY]
        return self._pop(hold_id)

    # --- the loop ---------------------------------------------------------------------

    def decide(
        self,
        node: NodeGpus | None,
        now: float,
        claim_timeout: float,
        patience: float = durations.PATIENCE,
        bounds: UserBounds = UNBOUNDED,
        *,
        bind: Iterable[tuple[Hold, str]] = (),
        drop: Iterable[Hold] = (),
        asked: Mapping[str, float] | None = None,
        backfill: Backfill = Backfill.RESERVE,
    ) -> LedgerChanges:
        """One step of the loop as a value, the ledger left as it is (`commit` makes it
        so). First reservations follow the workloads they name (`bind`: each with its
        cgroup), those whose workload is gone go (`drop`), and the waiting requests asked
        about since the last step (`asked`: request id -> when) are kept; then unclaimed
        holds lapse, waiters nobody asks about are dropped, and the queue is served if that
        can change anything. Worked out on a copy, so that each grant sees those before."""
        bind, drop = tuple(bind), tuple(drop)
        if not (self._holds or self._waiting or self._granted) and bounds == self._bounds:
            return self._unchanged()  # the usual node's step: nothing held, nothing asked
        scratch = self._copy()
        for hold, cgroup in bind:
            scratch._bind(hold.id, cgroup)
        for hold in drop:
            if hold.id in scratch._holds:
                scratch._pop(hold.id)
        asked = {r: t for r, t in (asked or {}).items() if r in scratch._seen}
        scratch._seen.update(asked)
        if bounds != scratch._bounds:  # a reload changed them: who may be granted changed
            scratch._bounds = bounds
            scratch._free()
        if backfill is not scratch._backfill:  # a reload changed it: served anew under it
            scratch._backfill, scratch._stale = backfill, True
        lapsed = [h for h in scratch._holds.values() if h.until is not None and h.until <= now]
        for h in lapsed:
            scratch._pop(h.id)
        for rid in [r for r, t in scratch._seen.items() if now - t > STALE_AFTER]:
            scratch._drop(rid)
        held = scratch._holds
        for rid in [r for r, a in scratch._granted.items() if a.hold and a.hold.id not in held]:
            del scratch._granted[rid]
        head = scratch._reserved
        if head is not None and head.start is not None and now >= head.start:
            scratch._stale = True  # a hold in its way runs late: its start is worked out anew
        if node is not None and scratch._waiting and (scratch._stale or node != scratch._served):
            scratch._serve(node, now, claim_timeout, patience)
        return LedgerChanges(
            bound=tuple((h, c) for h, c in bind if h.id in self._holds),
            dropped=tuple(h for h in drop if h.id in self._holds),
            lapsed=tuple(lapsed),
            granted=tuple(a for r, a in scratch._granted.items() if r not in self._granted),
            forgotten=tuple(
                r for r in self._waiting if r not in scratch._waiting and r not in scratch._granted
            ),
            settled=tuple(r for r in self._granted if r not in scratch._granted),
            waiting=tuple(w for r, w in scratch._waiting.items() if self._waiting.get(r) is not w),
            holds=tuple(scratch._holds.values()),
            bounds=scratch._bounds,
            served=scratch._served,
            stale=scratch._stale,
            freed=self._freed,
            asked=asked,
            reserved=scratch._reserved,
            backfill=scratch._backfill,
        )

    def commit(self, changes: LedgerChanges) -> None:
        """Make a step that `decide` worked out so. Only the loop changes the ledger, and
        nothing it does between the two adds a hold: no GPU it grants was taken since; a
        hold freed since (a job that ended) leaves the queue to serve again next step."""
        freed_since = self._freed != changes.freed
        if changes is self._nothing and not freed_since:
            return  # decided on this ledger as it is, and nothing to change
        for hold, cgroup in changes.bound:
            self._bind(hold.id, cgroup)
        for h in (*changes.dropped, *changes.lapsed):
            if h.id in self._holds:
                self._pop(h.id)
        for rid in changes.forgotten:
            if rid in self._waiting:
                self._drop(rid)
        for rid in changes.settled:
            self._granted.pop(rid, None)
        self._seen.update({r: t for r, t in changes.asked.items() if r in self._seen})
        for w in changes.waiting:
            if w.id in self._waiting:
                self._update(w)
        for a in changes.granted:
            assert a.hold is not None, "a grant holds GPUs"
            if a.id in self._waiting:
                self._drop(a.id)
            self._holds[a.hold.id] = a.hold
            self._granted[a.id] = a
        self._bounds, self._served = changes.bounds, changes.served
        self._stale = changes.stale or freed_since
        head = changes.reserved
        self._reserved = head if head is None or head.request in self._waiting else None
        self._backfill = changes.backfill

    def view(self) -> LedgerView:
        """The ledger as it is now, for the API's reads on their own threads: the view's
        own copies, which nothing changes."""
        if not (self._holds or self._order or self._granted):
            return EMPTY_VIEW  # most nodes' ledger, at every tick: the same view
        return LedgerView(
            tuple(self._holds.values()), tuple(self._order), dict(self._granted), self._reserved,
        )  # fmt: skip

    def holds(self) -> tuple[Hold, ...]:
        return tuple(self._holds.values())

    @property
    def reserved(self) -> Reserved | None:
        """The GPUs kept for the head of the queue, if any (`Reserved`)."""
        return self._reserved

    def queue(self) -> list[Waiting]:
        return [w for _, w in self._order]

    # --- the state file ---------------------------------------------------------------

    def dump(self, now: float, wall: float) -> list[dict[str, Any]]:
        """Jobs' and reservations' holds, with Unix times (`now` is the monotonic clock
        read at `wall`)."""
        holds = [h for h in self._holds.values() if h.kind is not HoldKind.REQUEST]
        out = []
        for h in holds:
            record = {
                "owner": h.owner,
                "kind": str(h.kind),
                "uuids": list(h.uuids),
                "indices": list(h.indices),
                "shared_memory": h.shared_memory,
                "cgroup": h.cgroup,
                "workload_class": h.workload_class,
                "until": None if h.until is None else h.until - now + wall,
                "cpus": list(h.cpus),
                "id": h.id,
                "uid": h.uid,
                "tenant": h.tenant,
                "container": h.container,
                "since": None if h.since is None else h.since - now + wall,
                "expected_end": None if h.expected_end is None else h.expected_end - now + wall,
                "named_by": h.named_by,
            }
            out.append(record)
        return out

    def history(self) -> dict[str, list[float]]:
        """Per class, how long its last jobs held their GPUs (for the state file)."""
        return {c: list(v) for c, v in self._history.items()}

    def load_history(self, saved: Mapping[str, Any]) -> None:
        """Restore the classes' hold durations; a malformed history is dropped with a
        warning (estimates then start again from the next jobs)."""
        try:
            checked = _HISTORY.validate_python(saved)
        except ValidationError as e:
            log.warning("state.gpu_history_dropped", error=problem(e))
            return
        self._history = {str(c): list(v) for c, v in checked.items()}

    def load(
        self,
        records: Iterable[Mapping[str, Any]],
        keep: Callable[[Hold], Hold | None],
        now: float,
        wall: float,
    ) -> None:
        """Restore saved holds one by one: a malformed record is dropped with a warning;
        `keep` says which still have their job (or are reservations), and may amend them.
        A record that conflicts with one restored before it (`_restorable`) is refused."""
        for i, r in enumerate(records):
            try:
                record = HoldRecord.model_validate(r)
            except ValidationError as e:
                log.warning("state.hold_dropped", record=i, error=problem(e))
                continue
            if record.kind is HoldKind.REQUEST:
                continue  # a grant's hold dies with the daemon: its exec asks again
            hold = Hold(
                owner=record.owner,
                kind=record.kind,
                uuids=tuple(record.uuids),
                indices=tuple(record.indices),
                shared_memory=record.shared_memory,
                cgroup=record.cgroup,
                workload_class=None
                if record.workload_class is None
                else str(record.workload_class),
                until=None if record.until is None else record.until - wall + now,
                cpus=tuple(record.cpus),
                id=record.id or new_id(),
                uid=record.uid,
                tenant=record.tenant,
                container=record.container,
                since=None if record.since is None else record.since - wall + now,
                expected_end=None
                if record.expected_end is None
                else record.expected_end - wall + now,
                named_by=record.named_by,
            )
            kept = keep(hold)
            if kept is None:
                continue
            if self._holds.get(kept.id) == kept:
                log.warning("state.hold_duplicate", record=i, owner=kept.owner, id=kept.id,
                            action="restored once")  # fmt: skip
                continue
            restorable = self._restorable(kept)
            if isinstance(restorable, str):
                log.error("state.hold_dropped", record=i, owner=kept.owner, id=kept.id,
                          kind=str(kept.kind), uuids=list(kept.uuids), error=restorable,
                          action="its GPUs are not held for it: free them, or reserve"
                          " them again")  # fmt: skip
                continue
            if restorable.id != kept.id:
                log.warning("state.hold_renamed", record=i, owner=kept.owner, was=kept.id,
                            id=restorable.id, error="its id is another hold's")  # fmt: skip
            self._holds[restorable.id] = restorable

    # --- inside the lock --------------------------------------------------------------

    def _restorable(self, hold: Hold) -> Hold | str:
        """A saved hold as it may be restored beside the holds restored before it, or why
        it may not (the same hold twice is restored once, before this). Only a corrupt or
        hand-edited file gets here; what is safe decides:
        - GPUs another hold has (an exclusive hold beside any other on a GPU): refused,
          whatever its id and name, so that no GPU is held twice; the first keeps them;
        - a name taken: refused, as a new hold with it would be (a reservation is released
          and attached by name: two of one name would answer for each other);
        - an id taken by another hold: a job's hold is refused (its job releases its GPUs
          by that id, which is the other hold's); a reservation, which is released by name
          and dropped by the daemon by the id it reads here, is kept under a new id.
        A refused hold's GPUs are free for others: refusing is what keeps the ledger's
        promise (a GPU granted once), and its line says which GPUs its workload may still
        be using."""
        other = self._holds.get(hold.id)
        holder: dict[str, Hold] = {}  # each GPU's first holder, which the line names
        for h in self._holds.values():
            for u in h.uuids:
                holder.setdefault(u, h)
        clash = sorted(
            u for u in hold.uuids
            if u in holder and (hold.shared_memory is None or holder[u].shared_memory is None)
        )  # fmt: skip
        if clash:
            return f"GPUs {', '.join(clash)} are held by {holder[clash[0]].owner!r} already"
        if self._name_taken(hold.owner):
            return f"its name {hold.owner!r} is another hold's"
        if other is None:
            return hold
        if hold.kind is not HoldKind.RESERVATION:
            return f"its id is the hold of {other.owner!r}, which its job would release"
        return replace(hold, id=new_id())

    def _over(
        self, uid: int, gpus: int, hours: float, now: float, bounds: UserBounds
    ) -> str | None:
        """Why one more hold of `gpus` GPUs and `hours` GPU-hours ahead would take `uid` past
        its bounds; None if it would not (root is not bounded)."""
        if uid == 0:
            return None
        held = sum(len(h.uuids) for h in self._holds.values() if h.uid == uid)
        if bounds.never_granted(uid, gpus):
            return (
                f"{gpus} GPUs are more than gpu.max_gpus_per_user ({bounds.gpus}) lets one uid"
                " hold at once; ask for fewer"
            )
        if held + gpus > bounds.gpus:
            return (
                f"uid {uid} holds {held} GPUs (jobs, reservations and grants); {gpus} more"
                f" would pass gpu.max_gpus_per_user ({bounds.gpus}); release one or wait"
                " for a job to end"
            )
        mine = [h for h in self._holds.values() if h.uid == uid and h.kind is not HoldKind.JOB]
        if len(mine) >= bounds.holds:
            return (
                f"uid {uid} holds {len(mine)} reservations and unclaimed grants, the most"
                " gpu.max_holds_per_user allows; release one"
            )
        # to a millionth of a GPU-hour: `until - now` of two epoch times carries float error
        # (a 1-day reservation at the 24 GPU-hour bound came to 24.00000000007 and was refused)
        ahead = round(sum(gpu_hours_ahead(h, now) for h in mine) + hours, 6)
        if ahead > bounds.gpu_hours:
            return (
                f"uid {uid} would hold {ahead:.1f} GPU-hours ahead of use, more than"
                f" gpu.max_held_gpu_hours_per_user ({bounds.gpu_hours:g}) allows; ask for fewer"
                " GPUs or a shorter time to live, or release a reservation"
            )
        return None

    def _name_taken(self, owner: str) -> bool:
        return owner in self._waiting_names or any(h.owner == owner for h in self._holds.values())

    def _check_name(self, owner: str) -> None:
        if self._name_taken(owner):
            raise Conflict(f"the name {owner!r} is taken by another GPU hold or request")

    def _reservation(self, owner: str, uid: int) -> Hold:
        hold = next((h for h in self._holds.values() if h.owner == owner), None)
        if hold is None:
            raise NotFound(f"no reservation named {owner!r}")
        if hold.kind is not HoldKind.RESERVATION:
            raise Conflict(
                f"{owner!r} is not a reservation but a {hold.kind}'s GPUs, which go back when"
                " it ends; only reservations are released by name"
            )
        if not _mine(uid, hold.uid):
            raise Forbidden(f"reservation {owner!r} belongs to uid {hold.uid}")
        return hold

    def _free(self) -> None:
        self._stale = True
        self._freed += 1

    def _pop(self, hold_id: str) -> Hold:
        self._free()
        return self._holds.pop(hold_id)

    def _bind(self, hold_id: str, cgroup: str) -> None:
        h = self._holds.get(hold_id)
        if h is not None and h.cgroup is None:
            self._holds[hold_id] = replace(h, cgroup=cgroup, until=None)

    def _unchanged(self) -> LedgerChanges:
        """A step that changes nothing: an empty ledger's, whose bounds are in force. The
        same object while the ledger stays as it is (most nodes' every step), which
        `commit` knows it need not look into."""
        was = self._nothing
        if was is not None and (was.bounds, was.served, was.stale, was.freed) == (
            self._bounds, self._served, self._stale, self._freed,
        ):  # fmt: skip
            return was
        self._nothing = LedgerChanges(
            bound=(), dropped=(), lapsed=(), granted=(), forgotten=(), settled=(), waiting=(),
            asked={}, holds=(), bounds=self._bounds, served=self._served, stale=self._stale,
            freed=self._freed, reserved=None, backfill=self._backfill,
        )  # fmt: skip
        return self._nothing

    def _copy(self) -> GpuLedger:
        """A copy to work a step out on: its own maps (the holds, requests and answers in
        them are frozen), and the history, which a step never changes, shared."""
        c = GpuLedger()
        c._holds, c._waiting, c._order = dict(self._holds), dict(self._waiting), list(self._order)
        c._waiting_names, c._waiting_uids = dict(self._waiting_names), Counter(self._waiting_uids)
        c._seen = dict(self._seen)
        c._granted, c._history, c._bounds = dict(self._granted), self._history, self._bounds
        c._stale, c._served, c._freed = self._stale, self._served, self._freed
        c._reserved, c._backfill = self._reserved, self._backfill
        return c

    def _add(self, w: Waiting) -> None:
        self._waiting[w.id] = w
        self._seen[w.id] = w.asked
        self._waiting_names[w.owner] = w.id
        self._waiting_uids[w.uid] += 1
        bisect.insort(self._order, (w.key(), w))

    def _drop(self, rid: str) -> Waiting:
        if self._reserved is not None and self._reserved.request == rid:
            self._reserved = None  # its GPUs are free for the next head
            self._stale = True
        w = self._waiting.pop(rid)
        del self._seen[rid]
        del self._waiting_names[w.owner]
        self._waiting_uids[w.uid] -= 1
        if not self._waiting_uids[w.uid]:
            del self._waiting_uids[w.uid]
        del self._order[self._place_of(w)]
        return w

    def _serve(self, node: NodeGpus, now: float, claim_timeout: float, patience: float) -> None:
        self._stale, self._served, self._reserved = False, node, None
        self._try(self.queue(), node, now, claim_timeout, patience)

    def _try(
        self, waiting: list[Waiting], node: NodeGpus, now: float, timeout: float, patience: float
    ) -> None:
        """Grant what fits, in queue order; a request shaped like one refused since the last
        grant is refused for the same reason without placing it again. One that passes a
        set over for a better one keeps the queue stale: it is tried again next step, with
        less patience left. The first that fits nowhere has GPUs kept for it (`Reserved`):
        those behind it are placed around them, or on them only when expected to give them
        back before its start."""
        held = holdings(self._holds.values(), now)
        refused: dict[tuple[GpuRequest, bool], Refusal] = {}
        for w in waiting:
            hours = w.request.count * timeout / 3600.0
            over = self._over(w.uid, w.request.count, hours, now, self._bounds)
            if over is not None:  # its uid's own bound: others' requests of its shape may fit
                if w.reason != over:
                    self._update(replace(w, reason=over))
                continue
            request = self._told(w, now, patience)
            head = self._reserved
            around = None  # the head's GPUs, where `w` must leave them alone
            if head is not None and head.request != w.id and not _gives_back_by(w, head, now):
                around = head
            cached = refused.get((request, around is not None))
            result = cached or _placed(request, node, held, around)
            if isinstance(result, Placement):
                self._grant(w, result, node, now, now + timeout)
                held = holdings(self._holds.values(), now)
                refused.clear()
                continue
            refused[request, around is not None] = result
            if result.better_in is not None:
                self._stale = True  # nothing freed: tried again at the next step
            elif head is None and self._backfill is Backfill.RESERVE and _reservable(w.request):
                head = self._reserved = self._reserve(w, node, now)
                if head is not None:
                    result = Refusal(f"{result.reason}; {_kept_for(head)}")
            held_back = now if result.better_in is not None and w.held_back is None else w.held_back
            if (w.reason, w.held_back) != (result.reason, held_back):
                self._update(replace(w, reason=result.reason, held_back=held_back))

    def _reserve(self, w: Waiting, node: NodeGpus, now: float) -> Reserved | None:
        """The set `w` would get at its earliest expected start: at each moment a hold is
        expected back (in order), the set that fits once those holds are gone; past every
        known moment, the one that fits with every hold gone (its start then unknown). None
        where even that does not fit (busy GPUs no hold covers, MIG, memory in use)."""
        request = replace(w.request, expected_duration=None, patience=0.0)
        holds = list(self._holds.values())
        moments = sorted({h.expected_end for h in holds if h.expected_end and h.expected_end > now})
        for start in (*moments, None):
            back = [h for h in holds if _back_by(h, start)]
            kept = [h for h in holds if not _back_by(h, start)]
            result = place(request, _freed_memory(node, back), holdings(kept))
            if isinstance(result, Placement):
                taken = set(result.uuids)
                waits = sorted({h.owner for h in back if taken & set(h.uuids)})
                return Reserved(
                    w.id, w.key(), w.owner, w.uid, result.uuids, result.indices, start,
                    tuple(waits),
                )  # fmt: skip
        return None

    @staticmethod
    def _told(w: Waiting, now: float, patience: float) -> GpuRequest:
        """The request as placement gets it: its expected duration, and for one that already
        waited (asked before now) its patience left."""
        waited = 0.0 if w.held_back is None else now - w.held_back
        left = durations.patience(patience, w.expected, waited) if w.asked < now else 0.0
        return replace(w.request, expected_duration=w.expected, patience=left)

    def _grant(
        self, w: Waiting, result: Placement, node: NodeGpus, now: float, until: float
    ) -> None:
        hold = Hold(
            owner=w.owner,
            kind=HoldKind.REQUEST,
            uuids=result.uuids,
            indices=result.indices,
            shared_memory=(w.request.memory or 0) if w.request.shared else None,
            workload_class=w.workload_class,
            until=until,
            cpus=closest_cpus(node, result.indices),
            id=new_id(),
            uid=w.uid,
            tenant=w.tenant,
            since=now,
            expected_end=None if w.expected is None else now + w.expected,
        )
        self._drop(w.id)
        self._holds[hold.id] = hold
        self._granted[w.id] = Answer(w.id, "granted", hold, placement=result)

    def _answer(self, rid: str) -> Answer | None:
        if rid in self._granted:
            return self._granted[rid]
        w = self._waiting.get(rid)
        return None if w is None else waiting_answer(w, self._place_of(w) + 1)

    def _place_of(self, w: Waiting) -> int:
        """Where `w` is in the queue (its key is unique: it ends in its id)."""
        return bisect.bisect_left(self._order, (w.key(),))

    def _update(self, w: Waiting) -> None:
        """A waiting request's new reason or time held back (its key, and so its place,
        stays)."""
        self._waiting[w.id] = w
        self._order[self._place_of(w)] = (w.key(), w)


def _reservable(request: GpuRequest) -> bool:
    """Whole GPUs held alone: the requests that starve behind small ones (a shared or MIG
    request fits in what any hold leaves)."""
    return not request.shared and request.mig_profile is None


def _back_by(hold: Hold, start: float | None) -> bool:
    """Whether `hold` is expected back by `start` (None: past every known moment, when
    every hold is counted back, of unknown end or not)."""
    if start is None:
        return True
    return hold.expected_end is not None and hold.expected_end <= start


def _freed_memory(node: NodeGpus, back: list[Hold]) -> NodeGpus:
    """The node as the head's set is placed on: memory its holders use counts as free once
    their holds are back (the node itself where nothing is, to keep its memoised scores)."""
    gone = {u for h in back for u in h.uuids}
    if not gone & node.memory_used.keys():
        return node
    used = {u: m for u, m in node.memory_used.items() if u not in gone}
    return replace(node, memory_used=used)


def _placed(
    request: GpuRequest, node: NodeGpus, held: Holdings, around: Reserved | None
) -> Placement | Refusal:
    """`place`, or with `around` a set that leaves the head's GPUs alone."""
    if around is None:
        return place(request, node, held)
    kept = replace(held, exclusive=held.exclusive | frozenset(around.uuids))
    result = place(request, node, kept)
    if isinstance(result, Refusal) and result.better_in is None:
        return Refusal(_behind(around, result.reason))
    return result


def _gives_back_by(w: Waiting, head: Reserved, now: float) -> bool:
    """Whether `w`, granted now, is expected to give its GPUs back before the head's start."""
    return head.start is not None and w.expected is not None and now + w.expected <= head.start


def _gpus(head: Reserved) -> tuple[str, str]:
    """'GPU 3', 'is' or 'GPUs 0, 1', 'are': the head's kept GPUs, and the verb."""
    if len(head.indices) == 1:
        return f"GPU {head.indices[0]}", "is"
    return "GPUs " + ", ".join(str(i) for i in head.indices), "are"


def _kept_for(head: Reserved) -> str:
    """The head's reason to wait, after why it fits nowhere (its expected start is shown
    beside it, as a time)."""
    gpus, are = _gpus(head)
    whose = ", ".join(head.waits_for)
    end = "ends" if len(head.waits_for) == 1 else "end"
    when = (
        f"expected free when {whose} {end}"
        if head.start is not None
        else f"free once {whose} {end} (a hold in the way has no expected end)"
    )
    return f"first in line: {gpus} {are} kept for it, {when}"


def _behind(head: Reserved, reason: str) -> str:
    gpus, are = _gpus(head)
    return (
        f"{reason}; {gpus} {are} kept for {head.owner}, first in line, and this request is"
        " not expected to give them back before its start"
    )
