"""cpu.weight from floors and fair shares: each workload's weight follows its CPU target.

Every workload with a floor or a share gets a target in cores: an exclusive floor (a
deadline's rate) is the whole target; otherwise the target is the floor, if any, plus the
workload's fraction of the pool, the usable CPU less every floor. The kernel divides CPU
between busy siblings in proportion to their weights, so among the workloads that share a
parent the weights are made proportional to the targets, scaled so that the active ones
average `weight_per_workload` (100, the kernel's default: managed siblings then compete
evenly with unmanaged ones). Weights are work-conserving: a floor is a minimum, and CPU
a workload leaves idle goes to the others.

cpu.weight only arbitrates between siblings, so when tenants' workloads sit under
different parents (pods and QoS tiers, docker/ beside the managed root, slices) weights
on the workloads alone cannot hold the tenant split. With `fair_share.hierarchy` (the
default) every parent of a targeted workload, up to the root, is a node whose target is
the sum of the targets below it, and each level's weights follow its nodes' targets the
same way: the part a parent carries is its share among its siblings, and the split inside
it is its children's. Levels the agent may not write (nodeagent.ownership) keep their
weights; the split they cause is computed from those weights and reported (a note
'hierarchy' with each tenant's planned and expected share). Siblings no rule claims take
CPU by their own weights: the split holds among what the agent manages.

cpu.weight only runs from 1 to 10000. When the largest target would need more, the whole
group is scaled down so that it gets 10000 and the ratios hold (with one busy workload
against a thousand, clamping only the large one would give it a sixth instead of half);
only targets below 1/10000 of the largest are distorted, and the trace says so. A weight
within `deadband` of its target is kept, so usage noise does not rewrite every cgroup on
every tick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nodeagent.cgroupfs.values import WEIGHT_MAX, WEIGHT_MIN, Attribute, CpuWeight
from nodeagent.ownership import WriteMode, write_mode
from nodeagent.policy.base import (
    CpuTarget,
    Decision,
    Floor,
    Note,
    Output,
    Policy,
    PolicyInput,
    Share,
)
from nodeagent.policy.classify import outer_claims
from nodeagent.policy.cpu import usable
from nodeagent.policy.notes import Hierarchy
from nodeagent.policy.reads import Reads
from nodeagent.snapshot import WorkloadState


def parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


@dataclass
class _Node:
    """A workload or a parent of workloads, with the targets of what is below it."""

    path: str
    cores: float = 0.0
    active: bool = False
    leaves: int = 0
    why: str = ""
    weight: int = 0
    trace: list[str] = field(default_factory=list)


class CpuWeights(Policy):
    name = "cpu-weights"
    writes = frozenset({Attribute.CPU_WEIGHT})
    reads = Reads(
        settings=frozenset({"fair_share", "node", "agent"}),
        snapshot=frozenset({"levels", "node"}),
        workload=frozenset({"settings"}),
    )

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        targets = cpu_targets(given)
        nodes = self._nodes(given, targets)
        groups: dict[str, list[str]] = {}
        for path in nodes:
            groups.setdefault(parent(path), []).append(path)
        states = {w.path: w for w in (*given.snapshot.workloads, *given.snapshot.levels)}
        per = given.spec.fair_share.weight_per_workload
        out: list[Output] = []
        for group, members in sorted(groups.items()):
            active = [p for p in members if nodes[p].active]
            total = sum(nodes[p].cores for p in active)
            if total <= 0:
                continue
            scale = per * len(active) / total
            biggest = max(nodes[p].cores for p in members)
            note = ""
            if scale * biggest > WEIGHT_MAX:
                scale = WEIGHT_MAX / biggest
                note = f"; scaled so the largest is {WEIGHT_MAX}, keeping the ratios"
            for path in sorted(members):
                node = nodes[path]
                exact = scale * node.cores
                weight = max(WEIGHT_MIN, min(WEIGHT_MAX, round(exact)))
                node.trace = [
                    f"target {node.cores:.3f} cores: {node.why}",
                    f"weights follow targets among {len(active)} active sibling(s) under"
                    f" {group or '/'}: {scale:.1f} per core{note} -> {weight}",
                ]
                if exact < WEIGHT_MIN:
                    node.trace.append(
                        f"{exact:.3f} is below the minimum weight {WEIGHT_MIN}: raised"
                    )
                w = states.get(path)
                now = None if w is None else w.sample.settings.get(Attribute.CPU_WEIGHT)
                if (
                    isinstance(now, CpuWeight)
                    and abs(now.value - weight) <= given.spec.fair_share.deadband * weight
                ):
                    node.trace.append(f"kept {now.value}: within the deadband of {weight}")
                    weight = now.value
                node.weight = weight
        for path, node in sorted(nodes.items()):
            if node.weight == 0:
                continue
            trace = list(node.trace)
            if path in targets:  # a workload: say which level carries which part above it
                trace += [
                    f"level {a}: weight {nodes[a].weight}, carrying {nodes[a].cores:.2f} cores"
                    f" for {nodes[a].leaves} workload(s)"
                    for a in ancestors(path)
                    if a in nodes and nodes[a].weight
                ]
            out.append(
                Decision(
                    path,
                    Attribute.CPU_WEIGHT,
                    CpuWeight(node.weight),
                    self.name,
                    f"cpu weight for a target of {node.cores:.2f} cores",
                    tuple(trace),
                )
            )
        out.extend(  # the plan reports them as they are, not computed a second time
            CpuTarget(p, cores, active, self.name, why)
            for p, (cores, active, why) in sorted(targets.items())
        )
        if given.spec.fair_share.hierarchy:
            out.extend(_split_note(given, targets, nodes, states))
        return out

    def _nodes(
        self, given: PolicyInput, targets: Mapping[str, tuple[float, bool, str]]
    ) -> dict[str, _Node]:
        """Targeted workloads and, with the hierarchy, every sensed parent of them."""
        nodes = {p: _Node(p, c, a, 1, why) for p, (c, a, why) in targets.items()}
        if not given.spec.fair_share.hierarchy:
            return nodes
        # parents: the sensed levels, and claimed cgroups with claims below them
        carriers = {w.path for w in given.snapshot.levels} | outer_claims(given.assignments)
        for path, (cores, active, _) in targets.items():
            for a in ancestors(path):
                if a not in carriers or a in targets:
                    break  # a level not sensed, or a workload that carries its own target
                node = nodes.setdefault(a, _Node(a, why="the sum of the targets below it"))
                node.cores += cores
                node.active |= active
                node.leaves += 1
        return nodes


def ancestors(path: str) -> list[str]:
    """The parents of a cgroup, nearest first, without the root."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _split_note(
    given: PolicyInput,
    targets: Mapping[str, tuple[float, bool, str]],
    nodes: Mapping[str, _Node],
    states: Mapping[str, WorkloadState],
) -> list[Note]:
    """Each tenant's planned share, and the share to expect where levels keep their own
    weights (read-only): the error those levels cause in the split."""
    modes = {
        w.path: write_mode(w.identity, given.spec.agent)
        for w in (*given.snapshot.workloads, *given.snapshot.levels)
    }
    siblings: dict[str, list[str]] = {}
    for path in nodes:
        siblings.setdefault(parent(path), []).append(path)

    def weight(path: str, planned: bool) -> float:
        if planned or modes.get(path) is not WriteMode.READ_ONLY:
            return float(nodes[path].weight)
        now = states[path].sample.settings.get(Attribute.CPU_WEIGHT) if path in states else None
        return float(now.value) if isinstance(now, CpuWeight) else 100.0

    totals: dict[tuple[str, bool], float] = {}

    def total(group: str, planned: bool) -> float:
        key = (group, planned)
        if key not in totals:
            totals[key] = sum(weight(s, planned) for s in siblings[group] if nodes[s].active)
        return totals[key]

    def share(path: str, planned: bool) -> float:
        fraction = 1.0
        for p in [path, *ancestors(path)]:
            if p not in nodes:
                break
            whole = total(parent(p), planned)
            fraction *= weight(p, planned) / whole if whole else 0.0
        return fraction

    tenants: dict[str, list[float]] = {}
    outer = outer_claims(given.assignments)  # counted through the claims below them
    for path, (_, active, _) in targets.items():
        a = given.assignments.get(path)
        if a is None or not active or nodes[path].weight == 0 or path in outer:
            continue
        planned, expected = share(path, True), share(path, False)
        got = tenants.setdefault(a.tenant, [0.0, 0.0])
        got[0] += planned
        got[1] += expected
    if not tenants:
        return []
    fixed = sorted(p for p in nodes if modes.get(p) is WriteMode.READ_ONLY and p not in targets)
    off = {t: (p, e) for t, (p, e) in tenants.items() if abs(p - e) > 0.05 * max(p, 1e-9)}
    status = "distorted" if off else "holds"
    message = "; ".join(
        f"tenant {t}: {p:.0%} planned, {e:.0%} expected" for t, (p, e) in sorted(tenants.items())
    )
    if fixed:
        message += f"; read-only levels: {', '.join(fixed)}"
    parts = ({t: p for t, (p, _) in tenants.items()}, {t: e for t, (_, e) in tenants.items()})
    payload = Hierarchy(*parts, tuple(fixed))
    return [Note(None, "cpu-weights", status, message, payload)]


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
