"""Hand back what the agent changed, as `tuned-adm off` does: `nodeagent release`.

The state file records, for every attribute the agent changed, the value it found before
and the one it set (nodeagent.originals). Release writes each original back where the
attribute still holds what the agent set, through the executor's one write path
(nodeagent.act.Executor.write): a cgroup systemd owns through its unit (the property first,
then the file; a freeze through ThawUnit), so that a daemon-reload does not bring the
agent's value back; without D-Bus its file alone, which beats keeping the agent's value. A
value someone changed since is theirs and is left; a cgroup that is gone is skipped. Freezes
the protection controller carried in a state file written before originals were recorded
are thawed too. The state file is then rewritten without what was handed back, so a later
agent starts clean.

Run by hand, or as the unit's ExecStopPost= with --on-stop, where only a stop for good
releases: `stopped_for_good` tells it from a restart or a crash.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nodeagent import state
from nodeagent.act import Executor, Outcome, Units
from nodeagent.cgroupfs import parse
from nodeagent.cgroupfs.tree import AuditFn, CgroupTree, CgroupVanished
from nodeagent.cgroupfs.values import Attribute, CpuWeight, Frozen, MemoryLimit, Value
from nodeagent.errors import one_line
from nodeagent.originals import Original, Originals
from nodeagent.ownership import WriteMode, parent_identity, write_mode
from nodeagent.policy.plan import Target
from nodeagent.policy.protection import Protection, frozen_by
from nodeagent.policyfile.model import AgentSettings, WithoutBus

REASON = "released: the value before nodeagent changed it"


@dataclass(frozen=True, slots=True)
class Handed:
    """One attribute's outcome: released, already (holds its original), left (changed since
    by someone else), gone (the cgroup is), or failed."""

    cgroup: str
    attribute: str
    outcome: str
    now: str | None
    to: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "cgroup": self.cgroup,
            "attribute": self.attribute,
            "outcome": self.outcome,
            "value": self.now,
            "original": self.to,
            "detail": self.detail,
        }


def _value(attribute: Attribute, text: str) -> Value:
    if attribute is Attribute.CPU_WEIGHT:
        return CpuWeight(parse.single_int(text))
    if attribute is Attribute.CPU_MAX:
        return parse.cpu_max(text)
    if attribute is Attribute.FREEZE:
        return Frozen(text.strip() == "1")
    if attribute is Attribute.CPUSET_CPUS:
        return parse.cpuset(text)
    if attribute is Attribute.PIDS_MAX:
        return parse.pids_max(text)
    return MemoryLimit(parse.limit(text))


def _to_release(
    saved: state.SavedState, managed_root: str, settings: AgentSettings
) -> list[tuple[str, Attribute, Original]]:
    """Every recorded change, and the carried freezes no record covers, parents first and
    thaws last (so a cgroup's caps are back before its processes run again)."""
    entries = Originals.load(saved.originals).items()
    recorded = {(p, a) for p, a, _ in entries}
    for path in frozen_by(saved.carry.get(Protection.name)):
        if (path, Attribute.FREEZE) not in recorded:
            via = write_mode(parent_identity(path, managed_root), settings)
            if via is not WriteMode.READ_ONLY:
                entries.append((path, Attribute.FREEZE, Original("0", "1", via)))
    return in_release_order(entries)


def in_release_order(
    entries: Sequence[tuple[str, Attribute, Original]],
) -> list[tuple[str, Attribute, Original]]:
    """Parents first and thaws last: a cgroup's caps are back before its processes run
    again, and no parent is tighter than its child on the way."""
    return sorted(entries, key=lambda e: (e[0].count("/"), e[1] is Attribute.FREEZE, e[0]))


class Releaser:
    """Hands originals back, each where it still holds what the agent set, written by an
    executor of its own over the same tree, systemd and audit as the agent's: the files of
    a cgroup systemd owns are written directly when D-Bus is down (`WithoutBus.DIRECT`)."""

    def __init__(self, tree: CgroupTree, units: Units | None, audit: AuditFn) -> None:
        self.tree = tree
        self.writer = Executor(tree, audit, units=units, without_bus=lambda: WithoutBus.DIRECT)

    def one(self, path: str, attribute: Attribute, original: Original) -> Handed:
        def handed(outcome: str, now: str | None, detail: str = "") -> Handed:
            return Handed(path, str(attribute), outcome, now, original.was, detail)

        try:
            with self.tree.open(path) as d:
                text = d.read_optional(attribute)
            if text is None:
                return handed("failed", None, f"no {attribute}: its controller is off")
            now = text.strip()
            if now == original.was:
                return handed("already", now)
            if now != original.set:
                return handed("left", now, f"changed since: nodeagent set {original.set}")
            target = Target(_value(attribute, original.was), "release", REASON)
            r = self.writer.write(path, attribute, target, original.via, _value(attribute, now))
        except CgroupVanished:
            return handed("gone", None)
        except Exception as e:  # unreadable, unparsable: this attribute only
            return handed("failed", None, one_line(e))
        if r.outcome is Outcome.WRITTEN:
            return handed(
                "released", now, f"through systemd, unit {r.unit}" if r.unit else r.detail
            )
        if r.outcome is Outcome.UNCHANGED:
            return handed("already", original.was)
        if r.outcome is Outcome.VANISHED:
            return handed("gone", None)
        return handed("failed", None, r.detail or str(r.outcome))


def release(
    tree: CgroupTree,
    saved: state.SavedState,
    *,
    managed_root: str,
    settings: AgentSettings,
    units: Units | None,
    audit: AuditFn,
    only: Sequence[str] | None = None,
) -> tuple[list[Handed], state.SavedState]:
    """Hand back every recorded change (of the cgroups `only` names, when given); the
    results and the state to save in place of `saved`."""
    releaser = Releaser(tree, units, audit)
    wanted = None if only is None else {p.strip("/") for p in only}
    results = [
        releaser.one(path, attribute, original)
        for path, attribute, original in _to_release(saved, managed_root, settings)
        if wanted is None or path in wanted
    ]
    left = Originals.load(saved.originals)
    for r in results:
        if r.outcome != "failed":
            left.drop(r.cgroup, Attribute(r.attribute))
    carry = dict(saved.carry)
    if wanted is None and not any(
        r.outcome == "failed" and r.attribute == Attribute.FREEZE for r in results
    ):
        carry.pop(Protection.name, None)  # nothing frozen or capped is left to carry
    return results, replace(saved, carry=carry, originals=left.dump())


# --- when the unit stops: for good, or to come back -----------------------------------------

RESTARTING_JOBS = ("restart", "try-restart", "reload-or-restart", "reload-or-try-restart")


def stopped_for_good(job: str | None, result: str | None) -> tuple[bool, str]:
    """Whether the unit's ExecStopPost= should release, from the unit's pending job and
    $SERVICE_RESULT: a queued restart (systemctl restart) keeps everything for the next
    agent; a stop job (systemctl stop, disable --now, shutdown) releases; with no job, a
    clean exit releases (nothing restarts it under Restart=on-failure) and a failure keeps
    (Restart= brings it back: a crash, a watchdog kill)."""
    if job in RESTARTING_JOBS:
        return False, "a restart is queued: the next agent keeps what this one set"
    if job == "stop":
        return True, "stopped"
    if job is None:
        return False, "systemd could not be asked whether a restart is queued: nothing released"
    if result == "success":
        return True, "exited cleanly"
    return False, f"it failed ({result}): Restart= brings it back, and it keeps what it set"


def pending_job(unit: str, run: Callable[..., Any] = subprocess.run) -> str | None:
    """The type of the job systemd runs for `unit` now ('' for none), None when it cannot
    be asked. During a restart's stop phase the job is still a 'restart'."""
    try:
        done = run(
            ["systemctl", "list-jobs", "--no-legend", "--plain", "--full", unit],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    for line in str(done.stdout).splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[1] == unit:
            return fields[2]
    return ""


def summary(results: Sequence[Handed]) -> Mapping[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return counts
