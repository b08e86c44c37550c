"""Static per-rule caps from the policy file: cpu.max, memory.max and memory.high."""

from __future__ import annotations

from collections.abc import Sequence

from nodeagent.cgroupfs.values import Attribute, CpuMax, MemoryLimit
from nodeagent.policy.base import Decision, PolicyInput
from nodeagent.spec.model import MAX


class StaticLimits:
    name = "static-limits"

    def decide(self, given: PolicyInput) -> Sequence[Decision]:
        rules = {r.name: r for r in given.spec.rules}
        page = given.snapshot.node.page_size
        decisions = []
        for w in given.snapshot.workloads:
            a = given.assignments.get(w.path)
            if a is None:
                continue
            limits = rules[a.rule].limits
            why = f"rule {a.rule}"
            if limits.cpu_max is not None:
                cores = None if limits.cpu_max == MAX else float(limits.cpu_max)
                value = CpuMax.from_cores(cores, limits.cpu_period_us)
                decisions.append(
                    Decision(
                        w.path,
                        Attribute.CPU_MAX,
                        value,
                        self.name,
                        f"{why}: cpu_max {limits.cpu_max}" + ("" if cores is None else " cores"),
                    )
                )
            for attr, size in (
                (Attribute.MEMORY_MAX, limits.memory_max),
                (Attribute.MEMORY_HIGH, limits.memory_high),
            ):
                if size is None:
                    continue
                limit = MemoryLimit.aligned(None if size == MAX else int(size), page)
                decisions.append(
                    Decision(
                        w.path,
                        attr,
                        limit,
                        self.name,
                        f"{why}: {attr.replace('.', '_')} {size}",
                    )
                )
        return decisions
