"""The command line: help, validate, workloads on a fixture tree, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from nodeagent.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "policy.yaml"

CID = "4f1c2a9be7d3" + "0123456789abcdef" * 3 + "0123"
CID2 = "9a8b7c6d5e4f" + "fedcba9876543210" * 3 + "3210"
POD_UID = "3b1e5f2a-9c4d-4e7f-8a6b-0d2c1e9f7a35"

DOCKER = f"system.slice/docker-{CID}.scope"
POD = f"kubepods/burstable/pod{POD_UID}"
POD_CONTAINER = f"{POD}/{CID2}"
JOB = "nodeagent.slice/job-1"
RESEARCH_JOB = "nodeagent.slice/research-train"
CRON = "system.slice/cron.service"


def nodeagent(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script (nodeagent.cli:entrypoint), as an operator runs it."""
    script = Path(sys.executable).parent / "nodeagent"
    command = (
        [str(script)]
        if script.exists()
        else [sys.executable, "-c", "from nodeagent.cli import entrypoint; entrypoint()"]
    )
    env = {k: v for k, v in os.environ.items() if k != "NODEAGENT_SOCKET"}
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, cwd=REPO, env=env, check=False
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.endswith("\n")
    assert proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr.strip()


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


# --- help ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "mentions"),
    [
        ([], ["validate", "workloads", "run", "allocations", "explain"]),
        (["validate"], ["FILE", "FILE:LINE:COL"]),
        (["run"], ["--config", "--cgroup-root", "--proc-root", "--dry-run", "--once", "--socket"]),
        (["allocations"], ["--socket", "--json", "NODEAGENT_SOCKET"]),
        (["explain"], ["CGROUP", "--socket", "--json", "container-id prefix"]),
        (["workloads"], ["--cgroup-root", "--config", "--json"]),
    ],
)
def test_help(runner: CliRunner, command: list[str], mentions: list[str]) -> None:
    for flag in ("--help", "-h"):
        result = runner.invoke(main, [*command, flag])
        assert result.exit_code == 0, result.output
        for word in mentions:
            assert word in result.output


# --- validate -----------------------------------------------------------------------------


