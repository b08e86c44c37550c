"""One rule for a stalled loop (nodeagent.staleness): /healthz's 503 and /v1/status's
problem both come past max(3 x agent.interval, 30 s) without a tick."""

from __future__ import annotations

import pytest

from nodeagent.api.answers import Status
from nodeagent.routes.agent import problems
from nodeagent.staleness import stale_window


@pytest.mark.parametrize(
    ("interval", "window"), [(0.5, 30.0), (1.0, 30.0), (10.0, 30.0), (20.0, 60.0), (60.0, 180.0)]
)
def test_three_ticks_or_30_s_whichever_is_longer(interval: float, window: float) -> None:
    assert stale_window(interval) == window


@pytest.mark.parametrize("interval", [1.0, 10.0, 20.0, 60.0])
def test_status_says_ticks_stopped_exactly_past_the_window(interval: float) -> None:
    status = Status(
        pid=7, dry_run=False, policy_file=None, cgroup_root="/sys/fs/cgroup",
        managed_root="nodeagent.slice", tick=3, workloads=0, slurm_problem=None,
        deadline_misses=0, runtimes={}, started=0.0, tick_time=1000.0,
    )  # fmt: skip
    edge = 1000.0 + stale_window(interval)
    assert problems(status, interval, edge, None) == []
    (said,) = problems(status, interval, edge + 1.0, None)
    assert said.startswith(f"no tick for {stale_window(interval) + 1.0:.0f} s ")
