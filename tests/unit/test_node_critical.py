"""What keeps the node running is never lowered, capped or frozen (issue 35, item 1): the
pods of `kubernetes.node_critical` (kube-system's, and those of a system priority class, by
default). Classification names them (`Assignment.node_critical`), the protection controller
never takes them as victims, and the plan drops whatever would tighten them, from any
policy, with a trace line; what loosens them (a thaw, a cap lifted) still goes ahead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import structlog
from builders import k8s_container, proc_self, snapshot, thawed_tree

from nodeagent.act import Executor, Outcome
from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight, Frozen, Value
from nodeagent.identity import Kind, WorkloadIdentity
from nodeagent.kube.owners import PodView, node_critical
from nodeagent.kube.pods import Pod, PodDirectory
from nodeagent.meta import ContainerMeta, PodMeta, labels
from nodeagent.policy.base import Assignment, Decision, Output, PolicyInput
from nodeagent.policy.classify import assign
from nodeagent.policy.plan import CgroupPlan, Plan, Target, make_plan
from nodeagent.policy.plan import node_critical as plan_node_critical
from nodeagent.policy.protection import Protection
from nodeagent.policy.reads import Reads
from nodeagent.policyfile.load import check_text
from nodeagent.policyfile.model import NodeCriticalSettings, PolicySpec
from nodeagent.report import describe
from nodeagent.selfguard import SelfGuard
from nodeagent.snapshot import CgroupSample, WorkloadState

DEFAULTS = NodeCriticalSettings()


def view(namespace: str, priority: int | None = None) -> PodView:
    return PodView(namespace, "p", labels({}), labels({}), priority)


def test_kube_system_and_system_priorities_are_node_critical_by_default() -> None:
    assert node_critical(view("kube-system"), DEFAULTS) == (
        "node-critical: pod kube-system/p is in namespace kube-system ('kube-system')"
    )
    assert node_critical(view("gpu-operator", 2_000_001_000), DEFAULTS) == (
        "node-critical: pod gpu-operator/p has priority 2000001000 (at least 2000000000)"
    )
    assert node_critical(view("gpu-operator", 1_000_000), DEFAULTS) is None
    assert node_critical(view("default"), DEFAULTS) is None
    none = NodeCriticalSettings(namespaces=(), min_priority=None)
    assert node_critical(view("kube-system", 2_000_001_000), none) is None
    mine = NodeCriticalSettings(namespaces=("kube-*", "nodeagent"), min_priority=None)
    assert node_critical(view("kube-flannel"), mine) is not None


POLICY = PolicySpec.model_validate(
    {
        "version": 1,
        "tenants": {"a": {"shares": 1}},
        "classes": {"batch": {"floor_cpu": 0.2}},
        "protection": {"cpu_pressure": 0.1, "step": 0.5, "calm_ticks": 2, "freeze_after": 2},
        "rules": [
            {"name": "serve", "match": {"labels": {"app": "serve"}}, "tenant": "a",
             "class": "inference"},
            {"name": "pods", "match": {"kind": "container", "path": "kubepods*"},
             "tenant": "a", "class": "batch"},
        ],
    }
)  # fmt: skip


def container(cid: str, namespace: str, app: str = "x") -> WorkloadIdentity:
    """A container of a pod in `namespace`, as CRI named it (pod uid from the cid)."""
    base = k8s_container(cid)
    uid = f"uid-{cid[:4]}"
    pod = PodMeta(namespace, f"pod-{cid[:4]}", uid)
    meta = ContainerMeta("containerd", "c", labels={"app": app}, pod=pod)  # type: ignore[arg-type]
    return replace(base, path=f"kubepods/burstable/pod{uid}/{cid}", pod_uid=uid, meta=meta)


PROXY = container("a" * 64, "kube-system")
BATCH = container("b" * 64, "research")
SERVE = container("c" * 64, "prod", app="serve")


def test_classification_names_node_critical_pods_whatever_the_rule() -> None:
    """The rule here is not a Kubernetes one (no tenant_from or class_from): the pod is
    node-critical all the same, by its namespace or by its priority through the watch."""
    got = assign([PROXY, BATCH], POLICY)
    assert "kube-system/pod-aaaa" in (got[PROXY.path].node_critical or "")
    assert got[BATCH.path].node_critical is None
    assert BATCH.pod_uid is not None
    watched = PodDirectory({BATCH.pod_uid: Pod(BATCH.pod_uid, "research", "pod-bbbb",
                                               priority=2_000_001_000)})  # fmt: skip
    got = assign([BATCH], POLICY, watched)
    assert got[BATCH.path].node_critical == (
        "node-critical: pod research/pod-bbbb has priority 2000001000 (at least 2000000000)"
    )


def tick(
    carried: Mapping[str, Mapping[str, object]],
    stall: float = 0.5,
    frozen: Sequence[WorkloadIdentity] = (),
) -> Plan:
    """One tick on 4 CPUs: the inference container stalls, kube-proxy's and the batch
    pod's containers (both class batch) each use 1.6 cores, kube-proxy the more."""
    states = []
    for who, rate, s in ((SERVE, 0.5, stall), (PROXY, 1.7, 0.0), (BATCH, 1.6, 0.0)):
        settings: dict[Attribute, Value] = {Attribute.CPU_MAX: CpuMax(None, 100000)}
        settings[Attribute.FREEZE] = Frozen(who in frozen)
        sample = CgroupSample(populated=True, cpu_usage_us=1, settings=settings)
        states.append(WorkloadState(who, sample, rate, 0.0, s))
    snap = snapshot(states)
    snap = replace(snap, node=replace(snap.node, cpu_count=4))
    assigned = assign([SERVE, PROXY, BATCH], POLICY)
    return make_plan(snap, POLICY, {}, [Protection()], assignments=assigned, carried=carried)


