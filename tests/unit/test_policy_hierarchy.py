"""Tenant shares across parents: parents are weighted by the targets below them, and
levels the agent may not write are reported with the split they cause."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from builders import (
    CGROUP_FILES,
    CID,
    CID2,
    POD_UID,
    docker_cgroupfs,
    job,
    k8s_container,
    snapshot,
    workload,
)

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute, CpuWeight
from nodeagent.daemon import open_agent
from nodeagent.ownership import WriteMode, classify_level, parent_identity, write_mode
from nodeagent.policy.base import Assignment
from nodeagent.policy.plan import CgroupPlan, make_plan
from nodeagent.policyfile.load import load_policy
from nodeagent.policyfile.model import AgentSettings, PolicySpec, WorkloadClass
from nodeagent.report import TickRecord
from nodeagent.snapshot import CgroupSample, WorkloadState

REPO = Path(__file__).resolve().parents[2]

POLICY = PolicySpec.model_validate(
    {"version": 1, "tenants": {"a": {"shares": 2}, "b": {"shares": 1}}}
)


def level(path: str, weight: int = 100) -> WorkloadState:
    sample = CgroupSample(settings={Attribute.CPU_WEIGHT: CpuWeight(weight)})
    return WorkloadState(parent_identity(path, "nodeagent.slice"), sample)


def weights(cgroups: dict[str, CgroupPlan]) -> dict[str, int]:
    out = {}
    for path, cg in cgroups.items():
        t = cg.targets.get(Attribute.CPU_WEIGHT)
        if t is not None:
            assert isinstance(t.value, CpuWeight)
            out[path] = t.value.value
    return out


def test_parents_carry_their_tenants_targets() -> None:
    """Tenant a (2 shares) in nodeagent.slice, tenant b's four containers in docker/: the
    two parents get 2:1, whatever the number of cgroups below each."""
    leaves = [workload("nodeagent.slice/a-1", None)] + [
        workload(docker_cgroupfs(c), None) for c in (CID, CID2, "cd" * 32, "ef" * 32)
    ]
    snap = replace(snapshot(leaves), levels=(level("nodeagent.slice"), level("docker")))
    assignments = {w.path: Assignment("r", "a" if "slice" in w.path else "b", WorkloadClass.BATCH)
                   for w in leaves}  # fmt: skip
    plan = make_plan(snap, POLICY, {}, assignments=assignments)
    w = weights({c.path: c for c in plan.cgroups})
    assert w["nodeagent.slice"] / w["docker"] == pytest.approx(2.0, rel=0.02)
    assert w["nodeagent.slice"] + w["docker"] == pytest.approx(200, abs=2)
    b = [w[docker_cgroupfs(c).path] for c in (CID, CID2)]
    assert b[0] == b[1] == 100, "inside docker/, b's four containers are equal"
    a1 = next(c for c in plan.cgroups if c.path == "nodeagent.slice/a-1")
    assert any(line.startswith("cpu-weights: level nodeagent.slice: weight") for line in a1.trace)
    (note,) = [n for n in plan.notes if n.kind == "hierarchy"]
    assert note.status == "holds"
    assert note.fields["planned"] == pytest.approx({"a": 2 / 3, "b": 1 / 3}, rel=0.02)


def test_a_read_only_level_is_reported_with_the_split_it_causes() -> None:
    """The kubelet's QoS tier is read-only by default: it keeps its weight 100 where the
    split needs less, and the note says how far off each tenant will be."""
    pod = f"kubepods/burstable/pod{POD_UID}"
    leaves = [workload("nodeagent.slice/a-1", None), workload(k8s_container(CID2), None)]
    levels = (level("nodeagent.slice"), level("kubepods"), level("kubepods/burstable"), level(pod))
    snap = replace(snapshot(leaves), levels=levels)
    assignments = {
        leaves[0].path: Assignment("r", "b", WorkloadClass.BATCH),
        leaves[1].path: Assignment("r", "a", WorkloadClass.BATCH),
    }
    plan = make_plan(snap, POLICY, {}, assignments=assignments)
    modes = {c.path: c.write for c in plan.cgroups}
    assert modes["kubepods"] is modes["kubepods/burstable"] is WriteMode.READ_ONLY
    assert modes[pod] is WriteMode.DIRECT
    (note,) = [n for n in plan.notes if n.kind == "hierarchy"]
    assert note.status == "distorted"
    assert note.fields["read_only_levels"] == ["kubepods", "kubepods/burstable"]
    expected, planned = note.fields["expected"], note.fields["planned"]
    assert isinstance(expected, dict) and isinstance(planned, dict)
    assert expected["a"] < planned["a"]


@pytest.mark.parametrize(
    ("path", "mode"),
    [
        ("nodeagent.slice", WriteMode.DIRECT),
        ("docker", WriteMode.DIRECT),
        ("kubepods", WriteMode.READ_ONLY),
        ("kubepods.slice/kubepods-burstable.slice", WriteMode.READ_ONLY),
        ("system.slice", WriteMode.SYSTEMD),
        ("somebody-elses", WriteMode.READ_ONLY),
    ],
)
def test_levels_are_written_by_their_owner(path: str, mode: WriteMode) -> None:
    assert write_mode(classify_level(path, "nodeagent.slice"), AgentSettings()) is mode


def test_without_the_hierarchy_only_workloads_are_weighted() -> None:
    flat_share = POLICY.fair_share.model_copy(update={"hierarchy": False})
    flat = POLICY.model_copy(update={"fair_share": flat_share})
    leaves = [workload("nodeagent.slice/a-1", None), workload(job("nodeagent.slice/b-1"), None)]
    snap = replace(snapshot(leaves), levels=(level("nodeagent.slice"),))
    assignments = {w.path: Assignment("r", w.path[16], WorkloadClass.BATCH) for w in leaves}
    w = weights({c.path: c for c in make_plan(snap, flat, {}, assignments=assignments).cgroups})
    assert set(w) == {"nodeagent.slice/a-1", "nodeagent.slice/b-1"}


# -- a rule that claims a pod and its containers (issue 13.12) --------------------------------


POD = f"kubepods/besteffort/pod{POD_UID}"


def besteffort_pod_tick(tmp_path: Path, spec: PolicySpec) -> TickRecord:
    """One dry-run tick over a fixture tree: a besteffort pod with two containers, and a
    prod job in the managed root."""
    tree = tmp_path / "cgroup"
    for path in [f"{POD}/{CID}", f"{POD}/{CID2}", f"{spec.agent.managed_root}/prod-1"]:
        (tree / path).mkdir(parents=True)
    for d, _, _ in os.walk(tree):
        for name, text in CGROUP_FILES.items():
            (Path(d) / name).write_text(text)
    state = str(tmp_path / "state.json")
    spec = spec.model_copy(update={"agent": spec.agent.model_copy(update={"state_file": state})})
    agent = open_agent(spec, CgroupTree(str(tree)), dry_run=True)
    agent.prepare()
    return agent.tick()


def planned_shares(record: TickRecord) -> dict[str, float]:
    (note,) = [n for n in record.plan.notes if n.kind == "hierarchy"]
    planned = note.fields["planned"]
    assert isinstance(planned, dict)
    assert sum(planned.values()) == pytest.approx(1.0, abs=0.02), note.message
    return planned


def test_the_shipped_policy_counts_a_besteffort_pod_once(tmp_path: Path) -> None:
    """Issue 13.12: config/policy.yaml's `qos: besteffort` rule claimed the pod and its
    containers, and planned tenant shares added up to 120-130%."""
    shipped = load_policy(str(REPO / "config/policy.yaml"))
    record = besteffort_pod_tick(tmp_path, shipped)
    claimed = {c.path for c in record.plan.cgroups if c.assignment is not None}
    job = f"{shipped.agent.managed_root}/prod-1"
    assert {f"{POD}/{CID}", f"{POD}/{CID2}", job} <= claimed
    assert planned_shares(record) == pytest.approx({"research": 2 / 3, "prod": 1 / 3}, abs=0.02)


def test_a_rule_claiming_a_pod_and_its_containers_counts_the_containers_only(
    tmp_path: Path,
) -> None:
    """The innermost claims are the tenant's: the pod is weighted as a parent carrying its
    containers' targets, not as a third workload of its own, and its CPU, which holds
    theirs, is not counted in the tenant's usage a second time."""
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "tenants": {"research": {"shares": 2}, "prod": {"shares": 1}},
            "rules": [
                {"name": "prod", "match": {"path": "nodeagent.slice/prod-*"}, "tenant": "prod"},
                {"name": "be", "match": {"qos": "besteffort"}, "tenant": "research"},
            ],
        }
    )
    record = besteffort_pod_tick(tmp_path, spec)
    claimed = {c.path for c in record.plan.cgroups if c.assignment is not None}
    assert {POD, f"{POD}/{CID}", f"{POD}/{CID2}"} <= claimed
    assert planned_shares(record) == pytest.approx({"research": 2 / 3, "prod": 1 / 3}, abs=0.02)
    w = weights({c.path: c for c in record.plan.cgroups})
    assert w[f"{POD}/{CID}"] == w[f"{POD}/{CID2}"]
    assert w["kubepods"] == pytest.approx(2 * w["nodeagent.slice"], rel=0.05), "2:1 at the top"
