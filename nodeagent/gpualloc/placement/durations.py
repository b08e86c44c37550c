"""How long GPU jobs are expected to hold their GPUs, as placement's inputs; pure.

A job that declares a deadline is planned to end by it, or sooner when its declared work
at its CPUs' rate is done sooner (`exec --deadline/--work/--cpus`). A job that declares
nothing is expected to hold its GPUs as long as its class's recent holds did (the median
of the last HISTORY). Placement gets three things from these estimates: the request's
expected duration, the moments the held GPUs are expected back, and how long a waiting
request may still wait for a better set (its patience).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from nodeagent.policyfile.model import GpuSettings

HISTORY = 20
"""Holds per class whose durations are kept for its estimate."""
PATIENCE = GpuSettings().patience
"""gpu.patience's default: the share of a waiting job's expected duration it may wait for a
better set."""


def declared_duration(
    deadline_in: float | None, work: float | None, cpus: float | None
) -> float | None:
    """What a job's own declaration says: seconds to its deadline, or its work (CPU
    seconds) over its CPUs when that ends sooner; None without a deadline."""
    if deadline_in is None:
        return None
    ends = max(deadline_in, 0.0)
    if work is not None and cpus:
        ends = min(ends, work / cpus)
    return ends


def expected_duration(declared: float | None, history: Sequence[float]) -> float | None:
    """The declared duration if any, else the median of the class's last HISTORY holds,
    else None (unknown)."""
    if declared is not None:
        return declared
    recent = history[-HISTORY:]
    return statistics.median(recent) if recent else None


def patience(share: float, expected: float | None, held_back: float) -> float:
    """Seconds a waiting request may still wait for a better set: `share` of its expected
    duration less what it has already waited for one; none when its duration is unknown."""
    if expected is None:
        return 0.0
    return max(share * expected - held_back, 0.0)


def releases(holds: Iterable[tuple[Iterable[str], float | None]]) -> dict[str, float]:
    """Seconds until each held GPU is expected back, from its holds' expected remaining
    times: the latest of them. A GPU with a hold of unknown end, or one past its expected
    end (running late, so no longer predictable), is left out: unknown."""
    latest: dict[str, float] = {}
    unknown: set[str] = set()
    for uuids, remaining in holds:
        for uuid in uuids:
            if remaining is None or remaining <= 0:
                unknown.add(uuid)
            else:
                latest[uuid] = max(latest.get(uuid, 0.0), remaining)
    return {uuid: t for uuid, t in latest.items() if uuid not in unknown}
