"""Policies declare what the loop reads for them every tick and when their plan is stale;
the loop folds what they declare and knows none of them by name (issue 14.4)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from test_sense import FILES, count_reads

from nodeagent.cgroupfs.parse import Psi, PsiLine
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import Agent, open_agent
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.jobs import Job
from nodeagent.policy.base import Assignment, Output, Policy, PolicyInput
from nodeagent.policy.deadlines import Deadlines
from nodeagent.policy.plan import DEFAULT_POLICIES
from nodeagent.policy.plancache import PlanCache, at_work
from nodeagent.policy.protection import Protection
from nodeagent.policy.reads import Reads
from nodeagent.policyfile.model import PolicySpec, WorkloadClass
from nodeagent.reconcile import Reconciler
from nodeagent.sense.node import NodeSensor
from nodeagent.sense.sensor import Sensor
from nodeagent.snapshot import NO_NEEDS, CgroupSample, Needs, WorkloadState

SLICE = "nodeagent.slice"
WORKLOADS = ("deadline-a", "infer-a", "reserved-a", "batch-a", "job-a")
"""One workload of each kind a policy treats apart: a rule's deadline job, a protected
class, a class with a reservation, a plain batch workload, and a job exec started."""

EXPECTED: dict[str, dict[str, Needs]] = {
    "deadlines": {"deadline-a": Needs(events=True, threads=True)},
    "reservations": {},
    "fair-share": {},
    "cpu-weights": {},
    "static-limits": {},
    "protection": {
        "deadline-a": Needs(pressure=True),
        "infer-a": Needs(pressure=True),
        "reserved-a": Needs(pressure=True),
    },
    "gpu-checks": {},
    "gpu-power": {},
}
"""What each default policy reads of each workload every tick, beyond cpu.stat (the
workloads it needs nothing of are left out)."""

REAPER = {"job-a": Needs(events=True)}
"""What the job reaper (not a policy) reads: an exec job's cgroup.events."""

FILE_OF = {
    "events": "cgroup.events",
    "memory": "memory.current",
    "pressure": "cpu.pressure",
    "threads": "cgroup.threads",
}


def files(need: Needs) -> set[str]:
    return {f for field, f in FILE_OF.items() if getattr(need, field)}


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    root = tmp_path / "cgroup"
    for name in WORKLOADS:
        d = root / SLICE / name
        d.mkdir(parents=True)
        for f, text in FILES.items():
            (d / f).write_text(text)
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"state_file": str(tmp_path / "state.json")},
            "tenants": {"t": {"shares": 1}},
            "classes": {"training": {"reserved_cpu": 1}},
            "rules": [
                {
                    "name": "deadline",
                    "match": {"name": "deadline-*"},
                    "tenant": "t",
                    "deadline": "2030-01-01T00:00:00Z",
                    "work": 10,
                },
                {
                    "name": "infer",
                    "match": {"name": "infer-*"},
                    "tenant": "t",
                    "class": "inference",
                },
                {
                    "name": "reserved",
                    "match": {"name": "reserved-*"},
                    "tenant": "t",
                    "class": "training",
                },
                {"name": "batch", "match": {"name": "batch-*"}, "tenant": "t"},
            ],
        }
    )
    a = open_agent(spec, CgroupTree(str(root)))
    a.rec.registry.resync()
    return a


def exec_job() -> dict[str, Assignment]:
    job = Job("a", f"{SLICE}/job-a", "t", WorkloadClass.BATCH, 0, 1, 0.0)
    return {job.cgroup: job.assignment()}


def claimed(agent: Agent) -> tuple[dict[str, Assignment], list[WorkloadIdentity]]:
    assignments, managed, *_ = agent.rec.claimed(agent.rec.registry.identities(), exec_job())
    assert sorted(i.name for i in managed) == sorted(WORKLOADS)
    return assignments, managed


def by_name(needs: Mapping[str, Needs]) -> dict[str, Needs]:
    return {path.removeprefix(f"{SLICE}/"): n for path, n in needs.items()}


