"""Static caps and memory protection from the policy file (or `nodeagent exec`):
cpu.max, memory.max, memory.high, pids.max, and memory.min or memory.low; and the CPUs a
job is pinned to (cpuset.cpus: its GPUs' CPUs, with gpu.pin_cpus).

memory.max is never to be set below what a cgroup uses (the kernel would OOM-kill to
get there). memory.high sits below memory.max as a throttle, by the kubelet's MemoryQoS
formula: request + factor x (limit - request), with the factor from the workload's
class. Without a request, memory.high is max, except while usage is above memory.max:
then it is lowered to memory.max so the kernel reclaims, and the executor holds
memory.max back until usage fits. Because the plan owns memory.high whenever it sets
memory.max, a temporary value is undone as soon as usage fits or the rule changes.

A memory_request is protected from reclaim as its class says: memory.min (latency
classes: never reclaimed), memory.low (reclaimed only when nothing else is left) or
neither; the plan then owns both files and sets the other to 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuSet, MemoryLimit, PidsMax, Value
from nodeagent.policy.base import Decision, Output, Policy, PolicyInput
from nodeagent.policy.reads import Reads
from nodeagent.policyfile.model import MAX, ClassSettings, Limits, MemoryProtection
from nodeagent.snapshot import WorkloadState


def _bytes(size: int | str) -> int | None:
    return None if size == MAX else int(size)


class StaticLimits(Policy):
    name = "static-limits"
    reads = Reads(
        settings=frozenset({"classes"}),
        snapshot=frozenset({"node"}),
        workload=frozenset({"memory_current"}),
    )
    writes = frozenset(
        {
            Attribute.CPU_MAX,
            Attribute.MEMORY_MAX,
            Attribute.MEMORY_HIGH,
            Attribute.MEMORY_LOW,
            Attribute.MEMORY_MIN,
            Attribute.PIDS_MAX,
            Attribute.CPUSET_CPUS,
        }
    )

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        page = given.snapshot.node.page_size
        out: list[Output] = []
        for w in given.snapshot.workloads:
            a = given.assignments.get(w.path)
            if a is None:
                continue
            why = f"rule {a.rule}"  # a cgroup it cannot plan is skipped by the pipeline
            out.extend(self._cpu(w, a.limits, why))
            out.extend(self._memory(w, a.limits, given.spec.classes[a.workload_class], page, why))
            if a.limits.pids_max is not None:
                pids = PidsMax(a.limits.pids_max)
                reason = f"{why}: pids_max {a.limits.pids_max}"
                out.append(self._decision(w, Attribute.PIDS_MAX, pids, reason))
            if a.cpuset:
                value = CpuSet(a.cpuset)
                reason = f"{why}: pinned to CPUs {value.render()}, its GPUs' (gpu.pin_cpus)"
                out.append(self._decision(w, Attribute.CPUSET_CPUS, value, reason))
        return out

    def _decision(self, w: WorkloadState, attr: Attribute, value: Value, reason: str) -> Decision:
        return Decision(w.path, attr, value, self.name, reason)

    def _cpu(self, w: WorkloadState, limits: Limits, why: str) -> list[Decision]:
        if limits.cpu_max is None:
            return []
        cores = None if limits.cpu_max == MAX else float(limits.cpu_max)
        value = CpuMax.from_cores(cores, limits.cpu_period_us)
        unit = "" if cores is None else " cores"
        return [
            self._decision(w, Attribute.CPU_MAX, value, f"{why}: cpu_max {limits.cpu_max}{unit}")
        ]

    def _memory(
        self, w: WorkloadState, limits: Limits, cls: ClassSettings, page: int, why: str
    ) -> list[Decision]:
        out = []
        request = None if limits.memory_request is None else _bytes(limits.memory_request)
        high, high_why = limits.memory_high, f"{why}: memory_high {limits.memory_high}"
        if limits.memory_max is not None:
            cap = _bytes(limits.memory_max)
            out.append(
                self._decision(
                    w,
                    Attribute.MEMORY_MAX,
                    MemoryLimit.aligned(cap, page),
                    f"{why}: memory_max {limits.memory_max}",
                )
            )
            usage = w.sample.memory_current
            if high is None:  # the loader guarantees a given memory_high is <= memory_max
                high, high_why = MAX, f"{why}: memory_high not set, so max"
                if cap is not None and request is not None and request < cap:
                    factor = cls.memory_throttle_factor
                    high = int(request + factor * (cap - request))
                    high_why = (
                        f"{why}: request {request} + {factor:g} x (limit {cap} - request)"
                        " (kubelet MemoryQoS)"
                    )
                elif cap is not None and usage is not None and usage > cap:
                    high = cap
                    high_why = (
                        f"{why}: usage {usage} is above memory_max {cap}:"
                        " memory.high lowered to it first, so the kernel reclaims"
                    )
        if high is not None:
            out.append(
                self._decision(
                    w, Attribute.MEMORY_HIGH, MemoryLimit.aligned(_bytes(high), page), high_why
                )
            )
        if request is not None:
            protect = cls.memory_protection
            for attr, kind in (
                (Attribute.MEMORY_MIN, MemoryProtection.MIN),
                (Attribute.MEMORY_LOW, MemoryProtection.LOW),
            ):
                mine = protect is kind
                out.append(
                    self._decision(
                        w,
                        attr,
                        MemoryLimit.aligned(request if mine else 0, page),
                        f"{why}: memory_request {request} protected by {protect}"
                        if mine
                        else f"{why}: class protects memory by {protect}, not {kind}",
                    )
                )
        return out
