"""cpu.weight from floors and fair shares: each workload's weight follows its CPU target.

Every workload with a floor or a share gets a target in cores: an exclusive floor (a
deadline's rate) is the whole target; otherwise the target is the floor, if any, plus the
workload's fraction of the pool, the usable CPU less every floor. The kernel divides CPU
between busy siblings in proportion to their weights, so among the workloads that share a
parent the weights are made proportional to the targets, scaled so that the active ones
average `weight_per_workload` (100, the kernel's default: managed siblings then compete
evenly with unmanaged ones). Weights are work-conserving: a floor is a minimum, and CPU
a workload leaves idle goes to the others.

cpu.weight only runs from 1 to 10000. When the largest target would need more, the whole
group is scaled down so that it gets 10000 and the ratios hold (with one busy workload
against a thousand, clamping only the large one would give it a sixth instead of half);
only targets below 1/10000 of the largest are distorted, and the trace says so. A weight
within `deadband` of its target is kept, so usage noise does not rewrite every cgroup on
every tick.
"""

from __future__ import annotations

from collections.abc import Sequence

from nodeagent.cgroupfs.values import WEIGHT_MAX, WEIGHT_MIN, Attribute, CpuWeight
from nodeagent.policy.base import Decision, Floor, Output, PolicyInput, Share
from nodeagent.policy.cpu import usable


def parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


class CpuWeights:
    name = "cpu-weights"

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        targets = cpu_targets(given)
        groups: dict[str, list[str]] = {}
        for path in targets:
            groups.setdefault(parent(path), []).append(path)
        current = {
            w.path: w.sample.settings.get(Attribute.CPU_WEIGHT) for w in given.snapshot.workloads
        }
        per = given.spec.fair_share.weight_per_workload
        out: list[Output] = []
        for group, members in sorted(groups.items()):
            active = [p for p in members if targets[p][1]]
            total = sum(targets[p][0] for p in active)
            if total <= 0:
                continue
            scale = per * len(active) / total
            biggest = max(targets[p][0] for p in members)
            note = ""
            if scale * biggest > WEIGHT_MAX:
                scale = WEIGHT_MAX / biggest
                note = f"; scaled so the largest is {WEIGHT_MAX}, keeping the ratios"
            for path in sorted(members):
                cores, _, why = targets[path]
                exact = scale * cores
                weight = max(WEIGHT_MIN, min(WEIGHT_MAX, round(exact)))
                trace = [
                    f"target {cores:.3f} cores: {why}",
                    f"weights follow targets among {len(active)} active sibling(s) under"
                    f" {group or '/'}: {scale:.1f} per core{note} -> {weight}",
                ]
                if exact < WEIGHT_MIN:
                    trace.append(f"{exact:.3f} is below the minimum weight {WEIGHT_MIN}: raised")
                now = current.get(path)
                if (
                    isinstance(now, CpuWeight)
                    and abs(now.value - weight) <= given.spec.fair_share.deadband * weight
                ):
                    trace.append(f"kept {now.value}: within the deadband of {weight}")
                    weight = now.value
                out.append(
                    Decision(
                        path,
                        Attribute.CPU_WEIGHT,
                        CpuWeight(weight),
                        self.name,
                        f"cpu weight for a target of {cores:.2f} cores",
                        tuple(trace),
                    )
                )
        return out


def cpu_targets(given: PolicyInput) -> dict[str, tuple[float, bool, str]]:
    """(cores, active, why) for every workload with a floor or a share: what its weight
    follows, and what the plan reports as its CPU target."""
    floors = given.floors()
    shares = {o.path: o for o in given.earlier if isinstance(o, Share)}
    pool = max(0.0, usable(given) - sum(f.cores for f in floors.values()))
    return {p: _target(floors.get(p), shares.get(p), pool) for p in floors.keys() | shares.keys()}


def _target(floor: Floor | None, share: Share | None, pool: float) -> tuple[float, bool, str]:
    """(cores, active, why) for one workload."""
    if floor is not None and (floor.exclusive or share is None):
        return floor.cores, True, f"floor from {floor.policy}"
    assert share is not None
    from_pool = share.fraction * pool
    if floor is None:
        return from_pool, share.active, f"{share.fraction:.3f} of the {pool:.2f}-core pool"
    return (
        floor.cores + from_pool,
        True,
        f"floor {floor.cores:.2f} from {floor.policy} + {share.fraction:.3f} of the"
        f" {pool:.2f}-core pool",
    )