def union(*tables: Mapping[str, Needs]) -> dict[str, Needs]:
    out: dict[str, Needs] = {}
    for table in tables:
        for name, need in table.items():
            out[name] = out.get(name, NO_NEEDS) | need
    return out


def test_every_default_policy_has_its_needs_stated_here() -> None:
    assert sorted(p.name for p in DEFAULT_POLICIES) == sorted(EXPECTED)


def test_an_exec_job_is_known_by_its_assignment_not_its_rule_name(agent: Agent) -> None:
    assignments, _ = claimed(agent)
    assert assignments[f"{SLICE}/job-a"].exec_job
    assert not any(a.exec_job for p, a in assignments.items() if p != f"{SLICE}/job-a")


@pytest.mark.parametrize("policy", DEFAULT_POLICIES, ids=lambda p: p.name)
def test_a_policy_declares_what_it_reads_every_tick(agent: Agent, policy: Policy) -> None:
    assignments, managed = claimed(agent)
    declared = {
        i.name: n
        for i in managed
        if (n := policy.needs(assignments[i.path], agent.rec.spec)) != NO_NEEDS
    }
    assert declared == EXPECTED[policy.name]


@pytest.mark.parametrize("policy", DEFAULT_POLICIES, ids=lambda p: p.name)
def test_the_sensor_reads_exactly_what_a_policy_declares(
    agent: Agent, policy: Policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With this one policy in use, a lean read of each workload reads cpu.stat and the
    files the policy (and the job reaper) declared, nothing more, and what it reads of
    them is fresh."""
    agent.rec.policies = (policy,)
    assignments, managed = claimed(agent)
    needs = agent.rec.needs(assignments, managed)
    assert by_name(needs) == union(EXPECTED[policy.name], REAPER)

    sensor = Sensor(agent.rec.tree, NodeSensor(), verify_every=3600)
    sensor.snapshot(managed, 0.0, 0.0, needs=needs)  # the first read is full
    for name in WORKLOADS:  # changed since: only a fresh read sees it
        d = Path(agent.rec.tree.root) / SLICE / name
        (d / "cgroup.events").write_text("populated 0\nfrozen 0\n")
        (d / "cgroup.threads").write_text("11\n12\n13\n")
        (d / "cpu.pressure").write_text("some avg10=9.00 avg60=0.50 avg300=0.10 total=99\n")
        (d / "memory.current").write_text("8192\n")
    read: list[tuple[str, str]] = []
    count_reads(monkeypatch, lambda d, name: read.append((d.path.removeprefix(f"{SLICE}/"), name)))
    snap = sensor.snapshot(managed, 1.0, 1.0, needs=needs)
    wanted = by_name(needs)
    for w in snap.workloads:
        name = w.identity.name
        need = wanted.get(name, NO_NEEDS)
        assert {f for p, f in read if p == name} == {"cpu.stat", *files(need)}, name
        s = w.sample
        assert (s.populated is False) == need.events, name
        assert (s.threads == 3) == need.threads, name
        assert (s.cpu_psi is not None and s.cpu_psi.some.avg10 == 9.0) == need.pressure, name
        assert (s.memory_current == 8192) == need.memory, name


def test_the_loop_reads_the_union_of_what_the_policies_declare(agent: Agent) -> None:
    """The same as before the policies declared it: a deadline job's processes, threads
    and pressure; a protected or reserved class's pressure; an exec job's processes; and
    memory.current while a memory.max is held back."""
    assignments, managed = claimed(agent)
    needs = by_name(agent.rec.needs(assignments, managed, frozenset({f"{SLICE}/batch-a"})))
    assert needs == union(*EXPECTED.values(), REAPER, {"batch-a": Needs(memory=True)})
    assert needs == {
        "deadline-a": Needs(events=True, pressure=True, threads=True),
        "infer-a": Needs(pressure=True),
        "reserved-a": Needs(pressure=True),
        "batch-a": Needs(memory=True),
        "job-a": Needs(events=True),
    }


def test_a_deadline_job_a_rule_claims_is_read_for_its_processes_every_tick(agent: Agent) -> None:
    """A rule's deadline job is 'waiting' until it holds a process: cgroup.events must be
    read every tick, or it stays waiting (and its threads uncounted) until its next full
    read, while the earlier deadlines are planned without it (seen in the VM)."""
    assignments, managed, *_ = agent.rec.claimed(agent.rec.registry.identities(), {})
    needs = agent.rec.needs(assignments, managed)
    assert needs[f"{SLICE}/deadline-a"] == Needs(events=True, pressure=True, threads=True)


class Wants(Policy):
    """A policy the loop has never heard of: reads memory.current of batch workloads,
    and is stale while its carry says so or a workload uses a CPU."""

    name = "wants"
    reads = Reads(carry=True, at_work=frozenset({"busy"}))

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        return ()

    def needs(self, assignment: Assignment, spec: PolicySpec) -> Needs:
        return Needs(memory=assignment.workload_class is WorkloadClass.BATCH)

    def stale_sensed(
        self,
        workloads: Sequence[WorkloadState],
        spec: PolicySpec,
        assignments: Mapping[str, Assignment],
    ) -> bool:
        return any((w.cpu_rate or 0.0) >= 1 for w in workloads)


def test_the_loop_knows_no_policy_by_name(agent: Agent) -> None:
    """Without policies the loop reads only what the reaper and the executor need, and
    no carried state nor deadline makes the plan stale; a new policy is heard at once."""
    assignments, managed = claimed(agent)
    agent.rec.feedback = replace(
        agent.rec.feedback,
        carry={"protection": {"caps": {"batch": 1.0}, "frozen": ["x"]}, "wants": {}},
    )
    agent.rec.policies = ()
    assert by_name(agent.rec.needs(assignments, managed)) == REAPER
    assert not at_work(agent.rec.policies, agent.rec.feedback.carry)

    agent.rec.policies = (Wants(),)
    agent.rec.forget_derived()
    assert by_name(agent.rec.needs(assignments, managed)) == union(
        REAPER, {n: Needs(memory=True) for n in ("deadline-a", "batch-a", "job-a")}
    )
    assert not at_work(agent.rec.policies, agent.rec.feedback.carry)
    carry = {**agent.rec.feedback.carry, "wants": {"busy": True}}
    agent.rec.feedback = replace(agent.rec.feedback, carry=carry)
    assert at_work(agent.rec.policies, agent.rec.feedback.carry)
    busy = WorkloadState(managed[0], CgroupSample(), cpu_rate=2.0)
    assert PlanCache()._sensed((busy,), agent.rec.spec, agent.rec.policies, assignments)[1]
    assert not PlanCache()._sensed(
        (WorkloadState(managed[0], CgroupSample(), cpu_rate=0.5),),
        agent.rec.spec,
        agent.rec.policies,
        assignments,
    )[1]

    agent.rec.policies = (Protection(), Deadlines())
    agent.rec.feedback = replace(agent.rec.feedback, carry={"protection": {"caps": {"batch": 1.0}}})
    assert at_work(agent.rec.policies, agent.rec.feedback.carry)


FORBIDDEN_NAMES = {"stall", "deadline", "protect", "reserved_cpu", "protection", "startswith"}
FORBIDDEN_STRINGS = {"protection", "caps", "frozen", "uncap", "thaw", "deadlines"}


@pytest.mark.parametrize(
    "code",
    [Reconciler.needs, Reconciler.tick, at_work, PlanCache._sensed, PlanCache.plan, PlanCache.key],
    ids=lambda f: f.__qualname__,
)
def test_the_loop_holds_no_policy_specific_code(code: Callable[..., object]) -> None:
    """What reads or re-plans for a policy only iterates over the policies: no policy's
    name, carried key, class setting or rule-name prefix is left in it (docstrings aside)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    (fn,) = tree.body
    assert isinstance(fn, ast.FunctionDef)
    body = fn.body[1:] if ast.get_docstring(fn) else fn.body
    names, strings = set(), set()
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
    assert not names & FORBIDDEN_NAMES
    assert not strings & FORBIDDEN_STRINGS
    assert not any(s.startswith("exec:") for s in strings)


def stalled(
    avg10: float | None, cpu_stall: float | None = None, name: str = "infer-a"
) -> WorkloadState:
    psi = None if avg10 is None else Psi(PsiLine(avg10, 0.0, 0.0, 0), None)
    identity = WorkloadIdentity(
        f"{SLICE}/{name}", Kind.JOB, Runtime.NODEAGENT, Owner.NODEAGENT, name
    )
    return WorkloadState(identity, CgroupSample(cpu_psi=psi), cpu_stall=cpu_stall)


def test_a_cgroup_stalling_past_half_the_threshold_makes_the_plan_stale(agent: Agent) -> None:
    """Where the controller's calm ends (half of protection.cpu_pressure, 0.10 here), as
    the loop checked before; a cgroup whose pressure is not read does not count."""
    spec, protection = agent.rec.spec, Protection()
    assignments, _ = claimed(agent)
    assert protection.stale_sensed([stalled(5.0)], spec, assignments)
    assert protection.stale_sensed([stalled(0.0, cpu_stall=0.05)], spec, assignments)
    assert not protection.stale_sensed([stalled(4.9)], spec, assignments)
    assert not protection.stale_sensed([stalled(None, cpu_stall=0.9)], spec, assignments)


@pytest.mark.parametrize("name", ["batch-a", "job-a", "unassigned"])
def test_a_stall_the_controller_does_not_watch_keeps_the_plan(agent: Agent, name: str) -> None:
    """On a node whose CPUs are all taken every cgroup stalls: only those the protection
    watches (a protected class, a floor) make the plan stale, or a busy node would plan
    anew at every tick (bench tick, busy mode)."""
    spec, protection = agent.rec.spec, Protection()
    assignments, _ = claimed(agent)
    assert protection.stale_sensed([stalled(50.0, cpu_stall=0.9)], spec, assignments)
    assert not protection.stale_sensed([stalled(50.0, cpu_stall=0.9, name=name)], spec, assignments)


@pytest.mark.parametrize("key", ["caps", "frozen", "uncap", "thaw"])
def test_the_protection_controller_at_work_makes_the_plan_stale(key: str) -> None:
    carried: dict[str, object] = {"caps": {}, "frozen": [], "uncap": [], "thaw": [], "calm": 3}
    assert not at_work((Protection(),), {"protection": carried})
    carried[key] = {"batch": 1.0} if key == "caps" else ["x"]
    assert at_work((Protection(),), {"protection": carried})


@pytest.mark.parametrize("policy", DEFAULT_POLICIES, ids=lambda p: p.name)
def test_a_policy_at_rest_keeps_the_plan(agent: Agent, policy: Policy) -> None:
    """No deadline job, nothing carried, nothing stalling: no policy asks for a new plan."""
    assignments, _ = claimed(agent)
    plain = {p: a for p, a in assignments.items() if a.deadline is None}
    assert not at_work((policy,), {})
    assert not PlanCache()._sensed((), agent.rec.spec, (policy,), plain)[1]


def test_a_deadline_job_makes_the_plan_stale(agent: Agent) -> None:
    """Deadlines reads the wall clock (`Reads`: wall_time) against the jobs it reads every
    tick (`needs`): a new plan every tick while there is one."""
    assignments, _ = claimed(agent)
    spec, plain = agent.rec.spec, {p: a for p, a in assignments.items() if a.deadline is None}
    assert PlanCache()._sensed((), spec, (Deadlines(),), assignments)[1]
    assert not PlanCache()._sensed((), spec, (Deadlines(),), plain)[1]
