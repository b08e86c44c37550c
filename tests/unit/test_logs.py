"""Log output as journald and the benchmarks will read it."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator

import pytest
import structlog

from nodeagent import journal, logs
from nodeagent.errors import NodeagentError


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_audit_write_is_one_json_event_with_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(fmt="json")
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
    logs.configure(fmt="json")
    logs.audit_write("nodeagent/job1", "memory.high", None, "max", "created")
    [event] = json_lines(capsys.readouterr().err)
    assert event["old"] is None


def test_audit_is_not_hidden_by_the_level(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(level="error", fmt="json")
    structlog.get_logger("nodeagent.test").info("chatter")
    logs.audit_write("a", "cpu.max", "max 100000", "50000 100000", "limit")
    events = json_lines(capsys.readouterr().err)
    assert [e["event"] for e in events] == ["cgroup.write"]


def test_level_filters_ordinary_events(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(level="warning", fmt="json")
    log = structlog.get_logger("nodeagent.test")
    log.info("quiet")
    log.warning("loud", n=1)
    events = json_lines(capsys.readouterr().err)
    assert [(e["event"], e["level"], e["n"]) for e in events] == [("loud", "warning", 1)]


def test_exceptions_are_rendered_into_the_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(fmt="json")
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
    logs.configure(fmt="console")
    structlog.get_logger("nodeagent.test").info("hello", k="v")
    err = capsys.readouterr().err
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[info\s*\] hello\s+k=v\n", err)


@pytest.mark.parametrize("level", ["verbose", "notset", ""])
def test_unknown_level_is_refused(level: str) -> None:
    with pytest.raises(NodeagentError, match="unknown log level"):
        logs.configure(level=level)


def test_the_console_shows_control_characters_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    """A cgroup named with an escape sequence (any byte but '/' may be in a path) must reach a
    terminal as text (issue 12, item 23: `\\x1b]0;...\\x07` set the terminal's title)."""
    logs.configure(fmt="console")
    hostile = "/sys/fs/cgroup/a\x1b]0;owned\x07b\nfake line"
    structlog.get_logger("nodeagent.test").warning(
        "cgroup.vanished\x1b[2J", path=hostile, note="tab\there\x9b1m"
    )
    err = capsys.readouterr().err
    assert not set(err) & {"\x1b", "\x07", "\t", "\x9b"}
    assert err.count("\n") == 1  # one record, one line: no forged second line
    assert "path='/sys/fs/cgroup/a␛]0;owned␇b␊fake line'" in err
    assert "note=tab␉here\\x9b1m" in err
    assert "cgroup.vanished␛[2J" in err


def test_a_traceback_on_the_console_keeps_its_lines_but_not_escapes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs.configure(fmt="console")
    try:
        raise ValueError("no such cgroup x\x1b]0;t\x07y")
    except ValueError:
        structlog.get_logger("nodeagent.test").exception("tick.failed")
    err = capsys.readouterr().err
    assert "\x1b" not in err
    assert "Traceback (most recent call last):\n" in err
    assert "ValueError: no such cgroup x␛]0;t␇y" in err


def _journal_is(monkeypatch: pytest.MonkeyPatch, fd: int) -> None:
    st = os.fstat(fd)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")


def test_lines_carry_their_syslog_priority_when_stderr_is_the_journal(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """journald files a line that starts `<3>` at priority err (sd-daemon(3)): then
    `journalctl -p err -u nodeagent` shows policy.invalid (issue 13, item 5)."""
    _journal_is(monkeypatch, 2)  # what systemd sets when StandardError=journal
    logs.configure(level="debug", fmt="json")
    log = structlog.get_logger("nodeagent.test")
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("policy.invalid", problem="x")
    log.critical("c")
    logs.audit_write("a", "cpu.max", "max 100000", "50000 100000", "rule")
    lines = capfd.readouterr().err.splitlines()
    assert [line[:3] for line in lines] == ["<7>", "<6>", "<4>", "<3>", "<2>", "<6>"]
    assert [json.loads(line[3:])["event"] for line in lines] == [
        "d", "i", "w", "policy.invalid", "c", "cgroup.write"
    ]  # fmt: skip


def test_no_priority_prefix_when_stderr_is_not_that_stream(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that inherited $JOURNAL_STREAM but writes elsewhere (a pipe, a file) stays
    plain JSON."""
    _journal_is(monkeypatch, 0)  # stdin's, not stderr's
    logs.configure(fmt="json")
    structlog.get_logger("nodeagent.test").error("e")
    [line] = capfd.readouterr().err.splitlines()
    assert line.startswith("{")
    monkeypatch.setenv("JOURNAL_STREAM", "garbage")
    assert journal.stderr_is_the_journal() is False


@pytest.mark.parametrize(("no_color", "tty", "coloured"), [
    (None, True, True), ("1", True, False), ("", True, True), (None, False, False),
])  # fmt: skip
def test_the_console_log_is_coloured_only_on_a_terminal_without_no_color(
    monkeypatch: pytest.MonkeyPatch, no_color: str | None, tty: bool, coloured: bool
) -> None:
    """NO_COLOR (no-color.org) turns off the console log's colours as it does the CLI's."""
    import sys

    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    assert logs.console_colours() is coloured