def targets(plan: Plan, who: WorkloadIdentity) -> dict[Attribute, Value]:
    cg = next(c for c in plan.cgroups if c.path == who.path)
    return {a: t.value for a, t in cg.targets.items()}


def test_protection_caps_and_freezes_the_batch_pod_never_kube_system() -> None:
    carried: Mapping[str, Mapping[str, object]] = {}
    capped, frozen = set(), set()
    for _ in range(12):
        plan = tick(carried)
        carried = plan.carry
        assert Attribute.CPU_MAX not in targets(plan, PROXY), "kube-proxy is never capped"
        assert Attribute.FREEZE not in targets(plan, PROXY), "nor frozen"
        cap = targets(plan, BATCH).get(Attribute.CPU_MAX)
        if isinstance(cap, CpuMax) and cap.cores is not None:
            capped.add(BATCH.path)
        if targets(plan, BATCH).get(Attribute.FREEZE) == Frozen(True):
            frozen.add(BATCH.path)
    assert capped == {BATCH.path}, "the batch pod is capped"
    assert frozen == {BATCH.path}, "and frozen, though kube-proxy is the busier"


def test_a_pod_frozen_before_it_was_node_critical_is_thawed_at_once() -> None:
    """A reload that makes a frozen pod node-critical (or a new priority): the controller
    lets go of it at the next tick, under pressure or not."""
    carried = {"protection": {"frozen": [PROXY.path], "capped": [PROXY.path]}}
    plan = tick(carried, frozen=[PROXY])
    assert targets(plan, PROXY)[Attribute.FREEZE] == Frozen(False)
    assert PROXY.path not in plan.carry["protection"]["frozen"]  # type: ignore[operator]


class Tighten:
    """A stand-in policy that caps, freezes and lowers the weight of every workload, and
    thaws the ones frozen now: what any policy might plan."""

    name = "tighten"
    writes = frozenset({Attribute.CPU_MAX, Attribute.CPU_WEIGHT, Attribute.FREEZE})
    device_settings: frozenset[str] = frozenset()
    reads = Reads(snapshot=frozenset({"levels"}), workload=frozenset({"settings"}))

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        out: list[Output] = []
        for w in (*given.snapshot.workloads, *given.snapshot.levels):
            frozen = w.sample.settings.get(Attribute.FREEZE) == Frozen(True)
            out += [
                Decision(w.path, Attribute.CPU_MAX, CpuMax(10000, 100000), self.name, "cap"),
                Decision(w.path, Attribute.CPU_WEIGHT, CpuWeight(1), self.name, "lower"),
                Decision(w.path, Attribute.FREEZE, Frozen(not frozen), self.name, "flip"),
            ]
        return out

    def needs(self, *_: object) -> object:
        raise AssertionError("not asked in make_plan")