def test_validate_the_shipped_example(runner: CliRunner) -> None:
    result = runner.invoke(main, ["validate", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{EXAMPLE}: ok (2 tenants, 4 rules)\n"


BAD = "version: 1\ntenants:\n  research:\n    shares: -2\nrules: []\n"


def test_validate_a_bad_file(runner: CliRunner, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    result = runner.invoke(main, ["validate", str(bad)])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"{bad}:4:13: ")
    assert "shares" in result.stderr


def test_validate_a_missing_file(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(main, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"{tmp_path / 'nope.yaml'}:1:1: cannot read")


# --- workloads on a fixture tree ------------------------------------------------------------


@pytest.fixture
def cgroup_root(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    for path in [
        DOCKER,
        POD_CONTAINER,
        JOB,
        RESEARCH_JOB,
        CRON,
        "system.slice/docker-notahexid.scope",  # not a container
        "init.scope",
        "kubepods/besteffort",
    ]:
        (root / path).mkdir(parents=True)
    for d, _, _ in os.walk(root):
        (Path(d) / "cgroup.procs").write_text("")
    return root


POLICY = f"""\
version: 1
tenants:
  research: {{shares: 2}}
  prod: {{shares: 1}}
rules:
  - name: research-jobs
    match: {{path: nodeagent.slice/research-*}}
    tenant: research
    class: training
  - name: the-pod
    match: {{pod_uid: {POD_UID}}}
    tenant: prod
    class: inference
  - name: docker
    match: {{runtime: docker}}
    tenant: research
"""


def test_workloads_json(runner: CliRunner, cgroup_root: Path) -> None:
    result = runner.invoke(main, ["workloads", "--cgroup-root", str(cgroup_root), "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["cgroup"]: r for r in json.loads(result.stdout)}
    assert sorted(rows) == sorted([DOCKER, POD, POD_CONTAINER, JOB, RESEARCH_JOB, CRON])
    fields = ("kind", "runtime", "owner", "writable", "container_id", "pod_uid", "qos")
    expected = {
        DOCKER: ("container", "docker", "systemd", False, CID, None, None),
        POD: ("pod", "kubelet", "cgroupfs", True, None, POD_UID, "burstable"),
        POD_CONTAINER: ("container", "containerd", "cgroupfs", True, CID2, POD_UID, "burstable"),
        JOB: ("job", "nodeagent", "nodeagent", True, None, None, None),
        CRON: ("service", "systemd", "systemd", False, None, None, None),
    }
    for path, want in expected.items():
        assert tuple(rows[path][f] for f in fields) == want, path
    assert all(r["tenant"] is None and r["rule"] is None for r in rows.values())


def test_workloads_json_with_a_config_shows_tenants(
    runner: CliRunner, cgroup_root: Path, tmp_path: Path
) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(POLICY)
    result = runner.invoke(
        main, ["workloads", "--cgroup-root", str(cgroup_root), "--config", str(config), "--json"]
    )
    assert result.exit_code == 0, result.output
    rows = {r["cgroup"]: r for r in json.loads(result.stdout)}
    assigned = {path: (r["rule"], r["tenant"], r["class"]) for path, r in rows.items()}
    assert assigned == {
        DOCKER: ("docker", "research", "batch"),
        POD: ("the-pod", "prod", "inference"),
        POD_CONTAINER: ("the-pod", "prod", "inference"),
        RESEARCH_JOB: ("research-jobs", "research", "training"),
        JOB: (None, None, None),
        CRON: (None, None, None),
    }


def test_workloads_with_the_shipped_example(runner: CliRunner, cgroup_root: Path) -> None:
    result = runner.invoke(
        main,
        ["workloads", "--cgroup-root", str(cgroup_root), "--config", str(EXAMPLE), "--json"],
    )
    assert result.exit_code == 0, result.output
    tenants = {r["cgroup"]: r["tenant"] for r in json.loads(result.stdout)}
    assert tenants[DOCKER] == "research"
    assert tenants[RESEARCH_JOB] == "research"
    assert tenants[JOB] is None


def test_workloads_table(runner: CliRunner, cgroup_root: Path, tmp_path: Path) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(POLICY)
    result = runner.invoke(
        main, ["workloads", "--cgroup-root", str(cgroup_root), "--config", str(config)]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "CGROUP", "KIND", "RUNTIME", "OWNER", "ID", "POD", "QOS", "TENANT", "CLASS", "STATUS",
    ]  # fmt: skip
    docker_line = next(line for line in lines if line.startswith(DOCKER))
    assert "systemd (read-only)" in docker_line
    assert docker_line.split()[5] == CID[:12]  # the short id in the ID column
    assert docker_line.split()[-1] == "ok"
    assert len(lines) == 7


def test_workloads_shows_a_claimed_cgroup_the_sensor_would_skip(
    runner: CliRunner, cgroup_root: Path, tmp_path: Path
) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(POLICY)
    (cgroup_root / RESEARCH_JOB / "cpu.weight").write_text("many\n")
    result = runner.invoke(
        main, ["workloads", "--cgroup-root", str(cgroup_root), "--config", str(config), "--json"]
    )
    assert result.exit_code == 0, result.output
    rows = {r["cgroup"]: r for r in json.loads(result.stdout)}
    assert rows[RESEARCH_JOB]["status"] == "unreadable"
    assert "ValueError" in rows[RESEARCH_JOB]["problem"]
    assert rows[DOCKER]["status"] == "ok"


def test_workloads_reads_without_writing(runner: CliRunner, cgroup_root: Path) -> None:
    before = sorted(os.walk(cgroup_root))
    runner.invoke(main, ["workloads", "--cgroup-root", str(cgroup_root)])
    assert sorted(os.walk(cgroup_root)) == before


def test_workloads_on_a_missing_root_is_a_one_line_error(tmp_path: Path) -> None:
    message = assert_one_line_error(nodeagent("workloads", "--cgroup-root", str(tmp_path / "x")))
    assert message == f"nodeagent: error: cgroup root {tmp_path / 'x'} is not a directory"


# --- commands that need the daemon ----------------------------------------------------------


@pytest.mark.parametrize("command", [["allocations"], ["allocations", "--json"], ["explain", "x"]])
def test_no_daemon_is_a_one_line_error(tmp_path: Path, command: list[str]) -> None:
    sock = tmp_path / "nodeagent.sock"
    proc = nodeagent(*command, "--socket", str(sock))
    message = assert_one_line_error(proc)
    assert message.startswith("nodeagent: error: no nodeagent daemon is running")
    assert str(sock) in message
    assert proc.stdout == ""


# --- run ------------------------------------------------------------------------------------


def test_run_with_a_bad_policy(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    proc = nodeagent("run", "--config", str(bad), "--cgroup-root", str(tmp_path))
    message = assert_one_line_error(proc)
    assert f"{bad}:4:13: " in message


def test_run_refuses_a_root_that_is_not_cgroup2_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "not-cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")  # looks the part, is not a mount
    base = os.path.realpath(tmp_path)
    proc_root = tmp_path / "proc"
    (proc_root / "self").mkdir(parents=True)
    (proc_root / "self" / "mountinfo").write_text(
        "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        f"41 22 0:38 / {base}/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    before = sorted(os.walk(root))
    state_file = tmp_path / "state" / "state.json"
    socket = tmp_path / "api.sock"

    proc = nodeagent(
        "run",
        "--config", str(EXAMPLE),
        "--cgroup-root", str(root),
        "--proc-root", str(proc_root),
        "--state-file", str(state_file),
        "--socket", str(socket),
    )  # fmt: skip

    message = assert_one_line_error(proc)
    assert message.startswith("nodeagent: error: ")
    assert f"{os.path.realpath(root)} is not a cgroup v2 mount (ext4)" in message
    assert sorted(os.walk(root)) == before
    assert not state_file.parent.exists()
    assert not socket.exists()
