"""Logs for the journal (issue 36, item 9): native entries with a line a person reads and
every field kept apart, and the same format choice for every command a unit runs.

journald itself is a stand-in here: a datagram socket this test binds and reads, decoded by
the protocol systemd documents ("Native Journal Protocol"). The kernel tests read the real
journal (tests/kernel/test_service.py, test_package.py).
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from nodeagent import journal, logs
from nodeagent.cli import main
from nodeagent.cli.output import report
from nodeagent.errors import NodeagentError


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


class Journald:
    """The stand-in: a datagram socket where journald's would be."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(5)

    def entry(self) -> dict[str, bytes]:
        """The next entry's fields, from a datagram or from the memfd it passed."""
        data, fds = _receive(self.sock)
        if fds:
            [fd] = fds
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_SHRINK, seals
            with open(fd, "rb") as f:  # the sender's file offset is at its end: from 0
                data = os.pread(f.fileno(), os.fstat(fd).st_size, 0)
        return decode(data)


def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(fds.itemsize))
    for level, kind, payload in ancdata:
        if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def decode(data: bytes) -> dict[str, bytes]:
    """A native entry's fields: `NAME=value\\n`, or NAME, a newline, a 64-bit little-endian
    length, the value and a newline."""
    fields: dict[str, bytes] = {}
    at = 0
    while at < len(data):
        end = data.index(b"\n", at)
        line = data[at:end]
        if b"=" in line:
            name, _, value = line.partition(b"=")
            at = end + 1
        else:
            name = line
            (size,) = struct.unpack("<Q", data[end + 1 : end + 9])
            value = data[end + 9 : end + 9 + size]
            assert data[end + 9 + size : end + 10 + size] == b"\n"
            at = end + 10 + size
        assert name.decode() not in fields, name
        fields[name.decode()] = value
    return fields


def _stderr_is_the_journal(monkeypatch: pytest.MonkeyPatch) -> None:
    """What systemd says for StandardError=journal: fd 2's device and inode."""
    st = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")


@pytest.fixture
def journald(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Journald]:
    stand_in = Journald(tmp_path / "socket")
    monkeypatch.setattr(journal, "SOCKET", str(stand_in.path))
    _stderr_is_the_journal(monkeypatch)
    yield stand_in
    stand_in.sock.close()


def test_auto_picks_the_journal_when_stderr_is_its_stream(journald: Journald) -> None:
    assert logs.configure() == "journal"


