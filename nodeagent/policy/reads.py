"""What a policy reads, declared as data beside what it writes, and how the plan cache
keys each part of it.

A policy's class says which sections of the policy file, which parts of the snapshot,
which figures of each workload and which of its own carried state it reads (`Reads`, the
class's `reads`), as `writes` says what it may change. The plan cache
(nodeagent.policy.plancache) keys the last plan by the union of what the policies in use
declare, each part the one way the tables here say, so that no policy extends a key by
hand and none can forget to. The unit suite hands every policy that the plan runs views
that refuse whatever it did not declare (tests/unit/readguard.py): a read left out of
`reads` fails a test instead of keeping a stale plan for up to `agent.replan_interval`.

How the cache treats each part a policy may declare:

- the workloads (which there are, and how each is claimed) and the declared sections of
  the policy file (by identity: a reload makes them new): always keyed;
- `KEYED` parts of the snapshot: keyed by value (which GPUs are held and who runs on
  them, which cgroups were skipped, which levels there are);
- `local_seconds`: keyed by which of the policy's daily windows (`Policy.windows`) it is in;
- `wall_time` (`MOVING`): moves every tick, so the plan is made anew every tick while the
  policy reads some workload every tick (`Policy.needs`): a deadline job's progress
  against its deadline;
- the workload figures in `ACTIVITY`: keyed as each workload's being active or idle;
- `usage`: keyed as each tenant's part of the decayed usage, to the percent;
- `at_work`: keys of its carried state that, while any holds something, make the plan
  anew every tick (a controller between its calm states);
- the rest (`FIGURES`: the node's figures, each workload's others) moves every tick and is
  not keyed: a plan made from them stands until `agent.replan_interval`, or until the
  policy's `stale_sensed` says (a threshold on a figure, which no declaration says).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

from nodeagent.policyfile.model import PolicySpec
from nodeagent.snapshot import CgroupSample, NodeSnapshot, WorkloadState

KEYED = frozenset({"gpus", "skipped", "levels"})
"""Parts of the snapshot the key holds by value (plancache.snapshot_key)."""
WINDOWED = frozenset({"local_seconds"})
"""Keyed by which of the policy's daily windows the local time is in."""
MOVING = frozenset({"wall_time"})
"""Move every tick: the plan is made anew while the policy reads some workload every tick."""
COVERED = frozenset({"vanished"})
"""Keyed through the workloads: a workload that vanished has left them."""
FIGURES = frozenset({"seq", "elapsed", "node", "overwritten"})
"""Figures of the node that move every tick: not keyed (`agent.replan_interval`)."""
SNAPSHOT = frozenset(f.name for f in fields(NodeSnapshot)) - {"workloads"}
"""What of the snapshot a policy may declare; its workloads' list it always reads."""

ACTIVITY = frozenset({"cpu_rate", "populated"})
"""Figures of a workload keyed as its being active or idle (fair share's `is_active`)."""
WORKLOAD = (
    frozenset(f.name for f in fields(WorkloadState))
    | frozenset(f.name for f in fields(CgroupSample))
) - {"identity", "sample"}
"""What of each workload a policy may declare; its identity it always reads."""

SECTIONS = frozenset(PolicySpec.model_fields)
"""The sections of the policy file."""


@dataclass(frozen=True, slots=True)
class Reads:
    """What one policy reads of its input (`PolicyInput`), besides the workloads' list,
    their identities and claims (`assignments`), and what earlier policies said this tick,
    which every policy is given."""

    settings: frozenset[str] = frozenset()
    """Sections of the policy file (fields of `PolicySpec`: "classes", "fair_share")."""
    snapshot: frozenset[str] = frozenset()
    """Parts of the snapshot besides its workloads (fields of `NodeSnapshot`: "gpus")."""
    workload: frozenset[str] = frozenset()
    """Figures of each workload (fields of `WorkloadState` and `CgroupSample`)."""
    usage: bool = False
    """The tenants' decayed usage (`PolicyInput.tenant_usage`)."""
    carry: bool = False
    """Its own carried state (`PolicyInput.carried`, under its name; no other's)."""
    at_work: frozenset[str] = frozenset()
    """Keys of its carried state that, while any holds something, mean it is at work:
    the plan is made anew every tick."""

    def __post_init__(self) -> None:
        """A name that is no field is a typo that would key nothing: refused where the
        policy's class is defined."""
        for given, known, what in (
            (self.settings, SECTIONS, "policy file section"),
            (self.snapshot, SNAPSHOT, "snapshot part"),
            (self.workload, WORKLOAD, "workload figure"),
        ):
            if unknown := given - known:
                raise ValueError(f"no {what} {', '.join(sorted(unknown))}")
        if self.at_work and not self.carry:
            raise ValueError("at_work names carried keys: declare carry too")

    def __or__(self, other: Reads) -> Reads:
        """What either reads."""
        return Reads(
            self.settings | other.settings,
            self.snapshot | other.snapshot,
            self.workload | other.workload,
            self.usage or other.usage,
            self.carry or other.carry,
            self.at_work | other.at_work,
        )

    @staticmethod
    def union(reads: Iterable[Reads]) -> Reads:
        out = Reads()
        for r in reads:
            out |= r
        return out


PIPELINE = Reads(settings=frozenset({"agent", "fair_share", "tenants"}))
"""What the plan itself reads of the policy file around the policies (how each cgroup may
be written, the usage history's half-life, the tenants kept)."""

Window = tuple[int, int]
"""A daily window: from and to, in seconds since local midnight; it may wrap past it."""

DAY = 86_400


def inside(window: Window, local_seconds: float | None) -> bool:
    """Whether the local time is in the window (never when the time is unknown)."""
    if local_seconds is None:
        return False
    start, end = window
    now = local_seconds % DAY
    if start <= end:
        return start <= now < end
    return now >= start or now < end  # e.g. 22:00 to 06:00
