"""What the loop and the API threads share: a save of one never undoes the other's."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import structlog

from nodeagent import state
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import Agent, open_agent
from nodeagent.policy.base import Assignment
from nodeagent.policyfile.model import PolicySpec, WorkloadClass


def _agent(tmp_path: Path) -> Agent:
    root = tmp_path / "cgroup"
    root.mkdir()
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"state_file": str(tmp_path / "state.json")},
            "tenants": {"t": {"shares": 1}},
            "rules": [{"name": "all", "match": {}, "tenant": "t"}],
        }
    )
    return open_agent(spec, CgroupTree(str(root)))


def test_a_later_save_is_never_replaced_by_an_earlier_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's save reads the state, then is slow to write it; meanwhile an API thread
    saves a new job. Saves are one at a time, so the file ends with the job (before the
    fix, the loop's older state was renamed into place last and the job was lost)."""
    agent = _agent(tmp_path)
    writing = threading.Event()
    go_on = threading.Event()
    real_save = state.save

    def slow_first(path: str, saved: state.SavedState) -> None:
        if not writing.is_set():
            writing.set()
            go_on.wait(10)
        real_save(path, saved)

    monkeypatch.setattr(state, "save", slow_first)
    loop = threading.Thread(target=agent.save_state)
    loop.start()
    assert writing.wait(10)
    # what changed after the loop's save had read the state
    agent.rec.feedback = replace(agent.rec.feedback, usage={"t": 42.0})
    api = threading.Thread(target=agent.save_state)
    api.start()
    api.join(0.3)
    go_on.set()
    loop.join(10)
    api.join(10)
    saved = json.loads((tmp_path / "state.json").read_text())
    assert saved["tenant_usage"] == {"t": 42.0}


def test_a_refusal_is_said_once_while_its_cgroup_is_claimed(tmp_path: Path) -> None:
    """A tick where the runtime's answer came late (the claim unread, nothing refused) does
    not make the next tick say the same refusal again (seen with real containerd in the VM);
    a cgroup that goes and comes back is told again."""
    agent = _agent(tmp_path)
    refused = "pod ns/p claims tenant 'prod', which namespace ns may not use; refused"
    with_claim = {"pods/c": Assignment("pods", "t", WorkloadClass.BATCH, refused=(refused,))}
    unread = {"pods/c": Assignment("pods", "t", WorkloadClass.BATCH)}
    with structlog.testing.capture_logs() as logs:
        for assignments in (with_claim, unread, with_claim, {}, with_claim):
            agent.rec._say_refused(assignments)
    said = [e["refused"] for e in logs if e["event"] == "rule.value_refused"]
    assert said == [refused, refused]  # once, then again after the cgroup went
