"""Offline, fluid simulation of deadline jobs on a node: what the kernel would give each job,
tick by tick, under the real policies or under the kernel's default.

The benchmark (`scripts/bench deadline`) runs each job set on a real kernel three ways and
compares each job's finish with what this simulation predicts for the same set. Every tick
it builds the snapshot the sensor would (each job's CPU used so far, its threads, whether
it still runs, the node's busy share), runs the real `make_plan` on it, and between ticks
divides the CPUs the way CFS does between busy siblings: in proportion to the planned
weights, no job above its parallelism or its planned `cpu.max`, what one cannot use going
to the others (water-filling). What the real run has and a fluid model would otherwise
miss is modelled too: a job runs unmanaged (weight 100, no cap) until the first tick after
it started (`delay`), and the agent and the rest of the node take `overhead` cores.
`busy` adds workloads without a deadline that want a CPU each throughout (fair share's),
and `shortfall` has the kernel give every deadline job only that part of its share (a VM's
steal, a noisy node), the rest lost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.policy.base import Assignment, Policy
from nodeagent.policy.plan import DEFAULT_POLICIES, CgroupPlan, make_plan
from nodeagent.policyfile.model import PolicySpec, WorkloadClass
from nodeagent.snapshot import CgroupSample, NodeSnapshot, NodeState, WorkloadState


@dataclass(frozen=True, slots=True)
class SimJob:
    name: str
    work: float
    """CPU-seconds."""
    deadline: float
    """Seconds after the start."""
    parallelism: int
    tenant: str = "a"
    workload_class: WorkloadClass = WorkloadClass.TRAINING


@dataclass(frozen=True, slots=True)
class Outcome:
    name: str
    finish: float | None
    """Seconds after the start; None when it had not finished by the end."""
    deadline: float

    @property
    def missed(self) -> bool:
        return self.finish is None or self.finish > self.deadline + 1e-6

    @property
    def tardiness(self) -> float:
        return 0.0 if self.finish is None else max(0.0, self.finish - self.deadline)


def water_fill(
    weights: Mapping[str, float], caps: Mapping[str, float], cpus: float
) -> dict[str, float]:
    """CPU per job: in proportion to weight, none above its cap, the rest redistributed."""
    out = dict.fromkeys(weights, 0.0)
    left, open_ = cpus, {n for n, w in weights.items() if w > 0 and caps[n] > 0}
    while open_ and left > 1e-12:
        total = sum(weights[n] for n in open_)
        capped = {n for n in open_ if left * weights[n] / total >= caps[n]}
        if not capped:
            for n in open_:
                out[n] = left * weights[n] / total
            break
        for n in capped:
            out[n] = caps[n]
            left -= caps[n]
        open_ -= capped
    return out


BUSY = "busy-"
"""The name of a busy workload without a deadline, before its number."""


class _Run:
    """One simulated run: CPU used so far, finishes, the last tick's rates, the settings."""

    def __init__(
        self,
        jobs: Sequence[SimJob],
        cpus: int,
        start: float,
        overhead: float,
        *,
        busy: int,
        shortfall: float,
    ) -> None:
        self.jobs = {j.name: j for j in jobs}
        self.jobs |= {
            f"{BUSY}{i}": SimJob(f"{BUSY}{i}", float("inf"), float("inf"), 1, tenant="b")
            for i in range(busy)
        }
        self.cpus = cpus
        self.start = start
        self.overhead = overhead
        self.shortfall = shortfall
        self.used = dict.fromkeys(self.jobs, 0.0)
        self.at_tick = dict(self.used)
        self.rates: dict[str, float | None] = dict.fromkeys(self.jobs)
        self.finish: dict[str, float] = {}
        self.weights = dict.fromkeys(self.jobs, 100.0)
        self.quota = {j.name: float(j.parallelism) for j in self.jobs.values()}

    def path(self, name: str) -> str:
        return f"nodeagent.slice/{name}"

    def assignments(self) -> dict[str, Assignment]:
        return {
            self.path(j.name): Assignment(
                f"exec:{j.name}",
                j.tenant,
                j.workload_class if j.work < float("inf") else WorkloadClass.BATCH,
                deadline=self.start + j.deadline if j.work < float("inf") else None,
                work=j.work if j.work < float("inf") else None,
                exec_job=True,
            )
            for j in self.jobs.values()
        }

    def snapshot(self, seq: int, now: float, tick: float) -> NodeSnapshot:
        rates = [r for r in self.rates.values() if r is not None]
        busy = min(1.0, (sum(rates) + self.overhead) / self.cpus) if seq > 1 else None
        node = NodeState(self.cpus, busy, 64 << 30, 32 << 30, 4096)
        states = tuple(
            WorkloadState(
                WorkloadIdentity(self.path(n), Kind.JOB, Runtime.NODEAGENT, Owner.NODEAGENT, n),
                CgroupSample(
                    populated=n not in self.finish,
                    cpu_usage_us=int(self.used[n] * 1e6),
                    threads=j.parallelism,
                ),
                None if n in self.finish else self.rates[n],
            )
            for n, j in self.jobs.items()
        )
        return NodeSnapshot(seq, self.start + now, tick if seq > 1 else None, node, states)

    def settle(self, planned: Sequence[CgroupPlan]) -> None:
        """Take the planned weights and caps, as the executor would write them."""
        for cg in planned:
            name, targets = cg.identity.name, cg.targets
            w = targets.get(Attribute.CPU_WEIGHT)
            if w is not None and isinstance(w.value, CpuWeight):
                self.weights[name] = float(w.value.value)
            m = targets.get(Attribute.CPU_MAX)
            cores = m.value.cores if m is not None and isinstance(m.value, CpuMax) else None
            self.quota[name] = float(self.jobs[name].parallelism) if cores is None else cores

    def advance(self, now: float, step: float) -> None:
        live = {n: w for n, w in self.weights.items() if n not in self.finish}
        caps = {n: min(float(j.parallelism), self.quota[n]) for n, j in self.jobs.items()}
        for name, share in water_fill(live, caps, self.cpus - self.overhead).items():
            rate = share * (1.0 if name.startswith(BUSY) else self.shortfall)
            need = self.jobs[name].work - self.used[name]
            if rate * step >= need:
                self.finish[name] = now + need / rate
                self.used[name] = self.jobs[name].work
            else:
                self.used[name] += rate * step

    def measure(self, tick: float) -> None:
        self.rates = {n: (self.used[n] - self.at_tick[n]) / tick for n in self.used}
        self.at_tick = dict(self.used)


