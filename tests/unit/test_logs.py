"""Log output as journald and the benchmarks will read it."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest
import structlog

from nodeagent import logs
from nodeagent.errors import NodeagentError


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_audit_write_is_one_json_event_with_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(json=True)
    before = time.time()
    logs.audit_write("kubepods/pod1", "cpu.weight", "100", "400", "policy gpu-train")
    after = time.time()
    captured = capsys.readouterr()
    assert captured.out == ""
    [event] = json_lines(captured.err)
    ts = event.pop("ts")
    assert isinstance(ts, float)
    assert before <= ts <= after
    assert event == {
        "event": "cgroup.write",
        "level": "info",
        "path": "kubepods/pod1",
        "attribute": "cpu.weight",
        "old": "100",
        "new": "400",
        "reason": "policy gpu-train",
    }


def test_audit_old_value_may_be_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(json=True)
    logs.audit_write("nodeagent/job1", "memory.high", None, "max", "created")
    [event] = json_lines(capsys.readouterr().err)
    assert event["old"] is None


def test_audit_is_not_hidden_by_the_level(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(level="error", json=True)
    structlog.get_logger("nodeagent.test").info("chatter")
    logs.audit_write("a", "cpu.max", "max 100000", "50000 100000", "limit")
    events = json_lines(capsys.readouterr().err)
    assert [e["event"] for e in events] == ["cgroup.write"]


def test_level_filters_ordinary_events(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(level="warning", json=True)
    log = structlog.get_logger("nodeagent.test")
    log.info("quiet")
    log.warning("loud", n=1)
    events = json_lines(capsys.readouterr().err)
    assert [(e["event"], e["level"], e["n"]) for e in events] == [("loud", "warning", 1)]


def test_exceptions_are_rendered_into_the_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(json=True)
    try:
        raise ValueError("bad")
    except ValueError:
        structlog.get_logger("nodeagent.test").error("failed", exc_info=True)
    [event] = json_lines(capsys.readouterr().err)
    assert "ValueError: bad" in str(event["exception"])


def test_json_is_the_default_off_a_tty(capfd: pytest.CaptureFixture[str]) -> None:
    logs.configure()  # stderr is captured, so not a TTY
    structlog.get_logger("nodeagent.test").info("hello", k="v")
    [event] = json_lines(capfd.readouterr().err)
    assert (event["event"], event["k"], event["level"]) == ("hello", "v", "info")


def test_console_renderer_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(json=False)
    structlog.get_logger("nodeagent.test").info("hello", k="v")
    err = capsys.readouterr().err
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[info\s*\] hello\s+k=v\n", err)


@pytest.mark.parametrize("level", ["verbose", "notset", ""])
def test_unknown_level_is_refused(level: str) -> None:
    with pytest.raises(NodeagentError, match="unknown log level"):
        logs.configure(level=level)
