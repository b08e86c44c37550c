"""The shipped systemd units and `nodeagent unit` (issue 13, items 3 and 6); systemd itself runs
and verifies them in tests/kernel/test_systemd_unit.py and test_service.py."""

from __future__ import annotations

import errno
import os
import socket
import stat
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from nodeagent.cli import main
from nodeagent.cli.run import metrics_refused
from nodeagent.cli.units import FILES, TEMPLATE_EXECUTABLE, installed_executable, render
from nodeagent.errors import NodeagentError

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"


def directives(text: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]


def test_the_packaged_units_are_the_files_in_systemd() -> None:
    for relative in FILES:
        assert render(relative, TEMPLATE_EXECUTABLE) == (SYSTEMD / relative).read_text()


def test_render_points_every_command_at_this_install() -> None:
    exe = "/srv/tools/venv-1.2/bin/nodeagent"
    text = render("nodeagent.service", exe)
    assert "/opt/nodeagent" not in text
    commands = [
        *directives(text, "ExecStartPre"),
        *directives(text, "ExecStart"),
        *directives(text, "ExecReload"),
        *directives(text, "ExecStopPost"),
    ]
    ours = [c for c in commands if "nodeagent " in c.split(" ", 1)[0] + " "]
    assert [c.split()[0] for c in ours] == [exe] * 4
    assert [c.split()[1] for c in ours] == ["validate", "run", "reload", "release"]


@pytest.mark.parametrize(
    "bad", ["relative/nodeagent", "/opt/my tools/nodeagent", "/x/$HOME/n", "/a/%n"]
)
def test_render_refuses_paths_systemd_would_expand_or_split(bad: str) -> None:
    with pytest.raises(NodeagentError, match="absolute path"):
        render("nodeagent.service", bad)


def test_the_executable_is_the_console_script_beside_this_python() -> None:
    assert installed_executable() == str(Path(sys.executable).parent / "nodeagent")


def test_install_writes_the_units_and_says_what_next(tmp_path: Path) -> None:
    out = CliRunner().invoke(main, ["unit", "--install", "--dir", str(tmp_path), "--metrics"])
    assert out.exit_code == 0, out.output
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(FILES)
    for p in tmp_path.rglob("*"):
        if p.is_file():
            assert stat.S_IMODE(p.stat().st_mode) == 0o644
    assert "systemctl daemon-reload && systemctl enable --now nodeagent" in out.output
    assert installed_executable() in (tmp_path / "nodeagent.service").read_text()
    plain = CliRunner().invoke(main, ["unit", "--install", "--dir", str(tmp_path / "b")])
    assert not (tmp_path / "b" / "nodeagent.service.d").exists(), plain.output


def test_the_unit_keeps_workloads_out_of_the_agents_cgroup_and_protects_the_agent() -> None:
    """13.1: the workloads live in nodeagent-workloads.service; 13.25: OOMScoreAdjust= and
    MemoryMin= (which system.slice must hand down); a reload asks the agent (issue 36)."""
    unit = (SYSTEMD / "nodeagent.service").read_text()
    holder = (SYSTEMD / "nodeagent-workloads.service").read_text()
    assert directives(unit, "Requires") == ["nodeagent-workloads.service"]
    assert "nodeagent-workloads.service" in directives(unit, "After")
    assert directives(unit, "Delegate") == [] and directives(holder, "Delegate") == ["yes"]
    assert directives(unit, "KillMode") == []  # control-group: the agent's cgroup holds only it
    assert directives(unit, "OOMScoreAdjust") == ["-900"]
    assert directives(unit, "MemoryMin") == ["64M"]
    slice_ = (SYSTEMD / "system.slice.d" / "10-nodeagent.conf").read_text()
    assert directives(slice_, "MemoryMin") == ["64M"]
    # issue 36: the agent reads the file itself, so a refused one shows in its metric
    [reload] = directives(unit, "ExecReload")
    assert reload.split()[1:] == ["reload", "--config", "/etc/nodeagent/policy.yaml"]
    stop_post = directives(unit, "ExecStopPost")[0].split()[1:]
    assert stop_post == [
        "release",
        "--all",
        "--config",
        "/etc/nodeagent/policy.yaml",
        "--on-stop",
        "%n",
    ]
    assert directives(holder, "TasksMax") == ["infinity"]


POLICY = "version: 1\nagent:\n  metrics:\n    listen: {listen}\ntenants:\n  t: {{shares: 1}}\n"


def test_validate_says_when_this_sandbox_refuses_the_metrics_address_family(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the shipped unit (RestrictAddressFamilies=AF_UNIX) socket(AF_INET) fails with
    EAFNOSUPPORT; validate, the unit's ExecStartPre=, must fail then, in one line, naming the
    drop-in, rather than let the agent exit at start into a Restart= loop (issue 13, item 3)."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(listen="127.0.0.1:9464"))
    real = socket.socket

    def restricted(family: int = socket.AF_INET, *a: object, **k: object) -> socket.socket:
        if family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
        return real(family, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "socket", restricted)
    monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef0123456789abcdef")  # as under systemd
    out = CliRunner().invoke(main, ["validate", str(policy)])
    assert out.exit_code == 1
    assert out.output.splitlines(keepends=True)[-1] == (
        f"{policy}: agent.metrics.listen 127.0.0.1:9464: this process may not open AF_INET"
        " sockets (Address family not supported by protocol; a systemd unit's"
        " RestrictAddressFamilies= does that): install systemd/nodeagent.service.d/metrics.conf"
        " (nodeagent unit --install --metrics), then restart nodeagent\n"
    )
    assert "AF_INET6" in (metrics_refused("[::1]:9464") or "")
    monkeypatch.setattr(socket, "socket", real)
    assert metrics_refused("127.0.0.1:9464") is None
    assert metrics_refused(None) is None
    assert metrics_refused("/run/nodeagent/metrics.sock") is None  # not ours to judge


def test_validate_files_its_problems_at_priority_err_when_stderr_is_the_journal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ExecStartPre=/ExecReload=, each FILE:LINE:COL line starts <3>, so that
    `journalctl -p err -u nodeagent` shows why a start or a reload failed (issue 13, item 5)."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\ntenants:\n  t: {shares: -1}\n  u: {shares: 0}\n")
    st = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    with pytest.raises(SystemExit) as exit_:
        main(["validate", str(policy)], standalone_mode=False)
    assert exit_.value.code == 1
    lines = capfd.readouterr().err.splitlines()
    errors = [line for line in lines if ": warning: " not in line]
    assert len(errors) == 2
    assert all(line.startswith(f"<3>{policy}:") for line in errors), lines
    # what is only a warning (no rules) is filed at priority warning
    assert all(line.startswith(f"<4>{policy}:") for line in lines if line not in errors), lines
