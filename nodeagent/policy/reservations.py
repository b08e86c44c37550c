"""Class reservations: CPU kept for a class, as a floor for its active cgroups.

A class with `reserved_cpu` gets that much CPU when it wants it, split evenly across its
active cgroups, on top of their fair share of the rest (weights are work-conserving: an
idle class's reservation is used by the others until it wakes). Deadline floors plan
around every reservation (see `policy.cpu`), and the protection controller throttles
lower classes when a reserved class stalls.
"""

from __future__ import annotations

from collections.abc import Sequence

from nodeagent.policy.base import Floor, Output, Policy, PolicyInput
from nodeagent.policy.classify import outer_claims
from nodeagent.policy.cpu import reserved
from nodeagent.policy.fairshare import is_active
from nodeagent.policy.reads import Reads


class Reservations(Policy):
    name = "reservations"
    reads = Reads(
        settings=frozenset({"classes", "fair_share", "node"}),
        snapshot=frozenset({"node"}),
        workload=frozenset({"cpu_rate", "populated"}),
    )

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        out: list[Output] = []
        left_out = {p for p, f in given.floors().items() if f.exclusive}
        left_out |= outer_claims(given.assignments)  # the claims below them take it
        for cls, total in reserved(given).items():
            members = [
                w.path
                for w in given.snapshot.workloads
                if (a := given.assignments.get(w.path)) is not None
                and a.workload_class is cls
                and w.path not in left_out
                and is_active(w, given.spec.fair_share)
            ]
            for path in members:
                out.append(
                    Floor(
                        path,
                        total / len(members),
                        self.name,
                        f"class {cls} reserves {total:.2f} cores,"
                        f" split over {len(members)} active cgroup(s)",
                    )
                )
        return out
