"""GPU verification: every compute process must run on GPUs its cgroup holds.

NVML's process list is compared with the agent's holds each tick. A process whose cgroup
is (inside) a holder's cgroup but runs on a GPU that holder does not hold, or whose
cgroup holds nothing at all, is a violation: reported as a note (shown by
`nodeagent gpus`, written to the audit log when it starts), and with
`gpu.on_violation: freeze` the managed workload it belongs to is frozen until the
process is gone from the GPU, then thawed. A frozen workload the agent no longer plans
(a reload unclaimed it, it was renamed or removed) is thawed at once where it still exists,
and forgotten; one the sensor could not read this tick is left frozen and remembered until
it is read again (nothing is known of it: thawing it would let it run on GPUs it does not
hold until the next tick froze it again). A reservation not yet bound to its container
(the one it names, which the daemon binds once discovery shows it) covers nobody: any
process on its GPUs is a violation. A process is judged against every hold bound to its
cgroup or one above it, never the first alone: a hold bound there too (which only the
workload's owner or the operator can bind, nodeagent.gpualloc.service) never makes a
process on that workload's own GPUs a violator.
"""

from __future__ import annotations

from collections.abc import Sequence

from nodeagent.cgroupfs.values import Attribute, Frozen
from nodeagent.gpu.model import GpuProcess, GpuState, Hold, HoldKind, holders, within
from nodeagent.policy.base import Carry, Decision, Note, Output, Policy, PolicyInput
from nodeagent.policy.notes import GpuViolation, ViolationKind
from nodeagent.policy.reads import Reads
from nodeagent.policyfile.model import ViolationAction


def violations(gpus: GpuState) -> list[tuple[GpuProcess, ViolationKind, Hold | None]]:
    """(process, kind, its holder) for each process on a GPU its cgroup does not hold:
    kind 'wrong-gpu' (its cgroup holds others) or 'unassigned' (it holds none)."""
    parents = gpus.parents()
    # a pod's GPUs not yet tied to its cgroup (Kubernetes mode, the pod not known yet): a
    # process on them may be that pod's, so it is not judged until the pod is known
    untied = [h for h in gpus.holds if h.kind is HoldKind.POD and h.cgroup is None]
    out: list[tuple[GpuProcess, ViolationKind, Hold | None]] = []
    for p in gpus.processes:
        if p.cgroup is None:
            continue  # gone since NVML listed it
        bound = holders(p, gpus.holds)
        if bound and not any(h.covers(p.device_uuid, parents) for h in bound):
            out.append((p, ViolationKind.WRONG_GPU, bound[0]))
        elif not bound and not any(u.covers(p.device_uuid, parents) for u in untied):
            out.append((p, ViolationKind.UNASSIGNED, None))
    return out


def _workload(cgroup: str, paths: Sequence[str]) -> str | None:
    """The managed workload a process's cgroup is in (the closest one)."""
    inside = [w for w in paths if within(cgroup, w)]
    return max(inside, key=len) if inside else None


class GpuChecks(Policy):
    name = "gpu-checks"
    writes = frozenset({Attribute.FREEZE})
    reads = Reads(
        settings=frozenset({"gpu"}),
        snapshot=frozenset({"gpus", "skipped", "vanished"}),
        workload=frozenset({"settings"}),
        carry=True,
    )

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        gpus = given.snapshot.gpus
        raw = given.carried.get(self.name, {}).get("frozen")
        was_frozen = [str(p) for p in raw] if isinstance(raw, list) else []
        freeze = given.spec.gpu.on_violation is ViolationAction.FREEZE
        paths = [w.path for w in given.snapshot.workloads]
        out: list[Output] = []
        frozen: set[str] = set()
        for p, kind, h in violations(gpus) if gpus is not None else []:
            assert p.cgroup is not None
            workload = _workload(p.cgroup, paths)
            held, holder = ("nothing", None) if h is None else (", ".join(h.uuids), h.owner)
            message = f"pid {p.pid} in {p.cgroup} runs on {p.device_uuid}; its cgroup holds {held}"
            found = GpuViolation(kind, p.pid, p.device_uuid, p.cgroup, holder)
            key = f"{p.pid}@{p.device_uuid}"
            out.append(Note(workload, self.name, str(kind), message, found, key))
            if freeze and workload is not None and workload in given.assignments:
                frozen.add(workload)
        for path in sorted(frozen):
            out.append(
                Decision(
                    path, Attribute.FREEZE, Frozen(True), self.name,
                    "frozen while a process of it uses GPUs it does not hold",
                )
            )  # fmt: skip
        snapshot = given.snapshot
        kernel = {w.path: w.sample.settings.get(Attribute.FREEZE) for w in snapshot.workloads}
        unread = {s.path for s in snapshot.skipped}
        kept = [p for p in was_frozen if p in unread]  # left as they are, and remembered
        thaw = [p for p in was_frozen if p not in frozen and kernel.get(p) == Frozen(True)]
        planned = {*kernel, *unread, *snapshot.vanished}  # this tick's workloads, or removed
        elsewhere = [p for p in was_frozen if p not in planned]  # thawed, then forgotten
        for path in (*thaw, *elsewhere):
            why = (
                "it no longer uses GPUs it does not hold"
                if path in kernel
                else "no longer a workload the agent plans (unclaimed, or gone)"
            )
            out.append(Decision(path, Attribute.FREEZE, Frozen(False), self.name, f"thawed: {why}"))
        out.append(Carry(self.name, {"frozen": sorted({*frozen, *thaw, *kept})}))
        return out
