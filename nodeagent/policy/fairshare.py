"""Fair share between tenants: cpu.weight follows shares, corrected by decayed usage.

Each tenant with active workloads gets a slice of a weight budget (on average
`weight_per_workload` per active workload, so managed cgroups compete evenly
with unmanaged siblings at the kernel default of 100). The slice is
proportional to s·F, where s is the tenant's normalised share and
F = 2^(-u/s) is Slurm's fair-share factor with u the tenant's normalised decayed
usage: a tenant that has used exactly its share keeps it, one that used more is
pulled back. The slice is split evenly across the tenant's active workloads, so
a tenant's CPU does not grow with the number of cgroups it runs. A weight
within `deadband` of its target is kept, so usage noise does not rewrite
every cgroup on every tick. Tenants with no active workload get no decision:
the kernel ignores an idle cgroup's weight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from nodeagent.cgroupfs.values import WEIGHT_MAX, WEIGHT_MIN, Attribute, CpuWeight
from nodeagent.policy.base import Decision, PolicyInput, Skip
from nodeagent.snapshot import WorkloadState
from nodeagent.spec.model import FairShareSettings


def is_active(w: WorkloadState, settings: FairShareSettings) -> bool:
    """Holds processes and used CPU last tick (unknown on the first tick counts as active)."""
    if w.sample.populated is False:
        return False
    return w.cpu_rate is None or w.cpu_rate >= settings.active_threshold


def _within_deadband(w: WorkloadState, target: int, deadband: float) -> int | None:
    """The current weight, when it is close enough to the target that a write is churn."""
    current = w.sample.settings.get(Attribute.CPU_WEIGHT)
    if isinstance(current, CpuWeight) and abs(current.value - target) <= deadband * target:
        return current.value
    return None


def _parts(
    shares: Mapping[str, float], total_shares: float, u: Mapping[str, float]
) -> dict[str, float]:
    """Each tenant's s*F / sum(s*F), computed on base-2 exponents relative to the largest.

    With s = shares/total and F = 2^(-u/s), a tiny share or a large usage ratio makes s*F
    underflow to 0 for every tenant, and the plain quotient 0/0. Relative to the largest
    exponent the largest term is exactly 1, so the sum is at least 1 and every part is
    defined, whatever the shares.
    """
    exponent = {
        t: math.log2(shares[t]) - math.log2(total_shares) - u[t] * total_shares / shares[t]
        for t in shares
    }
    top = max(exponent.values(), default=0.0)
    if not math.isfinite(top):  # cannot happen with bounded shares; stay defined anyway
        return {t: 1 / len(shares) for t in shares}
    rel = {t: 2.0 ** max(-1074.0, e - top) for t, e in exponent.items()}
    norm = sum(rel.values())
    return {t: r / norm for t, r in rel.items()}


def _clamp(weight: float) -> int:
    return max(WEIGHT_MIN, min(WEIGHT_MAX, round(weight)))


class FairShare:
    name = "fair-share"

    def decide(self, given: PolicyInput) -> Sequence[Decision | Skip]:
        settings = given.spec.fair_share
        members: dict[str, list[WorkloadState]] = {}
        active: dict[str, int] = {}
        for w in given.snapshot.workloads:
            a = given.assignments.get(w.path)
            if a is None:
                continue
            members.setdefault(a.tenant, []).append(w)
            if is_active(w, settings):
                active[a.tenant] = active.get(a.tenant, 0) + 1

        shares = {t: given.spec.tenants[t].shares for t in active}
        usage = {t: given.tenant_usage.get(t, 0.0) for t in active}
        total_shares, total_usage = sum(shares.values()), sum(usage.values())
        n_active = sum(active.values())
        budget = settings.weight_per_workload * n_active
        s = {t: shares[t] / total_shares for t in active}
        u = {t: usage[t] / total_usage if total_usage > 0 else 0.0 for t in active}
        part = _parts(shares, total_shares, u)
        f = {t: 2.0 ** max(-1074.0, -u[t] * total_shares / shares[t]) for t in active}
        decisions: list[Decision | Skip] = []
        for tenant, workloads in members.items():
            if tenant not in active:
                continue  # idle weights do not matter to the kernel; leave them as they are
            tenant_budget = budget * part[tenant]
            weight = _clamp(tenant_budget / active[tenant])
            trace: tuple[str, ...] = (
                f"tenant {tenant}: shares {shares[tenant]:g} of {total_shares:g} among tenants"
                f" with active workloads, s={s[tenant]:.3f}",
                f"decayed usage {usage[tenant]:.1f} of {total_usage:.1f} core-s,"
                f" u={u[tenant]:.3f}, F=2^(-u/s)={f[tenant]:.3f}",
                f"budget {settings.weight_per_workload} x {n_active} active = {budget};"
                f" tenant gets s*F/sum(s*F) = {part[tenant]:.3f}"
                f" of it = {tenant_budget:.1f}",
                f"split over {active[tenant]} active workload(s) -> {weight}",
            )
            reason = (
                f"fair share: tenant {tenant} {part[tenant]:.0%} of weight,"
                f" split over {active[tenant]} active"
            )
            for w in workloads:
                value, why = weight, trace
                kept = _within_deadband(w, weight, settings.deadband)
                if kept is not None:
                    value, why = kept, (*trace, f"kept {kept}: within the deadband of {weight}")
                decisions.append(
                    Decision(w.path, Attribute.CPU_WEIGHT, CpuWeight(value), self.name, reason, why)
                )
        return decisions
