"""The API's reads answer from the view the loop last published (report.AgentView), never
from what the loop is changing: a read during a tick sees the previous tick whole, and a
command's effect is seen by the next read, not the next tick."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from daemon_api import ROOT, daemon


def test_a_read_during_a_tick_sees_the_previous_tick_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = daemon(tmp_path)
    d.start(ROOT, "a")
    assert d.jobs() == ["a"], "a command's effect is read at once"
    d.agent.tick()
    status = d.call(ROOT, "GET", "/v1/status")
    allocations = d.call(ROOT, "GET", "/v1/allocations")
    midway, go_on = threading.Event(), threading.Event()
    apply = d.agent.rec.executor.apply

    def held_apply(*args: Any, **kwargs: Any) -> Any:
        """The writes, once the tick has sensed, planned and reaped the job: the test reads
        while the loop is here."""
        midway.set()
        assert go_on.wait(30), "the test never let the tick go on"
        return apply(*args, **kwargs)

    monkeypatch.setattr(d.agent.rec.executor, "apply", held_apply)
    d.exit("a")  # its command exited: this tick's act reaps the job, before its writes
    tick = threading.Thread(target=d.agent.tick)
    tick.start()
    try:
        assert midway.wait(30), "the tick never reached its writes"
        assert d.agent.rec.jobs.running() == [], "the loop has already reaped the job"
        during = d.call(ROOT, "GET", "/v1/status")
        keys = ("tick", "tick_time", "workloads", "deadline_misses", "runtimes")
        assert {k: during[k] for k in keys} == {k: status[k] for k in keys}
        assert d.call(ROOT, "GET", "/v1/allocations") == allocations
        assert d.jobs() == ["a"], "the job as the last published view has it"
    finally:
        go_on.set()
        tick.join(30)
    assert not tick.is_alive()
    assert d.call(ROOT, "GET", "/v1/status")["tick"] == status["tick"] + 1
    assert d.jobs() == [], "the tick's view, published at its end"
