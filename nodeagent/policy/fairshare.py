"""Fair share between tenants: each tenant's part of the CPU follows its shares, corrected
by decayed usage.

A tenant's part of the pool (the CPU left after every floor) is proportional to s·F,
where s is the tenant's normalised share and F = 2^(-u/s) is Slurm's fair-share factor
with u the tenant's normalised decayed usage: a tenant that has used exactly its share
keeps it, one that used more is pulled back. The part is split evenly across the tenant's
active workloads, so a tenant's CPU does not grow with the number of cgroups it runs.
Workloads with an exclusive floor (deadline jobs) are planned by it and take no part, and
so do claimed cgroups with claimed cgroups below them (`classify.outer_claims`);
tenants with no active workload get nothing (the kernel ignores an idle cgroup's weight).
`CpuWeights` turns the parts into cpu.weight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from nodeagent.policy.base import Output, Policy, PolicyInput, Share
from nodeagent.policy.classify import outer_claims
from nodeagent.policy.reads import Reads
from nodeagent.policyfile.model import FairShareSettings
from nodeagent.snapshot import WorkloadState


def is_active(w: WorkloadState, settings: FairShareSettings) -> bool:
    """Holds processes and used CPU last tick (unknown on the first tick counts as active)."""
    if w.sample.populated is False:
        return False
    return w.cpu_rate is None or w.cpu_rate >= settings.active_threshold


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


class FairShare(Policy):
    name = "fair-share"
    reads = Reads(
        settings=frozenset({"fair_share", "tenants"}),
        workload=frozenset({"cpu_rate", "populated"}),
        usage=True,
    )

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        settings = given.spec.fair_share
        if not settings.enabled:
            return []
        # deadline jobs are planned by their floors; outer claims by the claims below them
        left_out = {p for p, f in given.floors().items() if f.exclusive}
        left_out |= outer_claims(given.assignments)
        members: dict[str, list[WorkloadState]] = {}
        active: dict[str, int] = {}
        for w in given.snapshot.workloads:
            a = given.assignments.get(w.path)
            if a is None or w.path in left_out:
                continue
            members.setdefault(a.tenant, []).append(w)
            if is_active(w, settings):
                active[a.tenant] = active.get(a.tenant, 0) + 1

        shares = {t: given.spec.tenants[t].shares for t in active}
        usage = {t: given.tenant_usage.get(t, 0.0) for t in active}
        total_shares, total_usage = sum(shares.values()), sum(usage.values())
        s = {t: shares[t] / total_shares for t in active}
        u = {t: usage[t] / total_usage if total_usage > 0 else 0.0 for t in active}
        part = _parts(shares, total_shares, u)
        f = {t: 2.0 ** max(-1074.0, -u[t] * total_shares / shares[t]) for t in active}

        out: list[Output] = []
        for tenant, workloads in members.items():
            if tenant not in active:
                continue  # idle weights do not matter to the kernel; leave them as they are
            each = part[tenant] / active[tenant]
            trace = (
                f"tenant {tenant}: shares {shares[tenant]:g} of {total_shares:g} among tenants"
                f" with active workloads, s={s[tenant]:.3f}",
                f"decayed usage {usage[tenant]:.1f} of {total_usage:.1f} core-s,"
                f" u={u[tenant]:.3f}, F=2^(-u/s)={f[tenant]:.3f}",
                f"tenant gets s*F/sum(s*F) = {part[tenant]:.3f} of the pool,"
                f" split over {active[tenant]} active workload(s) = {each:.3f} each",
            )
            reason = (
                f"fair share: tenant {tenant} {part[tenant]:.0%} of the pool,"
                f" split over {active[tenant]} active"
            )
            out.extend(
                Share(w.path, each, self.name, reason, trace, is_active(w, settings))
                for w in workloads
            )
        return out
