"""The usage history across a restart: a daemon starting on a state file saved `t` seconds
ago loads each tenant's usage decayed by exactly the time away, U * 2^(-t / half_life),
keeps only the tenants still in the policy, and a clock that went backwards decays nothing
(never grows the history).

The daemon starts on an empty plain directory (no cgroups: it only restores its state).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nodeagent import state
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import Agent, open_agent
from nodeagent.policyfile.model import PolicySpec

HALF_LIFE = 3600.0


def started(tmp_path: Path, usage: dict[str, float], away: float) -> tuple[Agent, float, float]:
    """A daemon started on a state file saved `away` seconds before; with the bounds of
    how long it really was away (the file is written, then the daemon starts)."""
    path = tmp_path / "state.json"
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"state_file": str(path)},
            "fair_share": {"half_life": HALF_LIFE},
            "tenants": {"research": {"shares": 2}, "prod": {"shares": 1}},
        }
    )
    (tmp_path / "cgroup").mkdir(exist_ok=True)
    before = time.time()
    state.save(str(path), state.SavedState(before - away, usage))
    agent = open_agent(spec, CgroupTree(str(tmp_path / "cgroup")), dry_run=True)
    return agent, away, away + time.time() - before


@pytest.mark.parametrize("away", [0.0, 600.0, HALF_LIFE, 2 * HALF_LIFE, 10 * HALF_LIFE])
def test_the_history_loads_decayed_by_the_time_away(tmp_path: Path, away: float) -> None:
    agent, least, most = started(tmp_path, {"research": 1000.0, "prod": 40.0}, away)
    assert set(agent.rec.feedback.usage) == {"research", "prod"}
    for tenant, saved in (("research", 1000.0), ("prod", 40.0)):
        assert saved * 0.5 ** (most / HALF_LIFE) <= agent.rec.feedback.usage[tenant]
        assert agent.rec.feedback.usage[tenant] <= saved * 0.5 ** (least / HALF_LIFE)
    if away == 2 * HALF_LIFE:
        assert agent.rec.feedback.usage["research"] == pytest.approx(250.0, rel=1e-4), "a quarter"


def test_a_tenant_gone_from_the_policy_is_not_restored(tmp_path: Path) -> None:
    agent, _, _ = started(tmp_path, {"research": 1000.0, "gone": 500.0}, HALF_LIFE)
    assert set(agent.rec.feedback.usage) == {"research"}
    assert agent.rec.feedback.usage["research"] == pytest.approx(500.0, rel=1e-4)


def test_a_file_from_the_future_is_taken_as_saved_now(tmp_path: Path) -> None:
    """A wall clock stepped back since the save: no time away, so no decay, and no growth."""
    agent, _, _ = started(tmp_path, {"research": 1000.0}, -HALF_LIFE)
    assert agent.rec.feedback.usage == {"research": 1000.0}
