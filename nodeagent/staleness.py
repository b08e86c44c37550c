"""When the loop counts as stalled: no tick for max(`STALE_TICKS` x agent.interval,
`STALE_MIN`) seconds.

One rule for both places that say so: /healthz answers 503 (nodeagent.metrics.server) and
/v1/status lists a problem (nodeagent.routes.agent). Pure, below both, so that neither
imports the other for it.
"""

from __future__ import annotations

STALE_TICKS = 3
"""Ticks' worth of agent.interval without one."""
STALE_MIN = 30.0
"""Seconds at least, however short agent.interval is."""


def stale_window(interval: float) -> float:
    """Seconds without a tick after which the loop counts as stalled, for `interval`
    (agent.interval, seconds)."""
    return max(STALE_TICKS * interval, STALE_MIN)
