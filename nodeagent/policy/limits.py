"""Static per-rule caps from the policy file: cpu.max, memory.max and memory.high.

memory.max is never to be set below what a cgroup uses (the kernel would OOM-kill
to get there). While usage is above a rule's memory.max, this policy plans
memory.high at that target instead, so the kernel reclaims towards it, and the
executor holds memory.max back. Because the plan owns memory.high whenever it
sets memory.max, the temporary value is undone as soon as usage fits or the
rule changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from nodeagent.cgroupfs.values import Attribute, CpuMax, MemoryLimit
from nodeagent.policy.base import PLANNING_ERRORS, Decision, PolicyInput, Skip
from nodeagent.snapshot import WorkloadState
from nodeagent.spec.model import MAX, Limits


def _bytes(size: int | str) -> int | None:
    return None if size == MAX else int(size)


def _memory(w: WorkloadState, limits: Limits, page: int, why: str) -> list[Decision]:
    out = []
    high, high_why = limits.memory_high, f"{why}: memory_high {limits.memory_high}"
    if limits.memory_max is not None:
        cap = _bytes(limits.memory_max)
        out.append(
            Decision(
                w.path,
                Attribute.MEMORY_MAX,
                MemoryLimit.aligned(cap, page),
                "static-limits",
                f"{why}: memory_max {limits.memory_max}",
            )
        )
        usage = w.sample.memory_current
        if high is None:  # the loader guarantees a given memory_high is <= memory_max
            high, high_why = MAX, f"{why}: memory_high not set, so max"
            if cap is not None and usage is not None and usage > cap:
                high = cap
                high_why = (
                    f"{why}: usage {usage} is above memory_max {cap}:"
                    " memory.high lowered to it first, so the kernel reclaims"
                )
    if high is not None:
        out.append(
            Decision(
                w.path,
                Attribute.MEMORY_HIGH,
                MemoryLimit.aligned(_bytes(high), page),
                "static-limits",
                high_why,
            )
        )
    return out


class StaticLimits:
    name = "static-limits"

    def decide(self, given: PolicyInput) -> Sequence[Decision | Skip]:
        rules = {r.name: r for r in given.spec.rules}
        page = given.snapshot.node.page_size
        decisions: list[Decision | Skip] = []
        for w in given.snapshot.workloads:
            a = given.assignments.get(w.path)
            if a is None:
                continue
            try:
                decisions.extend(self._one(w, rules[a.rule].limits, page, f"rule {a.rule}"))
            except PLANNING_ERRORS as e:
                decisions.append(Skip(w.path, self.name, f"rule {a.rule}: {e}"))
        return decisions

    def _one(self, w: WorkloadState, limits: Limits, page: int, why: str) -> list[Decision]:
        out = []
        if limits.cpu_max is not None:
            cores = None if limits.cpu_max == MAX else float(limits.cpu_max)
            out.append(
                Decision(
                    w.path,
                    Attribute.CPU_MAX,
                    CpuMax.from_cores(cores, limits.cpu_period_us),
                    self.name,
                    f"{why}: cpu_max {limits.cpu_max}" + ("" if cores is None else " cores"),
                )
            )
        out.extend(_memory(w, limits, page, why))
        return out
