"""Hand-built snapshots, workloads, policies and fixture cgroup trees for the unit tests."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.identity import Kind, Owner, QosTier, Runtime, WorkloadIdentity
from nodeagent.policy.base import Assignment, Policy, PolicyInput
from nodeagent.policy.classify import assign
from nodeagent.policy.plan import DEFAULT_POLICIES, Plan, make_plan
from nodeagent.policyfile.model import PolicySpec
from nodeagent.snapshot import CgroupSample, NodeSnapshot, NodeState, WorkloadState

CID = "4f1c2a9be7d3" + "0123456789abcdef" * 3 + "0123"  # 64 lowercase hex
CID2 = "9a8b7c6d5e4f" + "fedcba9876543210" * 3 + "3210"
POD_UID = "3b1e5f2a-9c4d-4e7f-8a6b-0d2c1e9f7a35"
POD = f"kubepods/burstable/pod{POD_UID}"
CGROUP_FILES = {
    "cgroup.procs": "",
    "cgroup.events": "populated 1\nfrozen 0\n",
    "cpu.stat": "usage_usec 100\nuser_usec 60\nsystem_usec 40\n",
    "cpu.weight": "100\n",
    "cpu.max": "max 100000\n",
    "memory.current": "4096\n",
    "memory.max": "max\n",
}
"""A busy cgroup's interface files, for an agent's real tick over a fixture tree (the files
a sensor reads and the executor writes)."""


def pod_tree(root: Path, *paths: str, files: Mapping[str, str] = CGROUP_FILES) -> CgroupTree:
    """A fixture tree at `root` as the kubelet's cgroupfs driver lays out pods: kubepods,
    its burstable tier and `paths` (pods and their containers), each holding `files`."""
    for path in ["kubepods", "kubepods/burstable", *paths]:
        d = root / path
        d.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (d / name).write_text(text)
    return CgroupTree(str(root))


def one_tenant(tmp_path: Path, rules: Iterable[Mapping[str, Any]]) -> PolicySpec:
    """A policy of `rules`, all for tenant `a`, its state file in `tmp_path`."""
    return PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"state_file": str(tmp_path / "state.json")},
            "tenants": {"a": {"shares": 1}},
            "rules": list(rules),
        }
    )


def job(path: str, name: str | None = None) -> WorkloadIdentity:
    """A job in nodeagent's own subtree."""
    return WorkloadIdentity(
        path, Kind.JOB, Runtime.NODEAGENT, Owner.NODEAGENT, name or path.rsplit("/", 1)[-1]
    )


def docker(cid: str = CID) -> WorkloadIdentity:
    return WorkloadIdentity(
        f"system.slice/docker-{cid}.scope",
        Kind.CONTAINER,
        Runtime.DOCKER,
        Owner.SYSTEMD,
        cid[:12],
        container_id=cid,
    )


def docker_cgroupfs(cid: str = CID) -> WorkloadIdentity:
    """A docker container under the cgroupfs driver: written directly."""
    return WorkloadIdentity(
        f"docker/{cid}", Kind.CONTAINER, Runtime.DOCKER, Owner.CGROUPFS, cid[:12], container_id=cid
    )


def k8s_container(cid: str = CID2, qos: QosTier = QosTier.BURSTABLE) -> WorkloadIdentity:
    return WorkloadIdentity(
        f"kubepods/{qos}/pod{POD_UID}/{cid}",
        Kind.CONTAINER,
        Runtime.CONTAINERD,
        Owner.CGROUPFS,
        cid[:12],
        container_id=cid,
        pod_uid=POD_UID,
        qos=qos,
    )


def service(unit: str) -> WorkloadIdentity:
    return WorkloadIdentity(
        f"system.slice/{unit}", Kind.SERVICE, Runtime.SYSTEMD, Owner.SYSTEMD, unit
    )


def workload(
    who: WorkloadIdentity | str,
    cpu_rate: float | None = 1.0,
    populated: bool | None = True,
) -> WorkloadState:
    identity = job(who) if isinstance(who, str) else who
    return WorkloadState(identity, CgroupSample(populated=populated), cpu_rate)


def snapshot(
    workloads: Iterable[WorkloadState],
    elapsed: float | None = 1.0,
    page_size: int = 4096,
    seq: int = 7,
    wall_time: float = 1_700_000_000.0,
) -> NodeSnapshot:
    node = NodeState(
        cpu_count=8,
        cpu_busy=0.5,
        memory_total=64 << 30,
        memory_available=32 << 30,
        page_size=page_size,
    )
    return NodeSnapshot(seq, wall_time, elapsed, node, tuple(workloads))


def spec(
    tenants: Mapping[str, float],
    rules: Iterable[Mapping[str, Any]] = (),
    **fair_share: Any,
) -> PolicySpec:
    """A PolicySpec; without rules, each tenant T claims nodeagent.slice/T-*."""
    rule_list = list(rules) or [
        {"name": f"{t}-jobs", "match": {"path": f"nodeagent.slice/{t}-*"}, "tenant": t}
        for t in tenants
    ]
    return PolicySpec.model_validate(
        {
            "version": 1,
            "tenants": {t: {"shares": s} for t, s in tenants.items()},
            "rules": rule_list,
            "fair_share": fair_share,
        }
    )


def claimed(snap: NodeSnapshot, policy: PolicySpec) -> dict[str, Assignment]:
    """The workloads `policy`'s rules claim, as the loop classifies them before it plans
    (levels are only weighted)."""
    return assign((w.identity for w in snap.workloads), policy)


def plan_claimed(
    snap: NodeSnapshot,
    policy: PolicySpec,
    usage: Mapping[str, float],
    policies: Sequence[Policy] = DEFAULT_POLICIES,
    **kw: Any,
) -> Plan:
    """make_plan over the workloads `policy`'s rules claim (`claimed`)."""
    return make_plan(snap, policy, usage, policies, assignments=claimed(snap, policy), **kw)


def policy_input(
    snap: NodeSnapshot, policy: PolicySpec, usage: Mapping[str, float] | None = None
) -> PolicyInput:
    return PolicyInput(snap, policy, claimed(snap, policy), dict(usage or {}))


def thawed_tree(root: Path, paths: list[str], procs: dict[str, str] | None = None) -> CgroupTree:
    """`paths` and their ancestors as cgroups, thawed, uncapped, of weight 100, with
    cgroup.procs empty unless `procs` says otherwise."""
    every = {""} | {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 2)}
    for path in sorted(every):
        d = root / path
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.procs").write_text((procs or {}).get(path, "") + "\n")
        (d / "cgroup.freeze").write_text("0\n")
        (d / "cpu.max").write_text("max 100000\n")
        (d / "cpu.weight").write_text("100\n")
    return CgroupTree(str(root))


def proc_self(root: Path, cgroup: str) -> str:
    """A /proc whose self/cgroup says the agent runs in `cgroup` ('/': a namespace's root)."""
    (root / "self").mkdir(parents=True)
    (root / "self" / "cgroup").write_text(f"0::/{cgroup.strip('/')}\n")
    return str(root)
