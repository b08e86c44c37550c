"""Decayed usage history per tenant: U' = U·2^(-Δt/half_life) + usage during Δt.

This is Slurm's decayed usage; with it, a tenant that used more than its share
recently gets less now, and the memory fades with the half-life.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from nodeagent.policy.base import Assignment
from nodeagent.policy.classify import outer_claims
from nodeagent.snapshot import NodeSnapshot


def decay(usage: Mapping[str, float], elapsed: float, half_life: float) -> dict[str, float]:
    factor = 0.5 ** (max(0.0, elapsed) / half_life)
    return {t: u * factor for t, u in usage.items()}


def tick_usage(
    snapshot: NodeSnapshot,
    assignments: Mapping[str, Assignment],
    outer: Collection[str] | None = None,
) -> dict[str, float]:
    """Core-seconds each tenant used since the previous snapshot. `outer`: the claims'
    `outer_claims`, when the caller keeps them from tick to tick."""
    used: dict[str, float] = {}
    elapsed = snapshot.elapsed
    if not elapsed:
        return used
    if outer is None:
        outer = outer_claims(assignments)  # their CPU holds the claims' below them
    for w in snapshot.workloads:
        rate = w.cpu_rate
        if rate is None:
            continue
        path = w.identity.path
        a = assignments.get(path)
        if a is not None and path not in outer:
            used[a.tenant] = used.get(a.tenant, 0.0) + rate * elapsed
    return used


def advance(
    previous: Mapping[str, float],
    snapshot: NodeSnapshot,
    assignments: Mapping[str, Assignment],
    half_life: float,
    outer: Collection[str] | None = None,
) -> dict[str, float]:
    aged = decay(previous, snapshot.elapsed or 0.0, half_life)
    for tenant, used in tick_usage(snapshot, assignments, outer).items():
        aged[tenant] = aged.get(tenant, 0.0) + used
    return aged
