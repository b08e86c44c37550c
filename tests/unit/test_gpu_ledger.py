"""The daemon's GPU holds and queue, on simulated nodes (labelled fakes from config/gpus/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.gpu.ledger import GpuLedger, holdings
from nodeagent.gpu.model import Hold
from nodeagent.gpu.simulated import load_simulated
from nodeagent.policy.placement import GpuRequest, NodeGpus

REPO = Path(__file__).resolve().parents[2]
PAIRS = REPO / "config" / "gpus" / "4x-a100-two-nvlink-pairs.yaml"


@pytest.fixture
def node() -> NodeGpus:
    backend = load_simulated(PAIRS)
    return NodeGpus(backend.inventory(), backend.topology())


def ask(ledger: GpuLedger, node: NodeGpus, owner: str, count: int, **kw: object) -> str:
    args = {"priority": 100, "deadline": None, "fairness": 0.0, "workload_class": "batch"}
    args.update(kw)
    answer = ledger.ask(owner, GpuRequest(count), node=node, now=0.0, claim_timeout=30, **args)  # type: ignore[arg-type]
    return answer.status


def test_a_request_that_fits_is_granted_and_claimed_by_its_job(node: NodeGpus) -> None:
    ledger = GpuLedger()
    answer = ledger.ask(
        "a", GpuRequest(2), priority=1, deadline=None, fairness=0, workload_class="batch",
        node=node, now=0.0, claim_timeout=30,
    )  # fmt: skip
    assert answer.status == "granted" and answer.hold is not None
    assert len(set(answer.hold.indices)) == 2
    hold = ledger.claim(answer.id, "job-a", "nodeagent.slice/job-a")
    assert (hold.kind, hold.cgroup, hold.until) == ("job", "nodeagent.slice/job-a", None)
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
    ledger.release("all")
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


def test_holds_round_trip_through_the_state_file() -> None:
    ledger = GpuLedger()
    hold = Hold(
        "job-a", "job", ("GPU-1",), (1,), None, "nodeagent.slice/job-a", "training", cpus=(0, 1)
    )
    ledger.reserve("job-a", hold)
    again = GpuLedger()
    again.load(ledger.dump(), keep=lambda h: True)
    assert again.holds() == (hold,)
