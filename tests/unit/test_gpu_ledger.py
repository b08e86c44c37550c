"""The daemon's GPU holds and queue, on simulated nodes (labelled fakes from config/gpus/)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from nodeagent.gpu.ledger import Answer, GpuLedger, holdings
from nodeagent.gpu.simulated import load_simulated
from nodeagent.policy.placement import GpuRequest, NodeGpus, Refusal

REPO = Path(__file__).resolve().parents[2]
PAIRS = REPO / "config" / "gpus" / "4x-a100-two-nvlink-pairs.yaml"


@pytest.fixture
def node() -> NodeGpus:
    backend = load_simulated(PAIRS)
    return NodeGpus(backend.inventory(), backend.topology())


ASK = {
    "uid": 1000,
    "tenant": "research",
    "priority": 100,
    "deadline": None,
    "fairness": 0.0,
    "workload_class": "batch",
    "now": 0.0,
    "claim_timeout": 30,
    "max_waiting": 1000,
}


def answer(ledger: GpuLedger, node: NodeGpus, owner: str, count: int, **kw: object) -> Answer:
    return ledger.ask(owner, GpuRequest(count), node=node, **{**ASK, **kw})  # type: ignore[arg-type]


def ask(ledger: GpuLedger, node: NodeGpus, owner: str, count: int, **kw: object) -> str:
    return answer(ledger, node, owner, count, **kw).status


def release(ledger: GpuLedger, owner: str) -> None:
    """Give a grant back as its job would end: claimed, then released by its id."""
    rid = next(r for r, a in ledger._granted.items() if a.hold and a.hold.owner == owner)
    hold = ledger.claim(
        rid, uid=1000, owner=owner, cgroup=f"j/{owner}", tenant="research", workload_class="batch"
    )
    assert ledger.release_job(hold.id, 1000) == hold


def test_a_request_that_fits_is_granted_and_claimed_by_its_job(node: NodeGpus) -> None:
    ledger = GpuLedger()
    got = answer(ledger, node, "a", 2, priority=1)
    assert got.status == "granted" and got.hold is not None
    assert len(set(got.hold.indices)) == 2
    hold = ledger.claim(
        got.id, uid=1000, owner="job-a", cgroup="nodeagent.slice/job-a", tenant="research",
        workload_class="batch",
    )  # fmt: skip
    assert (hold.kind, hold.cgroup, hold.until) == ("job", "nodeagent.slice/job-a", None)
    assert (hold.id, hold.uid, hold.tenant) == (got.hold.id, 1000, "research")
    assert holdings(ledger.holds()).exclusive == frozenset(hold.uuids)


def test_an_unclaimed_grant_lapses(node: NodeGpus) -> None:
    ledger = GpuLedger()
    assert ask(ledger, node, "a", 4) == "granted"
    lapsed = ledger.step(node, now=31.0, claim_timeout=30)
    assert [h.owner for h in lapsed] == ["a"]
    assert ledger.holds() == ()


def test_waiting_requests_go_by_priority_then_deadline_then_fair_share(node: NodeGpus) -> None:
    ledger = GpuLedger()
    assert ask(ledger, node, "all", 4) == "granted"
    ask(ledger, node, "batch-late", 4, priority=100, deadline=900.0)
    ask(ledger, node, "batch-heavy", 4, priority=100, deadline=None, fairness=9.0)
    ask(ledger, node, "batch-light", 4, priority=100, deadline=None, fairness=1.0)
    ask(ledger, node, "training", 4, priority=200)
    ask(ledger, node, "batch-early", 4, priority=100, deadline=100.0)
    order = [w.owner for w in ledger.queue()]
    assert order == ["training", "batch-early", "batch-late", "batch-light", "batch-heavy"]
    release(ledger, "all")
    ledger.step(node, now=1.0, claim_timeout=30)
    assert [h.owner for h in ledger.holds()] == ["training"]


def test_backfill_serves_what_fits_past_a_request_that_does_not(node: NodeGpus) -> None:
    ledger = GpuLedger()
    assert ask(ledger, node, "two", 2) == "granted"
    assert ask(ledger, node, "four", 4, priority=300) == "waiting"
    assert ask(ledger, node, "one", 1) == "granted", "fits beside the waiting big one"


def test_a_waiter_nobody_asks_about_is_dropped(node: NodeGpus) -> None:
    ledger = GpuLedger()
    ask(ledger, node, "all", 4)
    ask(ledger, node, "late", 1)
    ledger.step(node, now=20.0, claim_timeout=60)
    assert ledger.queue() == []


def test_holds_round_trip_through_the_state_file(node: NodeGpus) -> None:
    ledger = GpuLedger()
    got = ledger.reserve(
        "web-1", GpuRequest(1), uid=1000, tenant="research", workload_class="training",
        container="4f1c2a9be7d3", node=node, until=100.0,
    )  # fmt: skip
    assert not isinstance(got, Refusal)
    hold = got[0]
    # saved at monotonic 40 = Unix 1e9, restored at monotonic 7 = Unix 1e9 + 3: 57 s left
    again = GpuLedger()
    again.load(ledger.dump(40.0, 1e9), keep=lambda h: h, now=7.0, wall=1e9 + 3)
    (restored,) = again.holds()
    assert restored.until == pytest.approx(64.0)
    assert replace(restored, until=hold.until) == hold