def simulate(
    jobs: Sequence[SimJob],
    spec: PolicySpec,
    cpus: int,
    *,
    policies: Sequence[Policy] | None = DEFAULT_POLICIES,
    tick: float = 1.0,
    step: float = 0.05,
    start: float = 1_000_000.0,
    horizon: float | None = None,
    delay: float | None = None,
    overhead: float = 0.0,
    busy: int = 0,
    shortfall: float = 1.0,
) -> list[Outcome]:
    """Each job's finish. `policies=None` is the kernel's default: every weight 100. The
    jobs start together; the first plan comes `delay` seconds later (default half a tick,
    the mean wait for the next tick), and then one every `tick`."""
    horizon = horizon or 3 * max(j.deadline for j in jobs)
    run = _Run(jobs, cpus, start, overhead, busy=busy, shortfall=shortfall)
    assignments = run.assignments()
    usage: dict[str, float] = {}
    carried: Mapping[str, Mapping[str, object]] = {}
    now, seq = 0.0, 0
    first = tick / 2 if delay is None else delay
    for _ in range(max(0, round(first / step))):  # unmanaged until the first tick
        run.advance(now, step)
        now += step
    run.measure(max(now, step))
    steps_per_tick = max(1, round(tick / step))
    while now < horizon and not all(j.name in run.finish for j in jobs):
        if policies is not None:
            seq += 1
            plan = make_plan(
                run.snapshot(seq, now, tick),
                spec,
                usage,
                policies,
                assignments=assignments,
                carried=carried,
            )
            usage, carried = dict(plan.tenant_usage), plan.carry
            run.settle(plan.cgroups)
        for _ in range(steps_per_tick):
            run.advance(now, step)
            now += step
        run.measure(tick)
    return [Outcome(j.name, run.finish.get(j.name), j.deadline) for j in jobs]
