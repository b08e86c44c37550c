"""The daemon's GPU holds and queue, on simulated nodes (labelled fakes from config/gpus/)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from nodeagent.errors import Conflict
from nodeagent.gpu.model import Hold
from nodeagent.gpu.simulated import load_simulated
from nodeagent.gpualloc.ledger import Answer, GpuLedger, UserBounds, holdings
from nodeagent.gpualloc.placement import GpuRequest, NodeGpus, Refusal
from nodeagent.policyfile.model import Backfill

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


def step(
    ledger: GpuLedger, node: NodeGpus | None, now: float, claim_timeout: float, **kw: Any
) -> tuple[Hold, ...]:
    """One step of the loop, decided then made, as the daemon's GPU service takes it; the
    holds that lapsed."""
    changes = ledger.decide(node, now, claim_timeout, **kw)
    ledger.commit(changes)
    return changes.lapsed


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


def test_more_gpus_than_one_uid_may_hold_is_refused_when_asked_and_waits_when_lowered(
    node: NodeGpus,
) -> None:
    """gpu.max_gpus_per_user, one rule (UserBounds.never_granted) in two places: a request
    for more is refused when asked and queues nothing (root is not bounded); one already
    waiting when a reload lowers the bound below it waits with that as its reason, and is
    granted once the bound is raised again and its GPUs are free."""
    ledger = GpuLedger()
    two, one = UserBounds(gpus=2), UserBounds(gpus=1)
    with pytest.raises(Conflict) as refused:
        answer(ledger, node, "big", 3, bounds=two)
    assert str(refused.value) == (
        "request 'big' asks for 3 GPUs; one uid may hold 2 at once (gpu.max_gpus_per_user),"
        " so it could never be granted"
    )
    assert ledger.queue() == [] and ledger.holds() == ()
    assert ask(ledger, node, "ops", 3, uid=0, bounds=two) == "granted"
    assert ask(ledger, node, "pair", 2, bounds=two) == "waiting"  # one GPU is free
    step(ledger, node, 1.0, 30, bounds=one)
    (waiting,) = ledger.queue()
    assert waiting.reason == (
        "2 GPUs are more than gpu.max_gpus_per_user (1) lets one uid hold at once; ask for fewer"
    )
    (ops,) = ledger.holds()
    assert step(ledger, node, 2.0, 30, bounds=one, drop=[ops]) == ()
    assert ledger.holds() == ()
    assert [w.owner for w in ledger.queue()] == ["pair"], "still past the bound"
    step(ledger, node, 3.0, 30, bounds=two)
    assert ledger.queue() == [] and [h.owner for h in ledger.holds()] == ["pair"]


def test_an_unclaimed_grant_lapses(node: NodeGpus) -> None:
    ledger = GpuLedger()
    assert ask(ledger, node, "a", 4) == "granted"
    lapsed = step(ledger, node, now=31.0, claim_timeout=30)
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
    step(ledger, node, now=1.0, claim_timeout=30)
    assert [h.owner for h in ledger.holds()] == ["training"]


def test_backfill_serves_what_fits_past_a_request_that_does_not(node: NodeGpus) -> None:
    """Around the GPUs kept for the head of the queue: a 2-GPU request that needs the free
    pair the 4-GPU head will get waits; a 1-GPU one expected back before the head's start
    is granted on them."""
    ledger = GpuLedger()
    assert ask(ledger, node, "two", 2, declared=600.0) == "granted"
    assert ask(ledger, node, "four", 4, priority=300) == "waiting"
    assert ask(ledger, node, "late", 2, declared=900.0) == "waiting", "back after its start"
    assert ask(ledger, node, "one", 1, declared=60.0) == "granted", "back before its start"


def test_the_head_of_the_queue_has_gpus_kept_for_it_and_its_expected_start(
    node: NodeGpus,
) -> None:
    """EASY backfill: the first request that fits nowhere is promised the set it will get
    when the holds in its way are expected back, and that moment; the others are placed
    around it, or on it only when they give the GPUs back by then."""
    ledger = GpuLedger()
    a = start(ledger, node, "a", 2, now=0.0, declared=100.0)
    b = start(ledger, node, "b", 1, now=0.0, declared=300.0)
    got = answer(ledger, node, "big", 4, now=10.0)
    assert got.status == "waiting"
    head = ledger.view().reserved
    assert head is not None and head.request == got.id
    assert (head.indices, head.start, head.waits_for) == ((0, 1, 2, 3), 300.0, ("a", "b"))
    assert ledger.queue()[0].reason == (
        "no 4 GPUs free now: 1 of 4 eligible (3 held); first in line: GPUs 0, 1, 2, 3 are"
        " kept for it, expected free when a, b end"
    )
    small = answer(ledger, node, "small", 1, now=11.0, declared=600.0)
    assert small.status == "waiting", "free GPU 3 is kept: it would hold it past 300 s"
    assert "are kept for big, first in line" in small.reason or "kept for big" in (
        ledger.queue()[1].reason
    )
    quick = start(ledger, node, "quick", 1, now=12.0, declared=200.0)
    assert quick.indices == (3,), "on a kept GPU: back at 212, before the head's start"
    # a and b give their GPUs back; the head takes all four once quick is done too
    ledger.release_job(a.id, 1000, now=100.0)
    ledger.release_job(b.id, 1000, now=250.0)
    waiting = {w.id: 250.0 for w in ledger.queue()}  # their execs ask about them
    step(ledger, node, now=250.0, claim_timeout=30, asked=waiting)
    assert [w.owner for w in ledger.queue()] == ["big", "small"], "GPU 3 is quick's still"
    ledger.release_job(quick.id, 1000, now=260.0)
    step(ledger, node, now=260.0, claim_timeout=30, asked=dict.fromkeys(waiting, 260.0))
    assert "big" in {h.owner for h in ledger.holds()}
    head = ledger.view().reserved
    assert head is not None and head.owner == "small", "the next one that fits nowhere"


def test_a_stream_of_small_requests_does_not_starve_a_big_one(node: NodeGpus) -> None:
    """Before reservations, 1-GPU jobs arriving faster than they end took every GPU freed
    and the 4-GPU request waited for ever; now the GPUs freed are kept for it, and it
    starts once the last job in its way ends."""
    ledger = GpuLedger()
    jobs = [start(ledger, node, f"s{i}", 1, now=0.0, declared=100.0 + i) for i in range(4)]
    assert answer(ledger, node, "big", 4, now=1.0).status == "waiting"
    for t in range(2, 110, 5):  # small ones keep asking; the held ones end by 103
        for j in jobs:
            if j.expected_end is not None and j.expected_end <= t and j.id in ledger._holds:
                ledger.release_job(j.id, 1000, now=float(t))
        ask(ledger, node, f"n{t}", 1, now=float(t), declared=1000.0)
        asked = {w.id: float(t) for w in ledger.queue()}
        step(ledger, node, now=float(t), claim_timeout=3600, asked=asked)
    held = {h.owner: h for h in ledger.holds()}
    assert "big" in held and held["big"].indices == (0, 1, 2, 3)
    assert not [o for o in held if o.startswith("n")], "no small one took a kept GPU"


def test_a_hold_of_unknown_end_leaves_the_heads_start_unknown(node: NodeGpus) -> None:
    ledger = GpuLedger()
    start(ledger, node, "a", 1, now=0.0)  # no declared duration, no class history
    assert ask(ledger, node, "big", 4, now=1.0) == "waiting"
    head = ledger.view().reserved
    assert head is not None and head.start is None and head.waits_for == ("a",)
    assert "a hold in the way has no expected end" in ledger.queue()[0].reason
    assert ask(ledger, node, "one", 1, now=2.0, declared=5.0) == "waiting", "no start to beat"


def test_a_request_placed_before_the_head_becomes_the_head(node: NodeGpus) -> None:
    ledger = GpuLedger()
    start(ledger, node, "a", 4, now=0.0, declared=100.0)
    assert ask(ledger, node, "two", 2, now=1.0) == "waiting"
    head = ledger.view().reserved
    assert head is not None and head.owner == "two"
    assert ask(ledger, node, "urgent", 3, now=2.0, priority=300) == "waiting"
    head = ledger.view().reserved
    assert head is not None and head.owner == "urgent"
    assert [w.owner for w in ledger.queue()] == ["urgent", "two"]


def test_a_head_whose_start_passes_is_worked_out_again(node: NodeGpus) -> None:
    ledger = GpuLedger()
    start(ledger, node, "a", 4, now=0.0, declared=100.0)
    assert ask(ledger, node, "big", 4, now=1.0) == "waiting"
    head = ledger.view().reserved
    assert head is not None and head.start == 100.0
    asked = {w.id: 150.0 for w in ledger.queue()}
    step(ledger, node, now=150.0, claim_timeout=30, asked=asked)  # a runs late
    head = ledger.view().reserved
    assert head is not None and head.start is None, "nobody knows when a ends now"


def test_a_waiter_nobody_asks_about_is_dropped(node: NodeGpus) -> None:
    ledger = GpuLedger()
    ask(ledger, node, "all", 4)
    ask(ledger, node, "late", 1)
    step(ledger, node, now=20.0, claim_timeout=60)
    assert ledger.queue() == []


def test_holds_round_trip_through_the_state_file(node: NodeGpus) -> None:
    ledger = GpuLedger()
    got = ledger.reserve(
        "web-1", GpuRequest(1), uid=1000, tenant="research", workload_class="training",
        container="4f1c2a9be7d3", node=node, now=0.0, until=100.0,
    )  # fmt: skip
    assert not isinstance(got, Refusal)
    hold = got[0]
    # saved at monotonic 40 = Unix 1e9, restored at monotonic 7 = Unix 1e9 + 3: 57 s left
    again = GpuLedger()
    again.load(ledger.dump(40.0, 1e9), keep=lambda h: h, now=7.0, wall=1e9 + 3)
    (restored,) = again.holds()
    assert restored.until == pytest.approx(64.0)
    assert replace(restored, until=hold.until) == hold


def start(ledger: GpuLedger, node: NodeGpus, owner: str, count: int, **kw: object) -> Hold:
    """Ask, be granted and claim: a job holding its GPUs."""
    got = answer(ledger, node, owner, count, **kw)
    assert got.status == "granted", got
    return ledger.claim(
        got.id, uid=1000, owner=owner, cgroup=f"j/{owner}", tenant="research",
        workload_class=str(kw.get("workload_class", "batch")),
    )  # fmt: skip


def test_a_declared_duration_says_when_the_hold_is_expected_back(node: NodeGpus) -> None:
    ledger = GpuLedger()
    hold = start(ledger, node, "a", 2, now=100.0, declared=600.0)
    assert (hold.since, hold.expected_end) == (100.0, 700.0)
    assert holdings(ledger.holds(), now=200.0).release == dict.fromkeys(hold.uuids, 500.0)
    assert holdings(ledger.holds()).release == {}  # without a clock, nothing is known
    # past its expected end a job is running late: when it ends is unknown again
    assert holdings(ledger.holds(), now=800.0).release == {}


def test_a_class_s_recent_holds_estimate_a_job_that_declares_nothing(node: NodeGpus) -> None:
    ledger = GpuLedger()
    first = start(ledger, node, "a", 1, now=0.0)
    assert first.expected_end is None  # nothing known yet
    assert ledger.release_job(first.id, 1000, now=40.0) == first
    assert ledger.history() == {"batch": [40.0]}
    second = start(ledger, node, "b", 1, now=100.0)
    assert second.expected_end == 140.0
    other = start(ledger, node, "c", 1, now=100.0, workload_class="training")
    assert other.expected_end is None  # another class's history says nothing of it


def test_a_waiting_request_waits_within_its_patience_for_a_better_set(node: NodeGpus) -> None:
    """4x A100 (pairs 0-1 and 2-3 of 12 NVLinks): with GPUs 0 and 2 free and GPU 1 expected
    back in 2 s, a waiting 2-GPU job waits for the pair 0-1 rather than take 0 and 2 (one
    PCIe hop across sockets); without patience, or once it runs out, it takes them."""

    def scene(patience: float) -> tuple[GpuLedger, dict[str, Hold], str]:
        ledger = GpuLedger()
        jobs = {
            name: start(ledger, node, name, 1, now=0.0, declared=declared)
            for name, declared in (("j0", None), ("j1", 5.0), ("j2", None), ("j3", None))
        }
        assert [jobs[n].indices for n in ("j0", "j1", "j2", "j3")] == [(0,), (1,), (2,), (3,)]
        asked = answer(ledger, node, "r", 2, now=1.0, declared=50.0, patience=patience)
        assert asked.status == "waiting"
        for name in ("j0", "j2"):
            ledger.release_job(jobs[name].id, 1000, now=3.0)
        step(ledger, node, now=3.0, claim_timeout=30, patience=patience)
        return ledger, jobs, asked.id

    def granted(ledger: GpuLedger) -> tuple[int, ...] | None:
        return next((a.hold.indices for a in ledger._granted.values() if a.hold), None)

    ledger, jobs, _ = scene(patience=0.0)
    assert granted(ledger) == (0, 2)
    ledger, jobs, rid = scene(patience=1.0)
    assert granted(ledger) is None
    (w,) = ledger.queue()
    assert w.held_back == 3.0
    assert w.reason.startswith("waits for GPUs 0, 1: expected free within 2s")
    assert ledger.view().status(rid, 1000).status == "waiting"
    step(ledger, node, now=4.0, claim_timeout=30, patience=1.0, asked={rid: 4.0})  # none freed
    assert granted(ledger) is None
    ledger.release_job(jobs["j1"].id, 1000, now=5.0)
    step(ledger, node, now=5.0, claim_timeout=30, patience=1.0)
    assert granted(ledger) == (0, 1)
    # GPU 1's job runs late: past its expected end nobody knows when it ends, so the
    # request stops waiting for it at the next step and takes what is free
    ledger, jobs, rid = scene(patience=1.0)
    assert ledger.view().status(rid, 1000).status == "waiting"
    step(ledger, node, now=6.0, claim_timeout=30, patience=1.0, asked={rid: 6.0})
    assert granted(ledger) == (0, 2)


def test_durations_survive_the_state_file(node: NodeGpus) -> None:
    ledger = GpuLedger()
    hold = start(ledger, node, "a", 1, now=10.0, declared=100.0)
    done = start(ledger, node, "b", 1, now=10.0)
    ledger.release_job(done.id, 1000, now=30.0)
    again = GpuLedger()
    again.load(ledger.dump(40.0, 1e9), keep=lambda h: h, now=7.0, wall=1e9 + 3)
    again.load_history(ledger.history())
    (restored,) = again.holds()
    assert (restored.since, restored.expected_end) == pytest.approx((-26.0, 74.0))
    assert replace(restored, since=hold.since, expected_end=hold.expected_end) == hold
    assert again.history() == {"batch": [20.0]}


@pytest.mark.parametrize(
    "saved",
    [{"batch": [-1.0]}, {"batch": "x"}, {"nosuchclass": [1.0]}, {"batch": [1.0] * 21}, []],
)
def test_a_malformed_history_is_dropped_with_a_warning(saved: object) -> None:
    """(The log is captured, not read from stdout: where structlog prints depends on what
    configured it last, such as a CLI command another test ran.)"""
    ledger = GpuLedger()
    with capture_logs() as logs:
        ledger.load_history(saved)  # type: ignore[arg-type]
    assert ledger.history() == {}
    assert [(e["event"], e["log_level"]) for e in logs] == [
        ("state.gpu_history_dropped", "warning")
    ]


# --- restoring a state file whose holds conflict (a corrupt or hand-edited file) -----------

GPU = [f"GPU-{n}" for n in range(4)]


def record(owner: str, gpus: list[int], **kw: object) -> dict[str, object]:
    """A hold as the state file keeps it."""
    return {
        "owner": owner, "kind": "reservation", "uuids": [GPU[i] for i in gpus],
        "indices": gpus, "id": f"id-{owner}-0123456789", "uid": 1000, **kw,
    }  # fmt: skip


def restored(
    records: list[dict[str, object]],
) -> tuple[GpuLedger, list[Mapping[str, object]]]:
    ledger = GpuLedger()
    with capture_logs() as logs:
        ledger.load(records, keep=lambda h: h, now=0.0, wall=1e9)
    return ledger, [e for e in logs if e["event"].startswith("state.hold")]


def test_a_hold_recorded_twice_is_restored_once() -> None:
    ledger, logs = restored([record("web", [0]), record("web", [0])])
    assert [(h.owner, h.uuids) for h in ledger.holds()] == [("web", (GPU[0],))]
    assert [(e["event"], e["owner"]) for e in logs] == [("state.hold_duplicate", "web")]


def test_a_restored_hold_on_gpus_another_holds_is_refused() -> None:
    """Never two holds on one GPU (an exclusive hold beside any other): the first restored
    keeps it, the other is refused in one line naming it and its GPUs, whatever its id and
    name; holds sharing a GPU by memory are both kept."""
    ledger, logs = restored(
        [
            record("web", [0, 1]),
            record("train", [1, 2]),
            record("a", [3], shared_memory=1 << 30),
            record("b", [3], shared_memory=1 << 30),
            record("c", [3]),
        ]
    )
    assert sorted(h.owner for h in ledger.holds()) == ["a", "b", "web"]
    assert [(e["event"], e["owner"], e["uuids"], e["error"]) for e in logs] == [
        ("state.hold_dropped", "train", [GPU[1], GPU[2]], "GPUs GPU-1 are held by 'web' already"),
        ("state.hold_dropped", "c", [GPU[3]], "GPUs GPU-3 are held by 'a' already"),
    ]
    assert holdings(ledger.holds()).exclusive == frozenset(GPU[:2])


def test_a_restored_hold_whose_name_is_taken_is_refused() -> None:
    """Reservations are released and attached by name: two of one name would answer for
    each other. The second is refused, in one line naming it."""
    ledger, logs = restored([record("web", [0]), record("web", [1], id="another-id-0123456")])
    assert [(h.owner, h.uuids) for h in ledger.holds()] == [("web", (GPU[0],))]
    assert [(e["event"], e["owner"], e["uuids"], e["error"]) for e in logs] == [
        ("state.hold_dropped", "web", [GPU[1]], "its name 'web' is another hold's")
    ]


def test_a_restored_hold_whose_id_is_taken() -> None:
    """A reservation is kept under a new id (it is released by name, and the daemon drops
    it by the id it reads); a job's hold is refused, since its job releases by that id,
    which is the first hold's."""
    taken = "id-web-0123456789"
    ledger, logs = restored(
        [
            record("web", [0]),
            record("other", [1], id=taken),
            record("job", [2], id=taken, kind="job", cgroup="nodeagent.slice/job"),
        ]
    )
    holds = {h.owner: h for h in ledger.holds()}
    assert sorted(holds) == ["other", "web"]
    assert holds["web"].id == taken and holds["other"].id not in ("", taken)
    assert [(e["event"], e["owner"]) for e in logs] == [
        ("state.hold_renamed", "other"),
        ("state.hold_dropped", "job"),
    ]
    assert logs[1]["error"] == "its id is the hold of 'web', which its job would release"
    assert ledger.release_reservation("other", 1000).uuids == (GPU[1],)
    assert [h.owner for h in ledger.holds()] == ["web"]


