"""Policies declare what they read (`Policy.reads`, nodeagent.policy.reads), the plan cache
keys the last plan by exactly that, and the suite refuses a read left undeclared
(readguard.py, run on every plan by conftest.py): no policy keeps a cache key by hand
(issue 37, item 6)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

import pytest
from builders import snapshot, spec, workload
from readguard import Guarded, Undeclared

from nodeagent.gpu.model import GpuProcess, GpuState, Topology
from nodeagent.policy import reads as declared
from nodeagent.policy.base import Assignment, Output, Policy, PolicyInput
from nodeagent.policy.classify import assign
from nodeagent.policy.newcomer import SiblingWeight
from nodeagent.policy.plan import DEFAULT_POLICIES, Plan
from nodeagent.policy.plancache import KEYS, PlanCache, PlanInputs
from nodeagent.policy.reads import Reads, Window
from nodeagent.policyfile.model import PolicySpec
from nodeagent.snapshot import NO_NEEDS, Needs, NodeSnapshot, Skipped

SPEC = spec({"a": 2, "b": 1})
WORKLOADS = (workload("nodeagent.slice/a-1"), workload("nodeagent.slice/b-1"))
NOON = 12 * 3600.0
NOTHING = Reads()


class Reader(Policy):
    """Decides nothing, reads what it is told to declare (or not), counts its plans."""

    name = "reader"

    def __init__(self, reads: Reads = NOTHING, every_tick: bool = False) -> None:
        self.reads, self.every_tick, self.calls = reads, every_tick, 0

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        self.calls += 1
        return ()

    def needs(self, assignment: Assignment, spec: PolicySpec) -> Needs:
        return Needs(events=True) if self.every_tick else NO_NEEDS

    def windows(self, spec: PolicySpec) -> tuple[Window, ...]:
        return ((int(NOON), int(NOON) + 60),)


def given(snap: NodeSnapshot, last: Plan | None, **change: object) -> PlanInputs:
    assignments = assign([w.identity for w in snap.workloads], SPEC)
    base = PlanInputs(snap, SPEC, {"a": 10.0, "b": 10.0}, {}, assignments, last)
    return replace(base, **change)  # type: ignore[arg-type]


def gpus(*pids: int) -> GpuState:
    procs = tuple(GpuProcess(p, "GPU-0", None, "nodeagent.slice/a-1") for p in pids)
    return GpuState((), Topology(), (), procs, (), "test", True)


def perturbed(part: str, snap: NodeSnapshot, inputs: PlanInputs) -> PlanInputs:
    """The next tick's input, with one thing the policy may read changed."""
    if part == "gpus":
        return replace(inputs, snapshot=replace(snap, gpus=gpus(1, 2)))
    if part == "skipped":
        gone = Skipped(WORKLOADS[1].identity, "sense", "unreadable")
        return replace(inputs, snapshot=replace(snap, skipped=(gone,)))
    if part == "levels":
        level = workload("nodeagent.slice")
        return replace(inputs, snapshot=replace(snap, levels=(level,)))
    if part == "local_seconds":  # into the window
        return replace(inputs, snapshot=replace(snap, local_seconds=NOON + 1))
    if part == "cpu_rate":  # one workload idles
        idle = (WORKLOADS[0], replace(WORKLOADS[1], cpu_rate=0.0))
        return replace(inputs, snapshot=replace(snap, workloads=idle))
    if part == "usage":
        return replace(inputs, usage={"a": 10.0, "b": 12.0})
    if part == "fair_share":  # a reload of this one section
        fair = SPEC.fair_share.model_copy(update={"deadband": 0.2})
        return replace(inputs, spec=SPEC.model_copy(update={"fair_share": fair}))
    if part == "deadlines":
        dl = SPEC.deadlines.model_copy(update={"headroom": 1.5})
        return replace(inputs, spec=SPEC.model_copy(update={"deadlines": dl}))
    if part == "at_work":
        return replace(inputs, carry={"reader": {"busy": ["x"]}})
    raise AssertionError(part)


DECLARATIONS: dict[str, Reads] = {
    "gpus": Reads(snapshot=frozenset({"gpus"})),
    "skipped": Reads(snapshot=frozenset({"skipped"})),
    "levels": Reads(snapshot=frozenset({"levels"})),
    "local_seconds": Reads(snapshot=frozenset({"local_seconds"})),
    "cpu_rate": Reads(workload=frozenset({"cpu_rate"})),
    "usage": Reads(usage=True),
    "deadlines": Reads(settings=frozenset({"deadlines"})),
    "at_work": Reads(carry=True, at_work=frozenset({"busy"})),
}
"""What a policy that reads each part declares (the wall clock: its own test)."""


@pytest.mark.parametrize("part", DECLARATIONS)
@pytest.mark.parametrize("declares", [True, False], ids=["declared", "undeclared"])
def test_what_a_policy_declares_is_what_makes_a_new_plan(part: str, declares: bool) -> None:
    """Changed, a part a policy declares makes a new plan at once; the same change to a
    part no policy in use declares keeps the last plan (until agent.replan_interval)."""
    reader = Reader(DECLARATIONS[part] if declares else Reads())
    cache, snap = PlanCache(), snapshot(WORKLOADS, seq=1)
    snap = replace(snap, local_seconds=NOON - 60)
    first, _ = cache.plan(given(snap, None), (reader,), 0.0)
    _, same = cache.plan(given(replace(snap, seq=2), first), (reader,), 1.0)
    assert same, "nothing changed: the last plan again"
    _, same = cache.plan(perturbed(part, replace(snap, seq=3), given(snap, first)), (reader,), 2.0)
    assert same is not declares


