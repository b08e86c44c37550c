"""Who holds which GPUs, and who waits for some: the daemon's GPU assignments.

A request that fits now is granted at once, as a hold that lapses unless a job claims it
within `gpu.claim_timeout`; one that does not fit waits. Waiting requests are served in
order of their class's priority, then their deadline (earliest first, none last), then
fair share (the tenant that used least for its shares first), then arrival; one that
does not fit yet is passed over for later ones that do (backfill). A waiting request
that is not asked about for `STALE_AFTER` seconds (its `exec` died) is dropped.
Placement itself is the pure `policy.placement.place`.

Jobs' holds are released when their job is reaped; a reservation for a container is
bound to the cgroup whose processes show on its GPUs and released when that cgroup goes,
or lapses after its time to live if none ever shows. Holds are kept in the state file.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from nodeagent.gpu.model import Hold
from nodeagent.policy.placement import GpuRequest, Holdings, NodeGpus, Placement, Refusal, place

STALE_AFTER = 15.0


@dataclass(frozen=True, slots=True)
class Waiting:
    id: str
    owner: str
    request: GpuRequest
    priority: int
    deadline: float | None
    fairness: float
    """Lower goes first: the tenant's decayed usage per share."""
    workload_class: str
    asked: float
    seen: float
    reason: str = ""


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


def closest_cpus(node: NodeGpus, indices: Iterable[int]) -> tuple[int, ...]:
    wanted = set(indices)
    return tuple(sorted({c for d in node.devices if d.index in wanted for c in d.cpus}))


def holdings(holds: Iterable[Hold]) -> Holdings:
    exclusive: set[str] = set()
    shared: dict[str, int] = {}
    for h in holds:
        if h.shared_memory is None:
            exclusive.update(h.uuids)
        else:
            for u in h.uuids:
                shared[u] = shared.get(u, 0) + h.shared_memory
    return Holdings(frozenset(exclusive), shared)


