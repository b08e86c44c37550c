"""`nodeagent exec` on a real kernel: the command runs in its own cgroup, under its limits,
from its first instruction; exit codes and signals pass through; refused jobs never run;
the job's record and cgroup go away when the cgroup empties."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, read, rel, running, spec, wait_for

from nodeagent.api import client
from nodeagent.daemon import Agent


@pytest.fixture
def daemon(cgroup_sandbox: Path, tmp_path: Path) -> Iterator[tuple[Agent, str]]:
    managed = rel(cgroup_sandbox) + "/managed"
    sock = str(tmp_path / "api.sock")
    policy = spec(
        managed,
        tmp_path,
        agent={"socket": sock, "interval": 0.5},
        tenants={"research": {"shares": 2}, "prod": {"shares": 1}},
        jobs={"default_tenant": "research"},
    )
    with running(policy) as a:
        yield a, sock


def nodeagent_exec(sock: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["nodeagent", "exec", "--socket", sock, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(p: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def test_the_command_runs_in_its_cgroup_under_its_limits_from_the_start(
    daemon: tuple[Agent, str],
) -> None:
    a, sock = daemon
    probe = (
        'cg=$(sed -n "s/^0:://p" /proc/self/cgroup); echo "$cg";'
        ' cat "/sys/fs/cgroup$cg/cpu.max" "/sys/fs/cgroup$cg/memory.max"'
    )
    code, out, err = finish(
        nodeagent_exec(
            sock, "--name", "probe", "--cpus", "0.5", "--memory", "64Mi", "--", "sh", "-c", probe
        )
    )
    assert code == 0, err
    cgroup, cpu_max, memory_max = out.split("\n")[:3]
    assert cgroup == "/" + a.rec.spec.agent.managed_root + "/probe"
    assert cpu_max == "50000 100000"
    assert memory_max == str(64 << 20)
    assert wait_for(lambda: not Path(ROOT + cgroup).exists(), timeout=90), "cgroup left behind"
    assert client.get(sock, "/v1/jobs") == {"jobs": []}


def test_exit_status_and_signals_pass_through(daemon: tuple[Agent, str]) -> None:
    _, sock = daemon
    assert finish(nodeagent_exec(sock, "--", "sh", "-c", "exit 7"))[0] == 7
    assert finish(nodeagent_exec(sock, "--", "sh", "-c", "kill -9 $$"))[0] == 128 + 9
    p = nodeagent_exec(sock, "--name", "sleeper", "--", "sleep", "300")
    cgroup = Path(ROOT, daemon[0].rec.spec.agent.managed_root, "sleeper")
    assert wait_for(lambda: cgroup.exists() and read(cgroup, "cgroup.procs") != "", timeout=180)
    p.send_signal(signal.SIGTERM)  # to exec: it passes it on
    code, _, err = finish(p)
    assert code == 128 + signal.SIGTERM, err


def test_a_missing_command_is_127(daemon: tuple[Agent, str]) -> None:
    code, _, err = finish(nodeagent_exec(daemon[1], "--", "no-such-command-anywhere"))
    assert code == 127
    assert "no-such-command-anywhere" in err


# the daemon's refusals; the options the CLI refuses before it asks one (a deadline passed,
# no work, a deadline without work) are tests/unit/test_cli_exec.py's
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tenant", "nobody"], "unknown tenant 'nobody'"),
        (["--class", "urgent"], "unknown class 'urgent'"),
        (["--name", "../escape"], "not a safe cgroup name"),
        (["--name", "x.slice"], "not a safe cgroup name"),
        (["--name", "taken"], "is taken"),
    ],
)
def test_a_refused_job_never_runs(
    daemon: tuple[Agent, str], tmp_path: Path, args: list[str], message: str
) -> None:
    a, sock = daemon
    Path(ROOT, a.rec.spec.agent.managed_root, "taken").mkdir(exist_ok=True)
    marker = tmp_path / "ran"
    code, _, err = finish(nodeagent_exec(sock, *args, "--", "touch", str(marker)))
    assert code != 0
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not marker.exists(), "the command ran although the job was refused"


def test_no_daemon_is_one_line_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code, _, err = finish(nodeagent_exec(str(tmp_path / "none.sock"), "--", "touch", str(marker)))
    assert code == 1
    assert err.startswith("nodeagent: error: no nodeagent daemon is running")
    assert not marker.exists()


def test_a_deadline_job_is_planned_and_shown(daemon: tuple[Agent, str]) -> None:
    a, sock = daemon
    p = nodeagent_exec(
        sock, "--name", "due", "--class", "training", "--deadline", "+120s", "--work", "30",
        "--", "sh", "-c", "while :; do :; done",
    )  # fmt: skip
    try:
        path = a.rec.spec.agent.managed_root + "/due"

        def shown() -> bool:
            data = client.get(sock, "/v1/allocations")
            assert isinstance(data, dict)
            row = next((r for r in data["allocations"] if r["cgroup"] == path), None)
            return row is not None and (row.get("deadline") or {}).get("status") == "on-track"

        assert wait_for(shown, timeout=180)
        data = client.get(sock, "/v1/explain", {"cgroup": "due"})
        assert isinstance(data, dict)
        assert data["tenant"] == "research"  # the policy's default tenant
        assert data["class"] == "training"
        d = data["deadline"]
        assert 0 < d["required_rate"] < 0.3
        # The only deadline job ranks first and gets what it can use (one thread), not
        # just its required rate: EDF hands slack to the earliest deadline.
        assert d["rank"] == 1
        assert d["rate"] == pytest.approx(min(d["parallelism"], d["capacity"]), rel=0.05)
        assert d["rate"] > d["required_rate"] * 1.1
        assert any("admitted by EDF" in line for line in data["trace"])
        listed = client.get(sock, "/v1/jobs")
        assert isinstance(listed, dict)
        assert [j["name"] for j in listed["jobs"]] == ["due"]
    finally:
        p.send_signal(signal.SIGINT)
        finish(p)
    assert wait_for(lambda: not Path(ROOT, path).exists(), timeout=90)
    status = client.get(sock, "/v1/status")
    assert isinstance(status, dict) and status["deadline_misses"] == 0


def test_a_restarted_daemon_keeps_managing_a_running_job(
    cgroup_sandbox: Path, tmp_path: Path
) -> None:
    managed = rel(cgroup_sandbox) + "/managed"
    sock = str(tmp_path / "api.sock")
    policy = spec(
        managed,
        tmp_path,
        agent={"socket": sock, "interval": 0.5},
        tenants={"research": {"shares": 1}},
        jobs={"default_tenant": "research"},
    )
    with running(policy):
        p = nodeagent_exec(sock, "--name", "long", "--", "sleep", "300")
        assert wait_for(lambda: Path(ROOT, managed, "long", "cgroup.procs").exists(), timeout=180)
        time.sleep(1)
    saved = json.loads((tmp_path / "state.json").read_text())
    assert [j["name"] for j in saved["jobs"]] == ["long"]
    try:
        with running(policy) as again:

            def managed_as_the_job() -> bool:
                last = again.rec.last
                return last is not None and any(
                    cg.assignment is not None and cg.assignment.rule == "exec:long"
                    for cg in last.plan.cgroups
                )

            assert wait_for(managed_as_the_job, timeout=180)
            p.send_signal(signal.SIGTERM)
            finish(p)
            assert wait_for(lambda: not Path(ROOT, managed, "long").exists(), timeout=90)
    finally:
        if p.poll() is None:
            p.kill()


def test_the_command_gets_default_signal_dispositions(daemon: tuple[Agent, str]) -> None:
    """Python ignores SIGPIPE and SIGXFSZ; a command exec'd from it must not inherit that
    (exec keeps ignored signals: `producer | head` would never see its SIGPIPE)."""
    code, out, err = finish(nodeagent_exec(daemon[1], "--", "cat", "/proc/self/status"), 180)
    assert code == 0, err
    ignored = int(
        next(line for line in out.splitlines() if line.startswith("SigIgn:")).split()[1], 16
    )
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
        assert not ignored & (1 << (sig - 1)), f"{sig.name} is ignored in the command"