def test_the_plan_itself_reads_its_own_sections() -> None:
    """A reload of a section the pipeline reads (fair_share: the usage's half-life) plans
    anew whatever the policies declare."""
    reader = Reader()
    cache, snap = PlanCache(), snapshot(WORKLOADS, seq=1)
    first, _ = cache.plan(given(snap, None), (reader,), 0.0)
    _, same = cache.plan(perturbed("fair_share", snap, given(snap, first)), (reader,), 1.0)
    assert not same


@pytest.mark.parametrize("every_tick", [True, False])
def test_the_wall_clock_moves_the_plan_only_with_a_workload_read_every_tick(
    every_tick: bool,
) -> None:
    """A policy that reads the wall clock reads it against what it reads every tick (a
    deadline job): without one, its plan is made again."""
    reader = Reader(Reads(snapshot=frozenset({"wall_time"})), every_tick=every_tick)
    cache, snap = PlanCache(), snapshot(WORKLOADS, seq=1)
    first, _ = cache.plan(given(snap, None), (reader,), 0.0)
    _, same = cache.plan(given(replace(snap, seq=2), first), (reader,), 1.0)
    assert same is not every_tick


def test_a_window_edge_makes_a_new_plan_and_the_time_inside_it_does_not() -> None:
    """The local time is keyed by the policy's windows (a GPU power cap from 12:00): it
    enters one, a new plan; a minute later, still inside, the same."""
    reader = Reader(DECLARATIONS["local_seconds"])
    cache, snap = PlanCache(), replace(snapshot(WORKLOADS, seq=1), local_seconds=NOON - 1)
    last, _ = cache.plan(given(snap, None), (reader,), 0.0)
    last, same = cache.plan(given(replace(snap, local_seconds=NOON), last), (reader,), 1.0)
    assert not same
    _, same = cache.plan(given(replace(snap, local_seconds=NOON + 30), last), (reader,), 2.0)
    assert same


class Sneaky(Policy):
    """Reads one thing it did not declare."""

    name = "sneaky"

    def __init__(self, what: str) -> None:
        self.what = what

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        if self.what == "node":
            _ = given.snapshot.node.cpu_count
        elif self.what == "figure":
            _ = [w.sample.memory_current for w in given.snapshot.workloads]
        elif self.what == "section":
            _ = given.spec.protection
        elif self.what == "usage":
            _ = given.tenant_usage.get("a")
        elif self.what == "another's carry":
            _ = given.carried.get("protection")
        elif self.what == "its carry":
            _ = given.carried.get(self.name)
        return ()


@pytest.mark.parametrize(
    ("what", "refused"),
    [
        ("node", "sneaky: snapshot.node"),
        ("figure", "sneaky: workload sample.memory_current"),
        ("section", "sneaky: policy file.protection"),
        ("usage", "sneaky: usage['a']"),
        ("another's carry", "sneaky: carried['protection']"),
        ("its carry", "sneaky: carried['sneaky']"),
    ],
)
def test_an_undeclared_read_is_refused_and_named(what: str, refused: str) -> None:
    seen: list[str] = []
    snap = snapshot(WORKLOADS)
    inputs = PolicyInput(snap, SPEC, assign([w.identity for w in snap.workloads], SPEC), {})
    with pytest.raises(Undeclared):
        Guarded(Sneaky(what), seen).decide(inputs)
    assert seen == [refused]


def test_every_input_of_a_policy_is_declared_or_given_to_all() -> None:
    """A new field of the policies' input, of the snapshot or of a workload must be
    placed: guarded (readguard.py) and keyed one way (reads.py), or this fails."""
    assert {f.name for f in fields(PolicyInput)} == {
        "snapshot",  # by part: Reads.snapshot, Reads.workload
        "spec",  # by section: Reads.settings
        "tenant_usage",  # Reads.usage
        "carried",  # Reads.carry, its own only
        "assignments",  # given to all: the claims are always keyed
        "earlier",  # given to all: made this tick from the rest
    }
    parts = (
        declared.KEYED,
        declared.WINDOWED,
        declared.MOVING,
        declared.COVERED,
        declared.FIGURES,
    )
    assert sum(len(p) for p in parts) == len(declared.SNAPSHOT)
    assert frozenset().union(*parts) == declared.SNAPSHOT
    assert KEYS.keys() == declared.KEYED


def test_a_declaration_of_no_such_input_is_refused() -> None:
    for bad in (
        {"settings": frozenset({"fairshare"})},
        {"snapshot": frozenset({"gpu"})},
        {"workload": frozenset({"cpu_rates"})},
    ):
        with pytest.raises(ValueError, match="no "):
            Reads(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="declare carry"):
        Reads(at_work=frozenset({"caps"}))


def test_every_shipped_policy_declares_what_it_reads_as_the_reference_says() -> None:
    """docs/architecture.md's table of reads is the declarations, column by column."""
    text = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    table = text.split("### What each policy reads", 1)[1].split("\n### ", 1)[0]
    for p in (*DEFAULT_POLICIES, SiblingWeight(None)):
        row = next((line for line in table.splitlines() if line.startswith(f"| `{p.name}` ")), "")
        assert row, f"docs/architecture.md has no row of reads for policy {p.name}"
        cells = [c.strip() for c in row.split("|")[2:-1]]
        r = p.reads
        also = [
            *(["usage"] if r.usage else []),
            *(["its carry"] if r.carry else []),
            *([f"at work: {', '.join(sorted(r.at_work))}"] if r.at_work else []),
        ]
        assert cells == [
            ", ".join(sorted(r.settings)),
            ", ".join(sorted(r.snapshot)),
            ", ".join(sorted(r.workload)),
            "; ".join(also),
        ], row
