"""A cap outlives the agent's claim no more than a freeze does (issue 33): what the agent set on
a workload it still finds but that no rule claims any more (a reload dropped or narrowed the
rule) is handed back at the next tick, as `nodeagent release` hands it back at a stop: the
original value, an audit event, the record dropped. A value someone changed since is left, a
workload the scan missed keeps its cap, and a write that fails is tried again. Before, only
the stop handed them back: a container capped by a rule the operator had removed stayed
capped for as long as the agent ran.

The agent's real tick over a fixture tree laid out as the kubelet's cgroupfs driver lays out
pods (as tests/unit/test_originals_gone.py); the real kernel is in
tests/kernel/test_freeze_claim.py (a reload that unclaims a capped and frozen workload).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog
from builders import CID, CID2, POD, one_tenant, pod_tree

from nodeagent.cgroupfs.values import Attribute
from nodeagent.daemon import Agent, open_agent
from nodeagent.policyfile.model import PolicySpec

KEPT, DROPPED = f"{POD}/{CID}", f"{POD}/{CID2}"
UNCAPPED = "max 100000"
pytestmark = pytest.mark.usefixtures("files_replace_their_value")


def spec(tmp_path: Path, *containers: str) -> PolicySpec:
    """A rule capping each of `containers` at 1 CPU (none: no rule at all)."""
    rules: list[dict[str, Any]] = [
        {"name": f"cap-{n}", "match": {"path": c}, "tenant": "a", "limits": {"cpu_max": 1}}
        for n, c in enumerate(containers)
    ]
    return one_tenant(tmp_path, rules)


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    tree = pod_tree(tmp_path / "cgroup", POD, KEPT, DROPPED)
    a = open_agent(spec(tmp_path, KEPT, DROPPED), tree)
    a.rec.registry.resync()
    a.tick()
    assert cpu_max(a, KEPT) == cpu_max(a, DROPPED) == "100000 100000"
    return a


def cpu_max(a: Agent, path: str) -> str:
    return Path(a.rec.tree.root, path, "cpu.max").read_text().strip()


def recorded(a: Agent) -> set[str]:
    return {p for p, attribute, _ in a.rec.originals.items() if attribute is Attribute.CPU_MAX}


def reload(a: Agent, tmp_path: Path, *containers: str) -> None:
    a.rec.reloaded(spec(tmp_path, *containers))


def test_a_reload_that_drops_a_rule_hands_its_cap_back_at_the_next_tick(
    agent: Agent, tmp_path: Path
) -> None:
    reload(agent, tmp_path, KEPT)
    with structlog.testing.capture_logs() as logs:
        agent.tick()
    assert cpu_max(agent, DROPPED) == UNCAPPED, "handed back"
    assert cpu_max(agent, KEPT) == "100000 100000", "still claimed: still capped"
    assert recorded(agent) == {KEPT}
    [write] = [e for e in logs if str(e.get("path", "")).endswith(f"{DROPPED}/cpu.max")]
    assert (write["old"], write["new"]) == ("100000 100000", UNCAPPED)
    assert write["reason"].startswith("released: the value before nodeagent changed it")
    agent.tick()
    assert cpu_max(agent, DROPPED) == UNCAPPED, "and not capped again"


def test_a_value_someone_changed_since_is_theirs(agent: Agent, tmp_path: Path) -> None:
    Path(agent.rec.tree.root, DROPPED, "cpu.max").write_text("50000 100000\n")  # the operator's
    reload(agent, tmp_path, KEPT)
    agent.tick()
    assert cpu_max(agent, DROPPED) == "50000 100000"
    assert recorded(agent) == {KEPT}, "nothing of the agent's left there to hand back"


def test_a_workload_the_scan_missed_keeps_its_cap_and_its_record(agent: Agent) -> None:
    """Not found this tick (a scan's budget, an unreadable directory) is not unclaimed:
    handing its cap back would undo and redo it tick after tick."""
    agent.rec.registry.gone.append(DROPPED)
    agent.tick()
    assert cpu_max(agent, DROPPED) == "100000 100000"
    assert DROPPED in recorded(agent)


def test_a_hand_back_that_fails_is_logged_once_and_tried_again(
    agent: Agent, tmp_path: Path
) -> None:
    path = Path(agent.rec.tree.root, DROPPED, "cpu.max")
    path.unlink()
    path.mkdir()  # unreadable as a value: the hand-back of this one attribute fails
    reload(agent, tmp_path, KEPT)
    with structlog.testing.capture_logs() as logs:
        agent.tick()
        agent.tick()
    failed = [e for e in logs if e["event"] == "release.failed"]
    assert [(e["cgroup"], e["attribute"]) for e in failed] == [(DROPPED, "cpu.max")]
    assert "Is a directory" in failed[0]["problem"]
    assert DROPPED in recorded(agent), "kept, for the next tick and for release at the stop"
    path.rmdir()
    path.write_text("100000 100000\n")
    agent.tick()
    assert cpu_max(agent, DROPPED) == UNCAPPED
    assert recorded(agent) == {KEPT}
