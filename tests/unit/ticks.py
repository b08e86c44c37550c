"""Hand-built ticks for the metrics tests: workloads with every reading set, and
TickRecords whose plans the real policies make."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from builders import CID2, job, k8s_container, plan_claimed, snapshot

from nodeagent.act import Outcome, WriteResult
from nodeagent.cgroupfs.parse import Psi, PsiLine
from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight, Frozen, MemoryLimit, Value
from nodeagent.gpu.model import GpuState
from nodeagent.identity import WorkloadIdentity
from nodeagent.policy.classify import assign
from nodeagent.policy.plan import Target
from nodeagent.policyfile.model import PolicySpec, Rule
from nodeagent.report import TickRecord
from nodeagent.snapshot import CgroupSample, Skipped, WorkloadState

NOW = 1_700_000_000.0
REPO = Path(__file__).resolve().parents[2]
A1, A2, B1 = "nodeagent.slice/a-1", "nodeagent.slice/a-2", "nodeagent.slice/b-1"
K8S = k8s_container(CID2)
POLICY = PolicySpec.model_validate(
    {
        "version": 1,
        "tenants": {"a": {"shares": 2}, "b": {"shares": 1}},
        "rules": [
            {"name": "a-jobs", "match": {"path": "nodeagent.slice/a-*"}, "tenant": "a"},
            {"name": "b-jobs", "match": {"path": "nodeagent.slice/b-*"}, "tenant": "b"},
            {
                "name": "pods",
                "match": {"runtime": "containerd"},
                "tenant": "b",
                "class": "inference",
                "limits": {"cpu_max": 1.5, "memory_max": "1Gi"},
            },
        ],
    }
)
KERNEL: dict[Attribute, Value] = {
    Attribute.CPU_WEIGHT: CpuWeight(100),
    Attribute.CPU_MAX: CpuMax(None),
    Attribute.MEMORY_MAX: MemoryLimit(None),
    Attribute.MEMORY_HIGH: MemoryLimit(None),
    Attribute.MEMORY_LOW: MemoryLimit(0),
    Attribute.MEMORY_MIN: MemoryLimit(0),
    Attribute.FREEZE: Frozen(False),
}


def psi(avg10: float, some_us: int, full_us: int | None) -> Psi:
    full = None if full_us is None else PsiLine(avg10 / 2, 0.0, 0.0, full_us)
    return Psi(PsiLine(avg10, 0.0, 0.0, some_us), full)


def state(
    who: WorkloadIdentity | str,
    rate: float | None,
    *,
    used_s: float = 10.0,
    settings: Mapping[Attribute, Value] = KERNEL,
    stall: float | None = 0.02,
    cpu_full_us: int | None = 1_000_000,
) -> WorkloadState:
    sample = CgroupSample(
        populated=True,
        cpu_usage_us=int(used_s * 1e6),
        cpu_nr_periods=100,
        cpu_nr_throttled=5,
        cpu_throttled_us=250_000,
        memory_current=300 << 20,
        cpu_psi=psi(12.5, 2_500_000, cpu_full_us),
        memory_psi=psi(1.5, 300_000, 100_000),
        settings=dict(settings),
    )
    identity = job(who) if isinstance(who, str) else who
    return WorkloadState(identity, sample, rate, 0.05 if rate else None, stall)


def record(
    states: Sequence[WorkloadState],
    *,
    written: bool = True,
    failing: Collection[Attribute] = (),
    skipped: Sequence[Skipped] = (),
    policy: PolicySpec = POLICY,
    seq: int = 7,
    duration: float = 0.012,
    gpus: GpuState | None = None,
    wall_time: float = NOW,
) -> TickRecord:
    """A tick whose plan is made by the real policies; every planned change is written,
    except those to `failing` attributes (with written=False, every one fails)."""
    snap = snapshot(states, seq=seq, wall_time=wall_time)
    snap = replace(snap, skipped=tuple(skipped), gpus=gpus)
    plan = plan_claimed(snap, policy, {"a": 30.0})
    current = {w.path: w.sample.settings for w in snap.workloads}

    def result(path: str, attribute: Attribute, target: Target) -> WriteResult:
        ok = written and attribute not in failing
        outcome, detail = (Outcome.WRITTEN, "") if ok else (Outcome.FAILED, "EINVAL")
        return WriteResult(path, attribute, None, target.render(), target.reason, outcome, detail)

    results = tuple(
        result(cg.path, attribute, target)
        for cg in plan.cgroups
        for attribute, target in cg.targets.items()
        if current[cg.path].get(attribute) != target.value
    )
    assignments = assign([w.identity for w in states] + [x.identity for x in skipped], policy)
    return TickRecord(snap, plan, results, duration, False, assignments)


DUE = "nodeagent.slice/due"


def with_deadline(deadline: str, work: float) -> PolicySpec:
    """POLICY with a training job at DUE, due at `deadline` (ISO 8601) after `work` CPU-s."""
    due = {"name": "due", "match": {"path": DUE}, "tenant": "a", "class": "training"}
    rule = Rule.model_validate({**due, "deadline": deadline, "work": work})
    return POLICY.model_copy(update={"rules": (rule, *POLICY.rules)})


WITH_DEADLINE = with_deadline("2023-11-14T22:15:00+00:00", 60)  # NOW + 100 s


GPU_NODE = """\
gpus:
  - index: 0
    uuid: GPU-00000000-0000-4000-8000-000000000000
    name: NVIDIA H100 80GB HBM3
    memory: 80Gi
    numa_node: 0
    pci_bus_id: '00000000:1B:00.0'
    power: {min: 200, max: 700, default: 700, draw: 350}
    utilization: 60
    temperature: 51
processes:
  - {pid: 4242, gpu: 0, memory: 2Gi, cgroup: nodeagent.slice/a-1/worker}
  - {pid: 4243, gpu: 0, memory: 1Gi, cgroup: nodeagent.slice/a-1}
  - {pid: 4244, gpu: 0, memory: 1Gi, cgroup: system.slice/other.service}
"""
