"""A tick is four calls (Reconciler.tick): sense and decide change nothing outside the agent,
act makes every effect, record keeps what the tick leaves. The test stops a tick between its
calls and looks: an ended job is found by decide but reaped only by act, a cgroup write is
planned by decide but made only by act, and the API's view changes only at record."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from daemon_api import ROOT, daemon

from nodeagent.act import Outcome


def test_only_act_changes_the_node_and_only_record_the_view(tmp_path: Path) -> None:
    d = daemon(tmp_path)
    rec = d.agent.rec
    d.start(ROOT, "a", memory=64 << 20)
    d.start(ROOT, "b")
    d.agent.tick()
    d.exit("a")
    (d.root / "nodeagent.slice" / "b" / "cpu.weight").write_text("1\n")  # drifted
    rec.feedback = replace(rec.feedback, read_all=True)  # every file read: the drift is seen
    writes: list[tuple[str, str]] = []
    rec.executor.audit = lambda path, attr, old, new, why: writes.append((path, attr))
    view = rec.view

    started = time.monotonic()
    sensed = rec.sense(started)
    decided = rec.decide(sensed, started)
    assert [j.name for j in decided.ended] == ["a"], "decide finds the job that ended"
    assert {j.name for j in rec.jobs.running()} == {"a", "b"}, "and reaps nothing"
    assert (d.root / "nodeagent.slice" / "a").is_dir(), "its cgroup is still there"
    assert (d.root / "nodeagent.slice" / "b" / "cpu.weight").read_text() == "1\n"
    assert writes == [], "sense and decide write nothing"
    assert rec.view is view, "nor does the API see anything new"

    applied = rec.act(sensed, decided)
    assert [j.name for j in rec.jobs.running()] == ["b"], "act reaps the ended job"
    repaired = [r for r in applied if r.path.endswith("/b") and str(r.attribute) == "cpu.weight"]
    assert [r.outcome for r in repaired] == [Outcome.WRITTEN], "act repairs the drift"
    assert (d.root / "nodeagent.slice" / "b" / "cpu.weight").read_text() != "1\n"
    assert rec.view is view, "the view is still the last tick's"

    record = rec.record(sensed, decided, applied, started)
    assert rec.view is not view and rec.view.record is record, "record publishes the tick"
    assert [j["name"] for j in rec.view.jobs] == ["b"]