class KeepFrozen:
    """A stand-in policy that plans kube-proxy frozen (a GPU check, say)."""

    name = "keep"
    writes = frozenset({Attribute.FREEZE})
    device_settings: frozenset[str] = frozenset()
    reads = Reads()

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        return [Decision(PROXY.path, Attribute.FREEZE, Frozen(True), self.name, "frozen")]


def test_the_plan_drops_what_would_tighten_a_node_critical_pod_from_any_policy() -> None:
    """Its containers' and its own cgroup's: caps, lower weights and freezes are dropped
    with a trace line each; a thaw of one frozen now goes ahead, and another pod is
    tightened as planned."""
    pod_cgroup = WorkloadIdentity(
        PROXY.path.rsplit("/", 1)[0], Kind.POD, PROXY.runtime, PROXY.owner, "pod",
        pod_uid=PROXY.pod_uid,
    )  # fmt: skip
    now: dict[Attribute, Value] = {
        Attribute.CPU_MAX: CpuMax(None, 100000),
        Attribute.CPU_WEIGHT: CpuWeight(100),
        Attribute.FREEZE: Frozen(False),
    }
    states = [
        WorkloadState(PROXY, CgroupSample(True, settings={**now, Attribute.FREEZE: Frozen(True)})),
        WorkloadState(BATCH, CgroupSample(True, settings=now)),
    ]
    snap = replace(
        snapshot(states), levels=(WorkloadState(pod_cgroup, CgroupSample(True, settings=now)),)
    )
    assigned = assign([PROXY, BATCH], POLICY)
    plan = make_plan(snap, POLICY, {}, [Tighten()], assignments=assigned)  # type: ignore[list-item]
    assert targets(plan, PROXY) == {Attribute.FREEZE: Frozen(False)}, "only its thaw"
    assert targets(plan, pod_cgroup) == {}, "its pod's own cgroup is spared too"
    assert targets(plan, BATCH) == {
        Attribute.CPU_MAX: CpuMax(10000, 100000),
        Attribute.CPU_WEIGHT: CpuWeight(1),
        Attribute.FREEZE: Frozen(True),
    }
    trace = next(c for c in plan.cgroups if c.path == PROXY.path).trace
    dropped = [line for line in trace if "is not planned" in line]
    assert len(dropped) == 2, trace
    assert dropped[0].startswith("node-critical: pod kube-system/pod-aaaa is in namespace")
    # a freeze planned for it while it is frozen (made before it was node-critical) is a thaw
    plan = make_plan(snap, POLICY, {}, [KeepFrozen()], assignments=assigned)  # type: ignore[list-item]
    assert targets(plan, PROXY) == {Attribute.FREEZE: Frozen(False)}
    assert "tighten's cpu.max 10000 100000 is not planned" in dropped[0]
    assert "never lowered, capped or frozen (kubernetes.node_critical)" in dropped[0]


KUBE = """version: 1
agent: {mode: kubernetes}
tenants: {a: {shares: 1}}
rules:
  - name: pods
    match: {kind: container}
    tenant: a
    class: CLASS
    class_from: {kubernetes: true}
"""


def warnings(text: str) -> list[str]:
    return [str(w) for w in check_text(text, "p.yaml").warnings]


def test_validate_warns_of_freezable_unannotated_pods_and_of_nothing_spared() -> None:
    assert warnings(KUBE.replace("CLASS", "batch")) == [
        "p.yaml:8:12: warning: rules[0]: a pod that names no class of its own gets class"
        " batch, which the protection controller may freeze (classes.batch.freezable: true):"
        " give the rule a class that is not freezable, so that only a pod that says so"
        " (nodeagent.io/class) may be frozen"
    ]
    assert warnings(KUBE.replace("CLASS", "batch") + "classes: {batch: {freezable: false}}\n") == []
    assert warnings(KUBE.replace("CLASS", "inference")) == []
    off = "protection: {enabled: false}\n"
    assert warnings(KUBE.replace("CLASS", "batch") + off) == [], "nothing is frozen"
    spared_none = "kubernetes: {node_critical: {namespaces: [], min_priority: null}}\n"
    assert warnings(KUBE.replace("CLASS", "inference") + spared_none) == [
        "p.yaml:10:29: warning: kubernetes.node_critical spares no pod: kube-system's"
        " (kube-proxy, the CNI, DNS, the GPU device plugin) may be capped and frozen like any"
        " other"
    ]
    host = KUBE.replace("agent: {mode: kubernetes}\n", "").replace("CLASS", "batch")
    assert warnings(host.replace("    class_from: {kubernetes: true}\n", "")) == []


