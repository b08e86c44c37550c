"""Per-cgroup error isolation, applied by the pipeline to every policy (issue 14, item 4):
a policy that raises on one bad cgroup skips only that cgroup, and the others still get
its decisions in the same plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from builders import job, plan_claimed, snapshot, spec, workload

from nodeagent.cgroupfs.values import Attribute, CpuMax
from nodeagent.policy.base import Assignment, Decision, Floor, Policy, PolicyInput
from nodeagent.policy.newcomer import plan_newcomers
from nodeagent.policy.plan import CgroupPlan, Plan, make_plan
from nodeagent.policyfile.model import Limits, WorkloadClass
from nodeagent.snapshot import CgroupSample, WorkloadState

NOW = 1_700_000_000.0
GOOD, BAD = "nodeagent.slice/a-good", "nodeagent.slice/a-bad"


def by_path(plan: Plan) -> dict[str, CgroupPlan]:
    return {cg.path: cg for cg in plan.cgroups}


def deadline_job(path: str, cpu_usage_us: int) -> WorkloadState:
    sample = CgroupSample(populated=True, cpu_usage_us=cpu_usage_us, threads=1)
    return WorkloadState(job(path), sample, 1.0)


def test_a_real_policy_raising_on_one_cgroup_skips_only_that_cgroup() -> None:
    """Deadlines, a real policy, on two deadline jobs, one of which reads a usage too large
    for a float (cpu.stat's usage_usec is read as an unbounded int): its progress
    arithmetic raises OverflowError on that job alone. Before the pipeline isolated errors,
    Deadlines was left out of the tick for both (`policy deadlines failed, left out this
    tick`), and the good job lost its floor and its deadline note."""
    snap = snapshot([deadline_job(GOOD, 0), deadline_job(BAD, 10**400)], wall_time=NOW)
    due = Assignment("exec:train", "a", WorkloadClass.TRAINING, deadline=NOW + 100, work=60)
    plan = make_plan(snap, spec({"a": 1}), {}, assignments={GOOD: due, BAD: due})

    assert plan.problems == (), "deadlines is not left out as a whole"
    cgs = by_path(plan)
    assert cgs[BAD].skipped == (
        "deadlines: rule exec:train: OverflowError: int too large to convert to float"
    )
    assert cgs[BAD].targets == {}, "no partial plan for the skipped cgroup"
    good = cgs[GOOD]
    assert good.skipped is None
    assert [n.kind for n in good.notes] == ["deadline"], "deadlines still reports the good job"
    assert good.notes[0].status == "on-track"
    assert any(line.startswith("deadlines: ") for line in good.trace)
    assert good.targets[Attribute.CPU_WEIGHT].policy == "cpu-weights"
    assert any("floor from deadlines" in line for line in good.trace), "its floor holds"


@dataclass
class FailsOn(Policy):
    """TEST POLICY, not a real one: caps every assigned cgroup, and raises (as a bug
    would) whenever a cgroup in `bad` is in its input, or when all of `together` are. It
    counts its runs, to check that isolation costs a bounded number of them."""

    bad: frozenset[str] = frozenset()
    together: frozenset[str] = frozenset()
    name: str = "fails-on"
    runs: int = field(default=0, init=False)
    writes = frozenset({Attribute.CPU_MAX})

    def decide(self, given: PolicyInput) -> Sequence[Decision]:
        self.runs += 1
        paths = set(given.assignments)
        if hit := sorted(paths & self.bad):
            raise KeyError(hit[0])
        if self.together and self.together <= paths:
            raise RuntimeError("only together")
        return [Decision(p, Attribute.CPU_MAX, CpuMax(50_000), self.name, "capped") for p in paths]


def paths(n: int) -> list[str]:
    return [f"nodeagent.slice/a-{i:03d}" for i in range(n)]


def test_any_policy_is_isolated_with_a_bounded_number_of_runs() -> None:
    all_ = paths(64)
    bad = frozenset({all_[5], all_[40]})
    policy = FailsOn(bad)
    plan = plan_claimed(snapshot([workload(p) for p in all_]), spec({"a": 1}), {}, [policy])
    cgs = by_path(plan)
    assert plan.problems == ()
    for p in all_:
        if p in bad:
            assert cgs[p].skipped == f"fails-on: rule a-jobs: KeyError: '{p}'"
            assert cgs[p].targets == {}
        else:
            assert cgs[p].skipped is None
            assert cgs[p].targets[Attribute.CPU_MAX].policy == "fails-on"
    # the whole, the empty input, two halves per level for each bad cgroup, the rerun
    assert policy.runs <= 1 + 1 + 2 * 2 * 6 + 1


def test_a_policy_that_fails_without_any_cgroup_is_left_out_whole() -> None:
    @dataclass
    class Always(Policy):  # TEST POLICY: fails on every input
        name: str = "always"

        def decide(self, given: PolicyInput) -> Sequence[Decision]:
            raise ZeroDivisionError("division by zero")

    plan = plan_claimed(snapshot([workload(p) for p in paths(3)]), spec({"a": 1}), {}, [Always()])
    assert plan.problems == (
        "policy always failed, left out this tick: ZeroDivisionError: division by zero",
    )
    assert all(cg.skipped is None for cg in plan.cgroups)


def test_a_policy_that_fails_only_on_cgroups_together_is_left_out_whole() -> None:
    """No single cgroup can be blamed: the policy is left out as before, named in the
    plan's problems, rather than skipping cgroups that plan fine on their own."""
    all_ = paths(4)
    policy = FailsOn(together=frozenset({all_[0], all_[3]}))
    plan = plan_claimed(snapshot([workload(p) for p in all_]), spec({"a": 1}), {}, [policy])
    assert plan.problems == (
        "policy fails-on failed, left out this tick: RuntimeError: only together",
    )
    assert all(cg.skipped is None and cg.targets == {} for cg in plan.cgroups)


def test_the_failing_cgroup_is_removed_from_what_earlier_policies_said() -> None:
    """The rerun sees the input as if the bad cgroup were not there at all: not in the
    snapshot, not assigned, and no earlier output about it."""
    seen: list[PolicyInput] = []

    @dataclass
    class Records(Policy):  # TEST POLICY: raises on BAD, records the input it planned
        name: str = "records"

        def decide(self, given: PolicyInput) -> Sequence[Decision]:
            if BAD in given.assignments:
                raise ValueError("bad")
            seen.append(given)
            return []

    @dataclass
    class Floors(Policy):  # TEST POLICY: a floor for every assigned cgroup
        name: str = "floors"

        def decide(self, given: PolicyInput) -> Sequence[Floor]:
            return [Floor(p, 1.0, self.name, "r") for p in sorted(given.assignments)]

    snap = snapshot([workload(GOOD), workload(BAD)])
    plan = plan_claimed(snap, spec({"a": 1}), {}, [Floors(), Records()])
    assert by_path(plan)[BAD].skipped == "records: rule a-jobs: ValueError: bad"
    last = seen[-1]
    assert [w.path for w in last.snapshot.workloads] == [GOOD]
    assert set(last.assignments) == {GOOD}
    assert [o.path for o in last.earlier if isinstance(o, Floor)] == [GOOD]


def test_the_fast_path_skips_a_newcomer_static_limits_cannot_plan() -> None:
    """StaticLimits has no isolation of its own any more: on the fast path too, the
    pipeline's skips the one newcomer it cannot plan, and caps the other."""
    limited = Assignment("a-jobs", "a", WorkloadClass.BATCH, Limits(cpu_max=0.5))
    node = snapshot([]).node
    broken = Assignment("a-jobs", "a", WorkloadClass.BATCH)
    object.__setattr__(broken, "limits", None)  # a bug: no Limits at all
    plan, _ = plan_newcomers(
        [job(GOOD), job(BAD)],
        {GOOD: limited, BAD: broken},
        spec({"a": 1}),
        siblings=None,
        node=node,
        wall_time=NOW,
    )
    cgs = by_path(plan)
    assert (cgs[BAD].skipped or "").startswith("static-limits: rule a-jobs: AttributeError")
    assert cgs[BAD].targets == {}
    assert cgs[GOOD].targets[Attribute.CPU_MAX].value == CpuMax(50_000)