def test_a_named_reservation_leaves_the_gpus_kept_for_the_head_alone(node: NodeGpus) -> None:
    ledger = GpuLedger()
    start(ledger, node, "a", 2, now=0.0, declared=100.0)
    assert ask(ledger, node, "big", 4, now=1.0) == "waiting"
    got = ledger.reserve(
        "web", GpuRequest(1), uid=1000, tenant="research", workload_class="inference",
        container=None, node=node, now=2.0, until=600.0,
    )  # fmt: skip
    assert isinstance(got, Refusal) and "kept for big, first in line" in got.reason


def test_greedy_backfill_keeps_nothing_for_the_head(node: NodeGpus) -> None:
    """gpu.backfill: greedy is the queue as it was before reservations: anything that fits
    goes (the baseline of scripts/bench gpu-contention)."""
    ledger = GpuLedger()
    start(ledger, node, "a", 2, now=0.0, declared=100.0)
    assert ask(ledger, node, "big", 4, now=1.0, backfill=Backfill.GREEDY) == "waiting"
    assert ledger.view().reserved is None
    assert ask(ledger, node, "one", 1, now=2.0, backfill=Backfill.GREEDY) == "granted"
    # back to reserve (a reload): the next step serves the queue anew and keeps GPUs for big
    step(ledger, node, now=3.0, claim_timeout=30, asked={w.id: 3.0 for w in ledger.queue()})
    head = ledger.view().reserved
    assert head is not None and head.owner == "big"