class GpuLedger:
    def __init__(self) -> None:
        self._holds: dict[str, Hold] = {}
        self._waiting: dict[str, Waiting] = {}
        self._granted: dict[str, Answer] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # --- asking -----------------------------------------------------------------------

    def ask(
        self,
        owner: str,
        request: GpuRequest,
        *,
        priority: int,
        deadline: float | None,
        fairness: float,
        workload_class: str,
        node: NodeGpus,
        now: float,
        claim_timeout: float,
    ) -> Answer:
        with self._lock:
            if owner in self._holds or any(w.owner == owner for w in self._waiting.values()):
                raise ValueError(f"{owner!r} already holds or waits for GPUs")
            rid = f"r{next(self._ids)}"
            self._waiting[rid] = Waiting(
                rid, owner, request, priority, deadline, fairness, workload_class, now, now
            )
            self._serve(node, now, claim_timeout)
            answer = self._answer(rid, now)
            assert answer is not None, "just asked: granted or waiting"
            return answer

    def status(self, rid: str, now: float) -> Answer | None:
        with self._lock:
            if rid in self._waiting:
                self._waiting[rid] = replace(self._waiting[rid], seen=now)
            return self._answer(rid, now)

    def cancel(self, rid: str) -> None:
        with self._lock:
            self._waiting.pop(rid, None)
            answer = self._granted.pop(rid, None)
            if answer is not None and answer.hold is not None:
                self._holds.pop(answer.hold.owner, None)

    def claim(self, rid: str, owner: str, cgroup: str) -> Hold:
        """A job takes the GPUs granted to its request; they are its own until it ends."""
        with self._lock:
            answer = self._granted.pop(rid, None)
            if answer is None or answer.hold is None or answer.hold.owner not in self._holds:
                raise KeyError(f"no GPUs are granted to request {rid!r} (lapsed or unknown)")
            del self._holds[answer.hold.owner]
            hold = replace(answer.hold, owner=owner, kind="job", cgroup=cgroup, until=None)
            self._holds[owner] = hold
            return hold

    def reserve(self, owner: str, hold: Hold) -> None:
        with self._lock:
            if owner in self._holds:
                raise ValueError(f"{owner!r} already holds GPUs")
            self._holds[owner] = hold

    # --- the loop ---------------------------------------------------------------------

    def step(self, node: NodeGpus | None, now: float, claim_timeout: float) -> list[Hold]:
        """Lapse unclaimed holds and stale waiters, then serve the queue; the lapsed holds."""
        with self._lock:
            lapsed = [h for h in self._holds.values() if h.until is not None and h.until <= now]
            for h in lapsed:
                del self._holds[h.owner]
            for rid, w in list(self._waiting.items()):
                if now - w.seen > STALE_AFTER:
                    del self._waiting[rid]
            for rid in [
                r for r, a in self._granted.items() if a.hold and a.hold.owner not in self._holds
            ]:
                del self._granted[rid]
            if node is not None:
                self._serve(node, now, claim_timeout)
            return lapsed

    def release(self, owner: str) -> Hold | None:
        with self._lock:
            return self._holds.pop(owner, None)

    def bind(self, owner: str, cgroup: str) -> None:
        with self._lock:
            h = self._holds.get(owner)
            if h is not None and h.cgroup is None:
                self._holds[owner] = replace(h, cgroup=cgroup, until=None)

    def holds(self) -> tuple[Hold, ...]:
        with self._lock:
            return tuple(self._holds.values())

    def queue(self) -> list[Waiting]:
        with self._lock:
            return self._ordered()

    # --- the state file ---------------------------------------------------------------

    def dump(self) -> list[dict[str, Any]]:
        with self._lock:
            return [asdict(h) for h in self._holds.values() if h.kind != "request"]

    def load(self, records: Iterable[Mapping[str, Any]], keep: Callable[[Hold], bool]) -> None:
        with self._lock:
            for r in records:
                h = Hold(
                    owner=str(r["owner"]),
                    kind=str(r["kind"]),
                    uuids=tuple(str(u) for u in r["uuids"]),
                    indices=tuple(int(i) for i in r["indices"]),
                    shared_memory=None
                    if r.get("shared_memory") is None
                    else int(r["shared_memory"]),
                    cgroup=None if r.get("cgroup") is None else str(r["cgroup"]),
                    workload_class=None
                    if r.get("workload_class") is None
                    else str(r["workload_class"]),
                    until=None if r.get("until") is None else float(r["until"]),
                    cpus=tuple(int(c) for c in r.get("cpus") or ()),
                )
                if keep(h):
                    self._holds[h.owner] = h

    # --- inside the lock --------------------------------------------------------------

    def _ordered(self) -> list[Waiting]:
        return sorted(
            self._waiting.values(),
            key=lambda w: (
                -w.priority,
                w.deadline if w.deadline is not None else float("inf"),
                w.fairness,
                w.asked,
                w.id,
            ),
        )

    def _serve(self, node: NodeGpus, now: float, claim_timeout: float) -> None:
        for w in self._ordered():
            result = place(w.request, node, holdings(self._holds.values()))
            if isinstance(result, Refusal):
                self._waiting[w.id] = replace(w, reason=result.reason)
                continue
            hold = Hold(
                owner=w.owner,
                kind="request",
                uuids=result.uuids,
                indices=result.indices,
                shared_memory=(w.request.memory or 0) if w.request.shared else None,
                workload_class=w.workload_class,
                until=now + claim_timeout,
                cpus=closest_cpus(node, result.indices),
            )
            self._holds[w.owner] = hold
            del self._waiting[w.id]
            self._granted[w.id] = Answer(w.id, "granted", hold, placement=result)

    def _answer(self, rid: str, now: float) -> Answer | None:
        if rid in self._granted:
            return self._granted[rid]
        if rid in self._waiting:
            order = [w.id for w in self._ordered()]
            w = self._waiting[rid]
            return Answer(rid, "waiting", position=order.index(rid) + 1, reason=w.reason)
        return None