def test_auto_picks_json_where_the_journal_cannot_be_reached(
    journald: Journald, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a container $JOURNAL_STREAM may be inherited while no journald socket is there."""
    monkeypatch.setattr(journal, "SOCKET", str(journald.path.with_name("gone")))
    assert logs.configure() == "json"
    with pytest.raises(NodeagentError, match=r"^--log-format journal: no journald socket at "):
        logs.configure(fmt="journal")


def test_an_entry_has_a_line_to_read_and_every_field_apart(journald: Journald) -> None:
    logs.configure()
    path = "/sys/fs/cgroup/system.slice/docker-3f.scope/cpu.max"
    logs.audit_write(path, "cpu.max", None, "25000 100000", "rule gpu-train")
    fields = journald.entry()
    assert fields == {
        "MESSAGE": (
            f"cgroup.write path={path} attribute=cpu.max old=null"
            ' new="25000 100000" reason="rule gpu-train"'
        ).encode(),
        "PRIORITY": b"6",
        "SYSLOG_IDENTIFIER": b"nodeagent",
        "NODEAGENT_EVENT": b"cgroup.write",
        "NODEAGENT_PATH": path.encode(),
        "NODEAGENT_ATTRIBUTE": b"cpu.max",
        "NODEAGENT_OLD": b"null",
        "NODEAGENT_NEW": b"25000 100000",
        "NODEAGENT_REASON": b"rule gpu-train",
    }


def test_levels_are_priorities_and_values_not_strings_are_json(journald: Journald) -> None:
    logs.configure(level="debug")
    log = structlog.get_logger("nodeagent.test")
    log.debug("d")
    log.warning("w", count=3, ratio=0.5, gpus=["GPU-a", "GPU-b"], ok=True)
    log.error("policy.invalid", problem='x "quoted" = y')
    log.critical("c")
    entries = [journald.entry() for _ in range(4)]
    assert [e["PRIORITY"] for e in entries] == [b"7", b"4", b"3", b"2"]
    warned = entries[1]
    assert warned["MESSAGE"] == b'w count=3 ratio=0.5 gpus=["GPU-a","GPU-b"] ok=true'
    assert (warned["NODEAGENT_COUNT"], warned["NODEAGENT_GPUS"]) == (b"3", b'["GPU-a","GPU-b"]')
    assert entries[2]["MESSAGE"] == b'policy.invalid problem="x \\"quoted\\" = y"'


def test_a_name_cannot_forge_a_line_but_its_field_keeps_it_exact(journald: Journald) -> None:
    """A cgroup's name may hold a newline, escapes and bytes that are not UTF-8: MESSAGE shows
    them escaped (journalctl shows it as text, one entry); the field keeps the bytes."""
    logs.configure()
    name = "/x\ncgroup.write path=/forged\x1b]0;t\x07" + b"\xff".decode("utf-8", "surrogateescape")
    logs.audit_event("gpu.violation", cgroup=name)
    fields = journald.entry()
    assert fields["MESSAGE"] == (
        b'gpu.violation cgroup="/x\\ncgroup.write path=/forged\\x1b]0;t\\x07\\xff"'
    )
    assert fields["NODEAGENT_CGROUP"] == b"/x\ncgroup.write path=/forged\x1b]0;t\x07\xff"


def test_a_traceback_follows_the_line(journald: Journald) -> None:
    logs.configure()
    try:
        raise ValueError("no such cgroup")
    except ValueError:
        structlog.get_logger("nodeagent.test").exception("tick.failed", tick=4)
    fields = journald.entry()
    message = fields["MESSAGE"].decode()
    assert message.startswith("tick.failed tick=4\nTraceback (most recent call last):\n")
    assert message.endswith("ValueError: no such cgroup")
    assert fields["NODEAGENT_EXCEPTION"].decode() == message.partition("\n")[2]
    assert fields["PRIORITY"] == b"3"


def test_a_tracebacks_controls_are_escaped_as_the_lines_are(journald: Journald) -> None:
    logs.configure()
    try:
        raise ValueError("no /x\x1b]0;t\x07 cgroup")
    except ValueError:
        structlog.get_logger("nodeagent.test").exception("tick.failed")
    message = journald.entry()["MESSAGE"].decode()
    assert message.endswith("ValueError: no /x\\x1b]0;t\\x07 cgroup")
    assert "\x1b" not in message and "\u241b" not in message


def test_an_entry_larger_than_a_datagram_goes_as_a_sealed_memfd(journald: Journald) -> None:
    logs.configure()
    big = "a" * (4 << 20)  # over any datagram's limit (net.core.wmem_max)
    logs.audit_event("huge", value=big)
    fields = journald.entry()
    assert fields["NODEAGENT_VALUE"] == big.encode()


def test_an_entry_journald_does_not_take_goes_to_stderr(
    journald: Journald, capfd: pytest.CaptureFixture[str]
) -> None:
    """journald restarting (its socket gone for a moment): the line, behind its priority, on
    stderr, which is the journal's stream too (capfd took fd 2 over: journal by name)."""
    logs.configure(fmt="journal")
    journald.path.unlink()
    structlog.get_logger("nodeagent.test").error("tick.failed", cgroup="a b")
    assert capfd.readouterr().err == '<3>tick.failed cgroup="a b"\n'


def test_the_unit_commands_write_json_records_when_asked(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NODEAGENT_LOG_FORMAT=json in the unit's environment: validate's problems (its
    ExecStartPre=) are JSON records too, each still filed at its priority."""
    _stderr_is_the_journal(monkeypatch)  # capfd's, as it is during the test
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\ntenants:\n  t: {shares: -1}\n")
    with pytest.raises(SystemExit):
        main(["validate", "--log-format", "json", str(policy)], standalone_mode=False)
    lines = capfd.readouterr().err.splitlines()
    assert [line[:4] for line in lines] == ["<4>{", "<3>{"], lines  # no rules; a bad share
    record = json.loads(lines[1][3:])
    assert record["event"] == "policy.invalid" and record["level"] == "error"
    assert (record["file"], record["line"]) == (str(policy), 3)
    assert record["message"].startswith(f"{policy}:3:")
    assert json.loads(lines[0][3:])["event"] == "policy.warning"


def test_report_is_text_unless_json_is_asked(capfd: pytest.CaptureFixture[str]) -> None:
    report("auto", "policy.valid", "p.yaml: ok", file="p.yaml")
    report("json", "policy.valid", "p.yaml: ok", file="p.yaml")
    out = capfd.readouterr().out.splitlines()
    assert out[0] == "p.yaml: ok"
    record = json.loads(out[1])
    assert record.pop("ts") > 0
    assert record == {
        "event": "policy.valid",
        "level": "info",
        "message": "p.yaml: ok",
        "file": "p.yaml",
    }


def test_every_error_line_says_nodeagent_error(tmp_path: Path) -> None:
    """`run --config /missing` said `Error:` where every other command says `nodeagent:
    error:` (issue 36). Through the console script's entry point, which click's runner skips."""
    missing = tmp_path / "missing.yaml"
    ran = subprocess.run(
        [sys.executable, "-c", "from nodeagent.cli import entrypoint; entrypoint()", "run",
         "--config", str(missing)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert ran.returncode == 1
    assert ran.stderr.startswith(f"nodeagent: error: {missing}:1:1: cannot read"), ran.stderr
