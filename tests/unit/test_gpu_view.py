"""The GPU side's tick as three calls (read, decide, apply) and the frozen view the /v1/gpus
reads answer from (issue 37): the decision is a value that changes nothing until applied,
and a read while the loop grants sees the view published before, whole, never half of a
change. On the simulated DGX H100 (config/gpus/, a labelled stand-in: no GPU here), whose
eight GPUs run no process."""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel
from test_gpu_ledger import REPO

from nodeagent.api.peer import Peer
from nodeagent.api.server import Request, Routes
from nodeagent.commands import Commands
from nodeagent.gpu.simulated import load_simulated
from nodeagent.gpualloc.service import GpuService
from nodeagent.policyfile.model import PolicySpec
from nodeagent.routes.gpus import GpuRoutes
from nodeagent.wakeup import Wakeup

NODE = REPO / "config" / "gpus" / "dgx-h100-nvswitch.yaml"
SPEC = PolicySpec.model_validate(
    {"version": 1, "tenants": {"research": {"shares": 1}}, "jobs": {"default_tenant": "research"}}
)


def service() -> GpuService:
    gpus = GpuService(load_simulated(NODE), lambda: SPEC, lambda cgroup: True)
    gpus.sense(0.0)
    return gpus


def call(routes: Routes, method: str, path: str, uid: int = 0, **given: Any) -> Any:
    """A route's answer as a dict; on the caller's thread (a test drives the loop's part
    itself: it is the only thread that changes the ledger)."""
    peer = Peer(pid=1, uid=uid, gid=uid, groups=frozenset())
    query = given.pop("query", {})
    answer = routes[path][method](Request(method, path, query, peer, given))
    assert isinstance(answer, BaseModel)
    return answer.model_dump()


def served(gpus: GpuService) -> Routes:
    """The /v1/gpus routes as the daemon serves them: a new view after each change."""
    routes = GpuRoutes(gpus, lambda: SPEC, lambda tenant: 0.0).routes()
    return Commands(Wakeup()).serve(routes, then=gpus.publish)


def status(routes: Routes, rid: str) -> Any:
    return call(routes, "GET", "/v1/gpus/requests", query={"id": rid})


def test_the_decision_is_a_value_and_a_read_before_it_is_applied_sees_the_last_view() -> None:
    gpus = service()
    routes = served(gpus)
    holder = call(routes, "POST", "/v1/gpus/requests", name="all", count=8)
    waiting = call(routes, "POST", "/v1/gpus/requests", name="next", count=2)
    assert (holder["status"], waiting["status"]) == ("granted", "waiting")
    call(routes, "DELETE", "/v1/gpus/requests", id=holder["id"])  # all 8 free, none granted yet
    before, ledger = gpus.view, gpus.ledger.view()

    decided = gpus.decide(gpus.read(), SPEC.gpu, 1.0)
    (grant,) = decided.ledger.granted
    assert grant.id == waiting["id"] and grant.hold is not None
    assert decided.state is not None and decided.state.holds == (grant.hold,)
    assert gpus.ledger.view() == ledger, "deciding changed nothing"
    assert gpus.view is before
    assert status(routes, waiting["id"])["status"] == "waiting"
    assert call(routes, "GET", "/v1/gpus")["queue"][0]["owner"] == "next"

    gpus.apply(decided)
    assert status(routes, waiting["id"])["status"] == "waiting", "applied, not yet published"
    gpus.publish()  # the loop's, at the end of its tick
    assert status(routes, waiting["id"])["status"] == "granted"
    assert [h.owner for h in gpus.view.holds()] == ["next"]
    # the view a read held on to is as it was: the request waiting, no GPU held
    assert ([w.owner for w in before.ledger.queue()], before.holds()) == (["next"], ())


def test_a_read_while_the_loop_grants_sees_one_view_whole() -> None:
    """Each report is one of the states the loop published, never a mix of two (a request
    both waiting and holding its GPUs, or two holds of all eight GPUs). The loop's thread
    asks, cancels and ticks; another thread reads the report as fast as it can."""
    gpus = service()
    routes = served(gpus)
    stop = threading.Event()
    seen: list[tuple[frozenset[str], frozenset[str]]] = []

    def read() -> None:
        while not stop.is_set():
            report = call(routes, "GET", "/v1/gpus")
            queued = frozenset(w["owner"] for w in report["queue"])
            held = frozenset(h["owner"] for g in report["gpus"] for h in g["assigned"])
            seen.append((queued, held))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(60):
            first = call(routes, "POST", "/v1/gpus/requests", name=f"h{i}", count=8)
            call(routes, "POST", "/v1/gpus/requests", name=f"w{i}", count=8)
            call(routes, "DELETE", "/v1/gpus/requests", id=first["id"])
            gpus.sense(float(i))  # w{i} granted
            (hold,) = gpus.ledger.holds()
            rid = next(a.id for a in gpus.view.ledger.granted.values() if a.hold == hold)
            call(routes, "DELETE", "/v1/gpus/requests", id=rid)
    finally:
        stop.set()
        reader.join()
    assert len(seen) > 10, "the reader read while the loop changed the ledger"
    published = {
        (frozenset(q), frozenset(h))
        for i in range(60)
        for q, h in (
            ((), (f"h{i}",)), ((f"w{i}",), (f"h{i}",)), ((f"w{i}",), ()), ((), (f"w{i}",)),
            ((), ()),
        )
    }  # fmt: skip
    assert [s for s in seen if s not in published] == []