def test_the_api_shows_why_a_workload_is_node_critical() -> None:
    got = assign([PROXY, BATCH], POLICY)
    assert describe(PROXY, got[PROXY.path])["node_critical"] == got[PROXY.path].node_critical
    assert describe(BATCH, got[BATCH.path])["node_critical"] is None


def test_the_executor_refuses_to_tighten_a_node_critical_pod_whatever_the_plan(
    tmp_path: Path,
) -> None:
    """A plan made again after the pod's values moved (the cache), or any plan at all:
    the one writer holds the line itself, logged once per cgroup; a thaw goes ahead."""
    cg = thawed_tree(tmp_path / "cg", [PROXY.path, BATCH.path])
    guard = SelfGuard(cg, proc_self(tmp_path / "proc", "system.slice/nodeagent.service"), pid=1)
    executor = Executor(cg, lambda *a: None, guard=guard)
    assigned = assign([PROXY, BATCH], POLICY)
    cap = {Attribute.CPU_MAX: Target(CpuMax(10000, 100000), "test", "cap")}
    plan = Plan(7, 1.0, tuple(CgroupPlan(w, assigned[w.path], cap, ()) for w in (PROXY, BATCH)), {})
    now: dict[Attribute, Value] = {Attribute.CPU_MAX: CpuMax(None, 100000)}
    snap = snapshot([WorkloadState(w, CgroupSample(True, settings=now)) for w in (PROXY, BATCH)])
    with structlog.testing.capture_logs() as logs:
        got = {r.path: (r.outcome, r.detail) for r in executor.apply(plan, snap)}
        executor.apply(plan, snap)
    assert got[BATCH.path] == (Outcome.WRITTEN, "")
    assert got[PROXY.path][0] is Outcome.READ_ONLY
    assert got[PROXY.path][1].endswith(
        "is in namespace kube-system ('kube-system'): what keeps the node running is never"
        " lowered, capped or frozen"
    )
    assert (tmp_path / "cg" / PROXY.path / "cpu.max").read_text() == "max 100000\n"
    said = [e for e in logs if e["event"] == "agent.node_critical_guarded"]
    assert [e["cgroup"] for e in said] == [PROXY.path], "said once"


def test_the_executor_looks_for_node_critical_pods_only_when_something_tightens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard costs a tick nothing when it writes nothing tighter (most ticks): the
    search over every cgroup of the plan is made only for a tightening write."""
    searched: list[int] = []

    def counted(
        identities: Sequence[WorkloadIdentity], assignments: Mapping[str, Assignment]
    ) -> dict[str, str]:
        searched.append(1)
        return plan_node_critical(identities, assignments)

    monkeypatch.setattr("nodeagent.act.node_critical", counted)
    cg = thawed_tree(tmp_path / "cg", [PROXY.path, BATCH.path])
    guard = SelfGuard(cg, proc_self(tmp_path / "proc", "system.slice/nodeagent.service"), pid=1)
    executor = Executor(cg, lambda *a: None, guard=guard)
    assigned = assign([PROXY, BATCH], POLICY)
    lifted = {Attribute.CPU_MAX: Target(CpuMax(None, 100000), "test", "lifted")}
    plan = Plan(
        7, 1.0, tuple(CgroupPlan(w, assigned[w.path], lifted, ()) for w in (PROXY, BATCH)), {}
    )
    now: dict[Attribute, Value] = {Attribute.CPU_MAX: CpuMax(20000, 100000)}
    snap = snapshot([WorkloadState(w, CgroupSample(True, settings=now)) for w in (PROXY, BATCH)])
    assert Outcome.READ_ONLY not in {r.outcome for r in executor.apply(plan, snap)}
    assert searched == [], "searched although nothing tightened"
    cap = {Attribute.CPU_MAX: Target(CpuMax(10000, 100000), "test", "cap")}
    plan = replace(plan, cgroups=tuple(replace(c, targets=cap) for c in plan.cgroups))
    executor.apply(plan, snap)
    assert searched == [1]
