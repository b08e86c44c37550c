"""The command line: help, validate, workloads on a fixture tree, and one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from nodeagent.api.server import ApiServer, Request, Routes
from nodeagent.cli import main
from nodeagent.errors import NotFound
from nodeagent.tables import printable, table

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


def nodeagent(*args: str | bytes, **env: str) -> subprocess.CompletedProcess[str]:
    """The installed console script (nodeagent.cli:entrypoint), as an operator runs it."""
    script = Path(sys.executable).parent / "nodeagent"
    command = (
        [str(script)]
        if script.exists()
        else [sys.executable, "-c", "from nodeagent.cli import entrypoint; entrypoint()"]
    )
    environ = {
        k: v for k, v in os.environ.items() if k not in ("NODEAGENT_SOCKET", "COLUMNS")
    } | env
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, cwd=REPO, env=environ, check=False
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.endswith("\n")
    assert proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr.strip()


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("COLUMNS", raising=False)  # tables are cut to it
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


def test_bare_nodeagent_prints_the_help_and_succeeds() -> None:
    """Issue 13, item 14: it was rc 2 with the whole help crushed into one error line."""
    proc = nodeagent()
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.startswith("Usage: nodeagent [OPTIONS]")
    assert proc.stdout.count("\n") > 20
    assert "\nCommands:\n" in proc.stdout
    assert "  validate " in proc.stdout


@pytest.mark.parametrize(
    ("args", "where"),
    [
        (["capacity", "--arrival-rate"], "nodeagent capacity"),
        (["gpus", "place", "--count"], "nodeagent gpus place"),
    ],
)
def test_an_option_missing_its_value_names_the_command(args: list[str], where: str) -> None:
    """Issue 13, item 14: the hint said `nodeagent --help`, losing the command path."""
    proc = nodeagent(*args)
    assert proc.returncode == 2
    flag = args[-1]
    assert proc.stderr == (
        f"{where}: error: Option '{flag}' requires an argument. (see '{where} --help')\n"
    )


# --- validate -----------------------------------------------------------------------------


def test_validate_the_shipped_example(runner: CliRunner) -> None:
    result = runner.invoke(main, ["validate", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{EXAMPLE}: ok (2 tenants, 9 rules)\n"


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


ONE_TENANT = "version: 1\ntenants:\n  research: {shares: 2}\n"


def test_validate_counts_in_words_and_warns_on_a_policy_without_rules(
    runner: CliRunner, tmp_path: Path
) -> None:
    """Issue 13, item 18: `ok (1 tenants, 0 rules)`, and no word about the missing rules."""
    path = tmp_path / "p.yaml"
    path.write_text(ONE_TENANT)
    result = runner.invoke(main, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{path}: ok (1 tenant, 0 rules; 1 warning)\n"
    assert result.stderr.startswith(f"{path}:1:1: warning: the policy has no rules")
    path.write_text(ONE_TENANT + "rules: [{name: a, match: {kind: job}, tenant: research}]\n")
    result = runner.invoke(main, ["validate", str(path)])
    assert (result.exit_code, result.stdout, result.stderr) == (
        0,
        f"{path}: ok (1 tenant, 1 rule)\n",
        "",
    )


def test_validate_strict_fails_on_warnings(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        ONE_TENANT + "rules:\n  - {name: all, match: {}, tenant: research}\n"
        "  - {name: jobs, match: {kind: job}, tenant: research}\n"
    )
    result = runner.invoke(main, ["validate", "--strict", str(path)])
    assert result.exit_code == 1
    assert result.stdout == ""
    nests, shadows = result.stderr.splitlines()
    assert nests.startswith(f"{path}:5:24: warning: rules[0].match: can claim a pod")
    assert shadows == (
        f"{path}:6:25: warning: rules[1]: rule 'jobs' never applies: rule 'all' (line 5)"
        " comes first and matches every cgroup (the first match wins)"
    )
    assert runner.invoke(main, ["validate", str(path)]).exit_code == 0


def test_validate_reports_every_problem_in_one_round(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "version: 1\ntenants:\n  research: {shares: many}\nrules:\n"
        "  - {name: a, match: {kind: jobb}, tenant: reserch, limits: {cpu_max: 0.001}}\n"
        "  - {name: a, match: {}, tenant: research}\n"
        "  - {name: b, match: {kind: job}, tenant: research}\n"
    )
    result = runner.invoke(main, ["validate", str(path)])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert [line.split(": ", 2)[1] for line in lines] == [
        "tenants.research.shares",
        "rules[0].match.kind",
        "rules[0].tenant",
        "rules[0].limits.cpu_max",
        "rules[1].name",
        "warning",
    ]
    assert "unknown tenant 'reserch'; did you mean 'research'?" in lines[2]


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
    rows = {r["cgroup"]: r for r in json.loads(result.stdout)["items"]}
    assert sorted(rows) == sorted([DOCKER, POD, POD_CONTAINER, JOB, RESEARCH_JOB, CRON])
    fields = ("kind", "runtime", "owner", "write", "container_id", "pod_uid", "qos")
    expected = {
        # systemd-owned container scopes are written through systemd, services are not
        DOCKER: ("container", "docker", "systemd", "systemd", CID, None, None),
        POD: ("pod", "kubelet", "cgroupfs", "direct", None, POD_UID, "burstable"),
        POD_CONTAINER: (
            "container",
            "containerd",
            "cgroupfs",
            "direct",
            CID2,
            POD_UID,
            "burstable",
        ),
        JOB: ("job", "nodeagent", "nodeagent", "direct", None, None, None),
        CRON: ("service", "systemd", "systemd", "read-only", None, None, None),
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
    rows = {r["cgroup"]: r for r in json.loads(result.stdout)["items"]}
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
    # its managed root is the packaged units': jobs there, in nodeagent-workloads.service
    packaged = "system.slice/nodeagent-workloads.service/workloads"
    for job in (f"{packaged}/research-train", f"{packaged}/job-1"):
        (cgroup_root / job).mkdir(parents=True)
        (cgroup_root / job / "cgroup.procs").write_text("")
    result = runner.invoke(
        main,
        ["workloads", "--cgroup-root", str(cgroup_root), "--config", str(EXAMPLE), "--json"],
    )
    assert result.exit_code == 0, result.output
    tenants = {r["cgroup"]: r["tenant"] for r in json.loads(result.stdout)["items"]}
    assert tenants[DOCKER] == "research"
    assert tenants[f"{packaged}/research-train"] == "research"
    assert tenants[f"{packaged}/job-1"] is None


def test_workloads_table(runner: CliRunner, cgroup_root: Path, tmp_path: Path) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(POLICY)
    result = runner.invoke(
        main, ["workloads", "--cgroup-root", str(cgroup_root), "--config", str(config)]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["CGROUP", "KIND", "RUNTIME", "OWNER", "TENANT", "CLASS", "STATUS"]
    docker_line = next(line for line in lines if line.startswith(SHORT_DOCKER + " "))
    assert "systemd (via systemd)" in docker_line
    assert docker_line.split()[-3:] == ["research", "batch", "ok"]
    assert len(lines) == 7


SHORT_DOCKER = f"system.slice/docker-{CID[:12]}.scope"
SHORT_POD_CONTAINER = f"kubepods/burstable/pod{POD_UID[:8]}/{CID2[:12]}"


def test_workloads_fits_the_terminal_with_short_ids(cgroup_root: Path, tmp_path: Path) -> None:
    """Issue 13, item 24: the table was about 230 columns whatever COLUMNS said."""
    config = tmp_path / "policy.yaml"
    config.write_text(POLICY)
    args = ("workloads", "--cgroup-root", str(cgroup_root), "--config", str(config))
    proc = nodeagent(*args, COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(map(len, lines)) <= 80, proc.stdout
    assert CID[12:] not in proc.stdout and POD_UID[8:] not in proc.stdout
    cell = next(line for line in lines if line.split()[2] == "docker").split()[0]
    assert cell.startswith("\u2026") and SHORT_DOCKER.endswith(cell[1:])  # its tail kept
    # without COLUMNS on a pipe: whole cells, ids still short, as docker ps
    proc = nodeagent(*args)
    lines = proc.stdout.splitlines()
    assert {line.split()[0] for line in lines} >= {SHORT_DOCKER, SHORT_POD_CONTAINER}


@pytest.mark.parametrize("flag", ["--wide", "--no-trunc"])
def test_workloads_wide_shows_every_column_in_full(
    runner: CliRunner, cgroup_root: Path, flag: str
) -> None:
    result = runner.invoke(
        main, ["workloads", "--cgroup-root", str(cgroup_root), flag], env={"COLUMNS": "80"}
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "CGROUP", "KIND", "RUNTIME", "OWNER", "ID", "POD", "QOS", "TENANT", "CLASS", "STATUS",
    ]  # fmt: skip
    row = next(line for line in lines if line.startswith(POD_CONTAINER + " ")).split()
    assert row[4:7] == [CID2, POD_UID, "burstable"]


def test_shell_completion_is_there_as_documented() -> None:
    """docs/commands.md's `eval "$(_NODEAGENT_COMPLETE=bash_source nodeagent)"`."""
    proc = nodeagent(_NODEAGENT_COMPLETE="bash_source")
    assert proc.returncode == 0, proc.stderr
    assert "_nodeagent_completion()" in proc.stdout
    proc = nodeagent(
        _NODEAGENT_COMPLETE="bash_complete", COMP_WORDS="nodeagent workloads --wi", COMP_CWORD="2"
    )
    assert proc.stdout.split() == ["plain,--wide"]


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
    rows = {r["cgroup"]: r for r in json.loads(result.stdout)["items"]}
    assert rows[RESEARCH_JOB]["status"] == "unreadable"
    assert "ValueError" in rows[RESEARCH_JOB]["problem"]
    assert rows[DOCKER]["status"] == "ok"


def tree_contents(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every directory and file below `root`: each file's bytes, and when it was modified
    (a write of the value already there moves it)."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def test_workloads_reads_without_writing(
    runner: CliRunner, cgroup_root: Path, tmp_path: Path
) -> None:
    """It lists every workload, reads the claimed ones as the sensor would, and leaves every
    file as it was: no file or directory made, none written (an unchanged value included)."""
    config = tmp_path / "policy.yaml"
    config.write_text(POLICY)
    for path in (DOCKER, POD_CONTAINER, RESEARCH_JOB):
        for name, text in (("cpu.weight", "100\n"), ("cpu.max", "max 100000\n"),
                           ("memory.max", "max\n"), ("cpu.stat", "usage_usec 5\n")):  # fmt: skip
            (cgroup_root / path / name).write_text(text)
    for f in cgroup_root.rglob("*"):
        os.utime(f, ns=(10**9, 10**9))  # long ago: any write moves it
    before = tree_contents(cgroup_root)
    result = runner.invoke(
        main, ["workloads", "--cgroup-root", str(cgroup_root), "--config", str(config), "--json"]
    )
    assert result.exit_code == 0, result.output
    rows = {r["cgroup"]: r for r in json.loads(result.stdout)["items"]}
    assert sorted(rows) == sorted([DOCKER, POD, POD_CONTAINER, JOB, RESEARCH_JOB, CRON])
    assert {rows[p]["status"] for p in (DOCKER, POD_CONTAINER, RESEARCH_JOB)} == {"ok"}
    assert tree_contents(cgroup_root) == before


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


def fake_proc(tmp_path: Path, *mounts: str) -> Path:
    """A proc root whose self/mountinfo lists / (ext4) and `mounts`."""
    proc_root = tmp_path / "proc"
    (proc_root / "self").mkdir(parents=True)
    (proc_root / "self" / "mountinfo").write_text(
        "".join(
            f"{m}\n" for m in ("22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw", *mounts)
        )
    )
    return proc_root


def test_run_refuses_a_root_that_is_not_cgroup2_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "not-cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")  # looks the part, is not a mount
    base = os.path.realpath(tmp_path)
    proc_root = fake_proc(tmp_path, f"41 22 0:38 / {base}/unified rw,relatime - cgroup2 cgroup2 rw")
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


# --- names a terminal must not get raw (non-UTF-8 bytes, control characters) -------------------

ODD = [b"job-\xff", b"job-\nfake  row", b"job-\x1b[31mred", "job-\u202eevil".encode()]
"""Cgroup names anyone allowed to mkdir under the cgroup root can make."""
SHOWN_AS = ["job-\\xff", "job-\\nfake  row", "job-\\x1b[31mred", "job-\\u202eevil"]
STRICT = {"PYTHONIOENCODING": "utf-8:strict"}


def odd(name: bytes) -> str:
    """The cgroup path of `name` as discovery (os.scandir) reports it."""
    return "nodeagent.slice/" + os.fsdecode(name)


def assert_terminal_safe(stdout: str) -> None:
    assert all(c == "\n" or c.isprintable() for c in stdout), repr(stdout)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain/path-1", "plain/path-1"),
        ("tab\there", "tab\\there"),
        ("cr\rlf\n", "cr\\rlf\\n"),
        ("\x00\x7f\x9b", "\\x00\\x7f\\x9b"),
        (os.fsdecode(b"\xff\xfe"), "\\xff\\xfe"),
        ("\u202e\u200b\u2028\xa0", "\\u202e\\u200b\\u2028\\xa0"),
        ("caf\xe9 \u5b57 \U0001f600", "caf\xe9 \u5b57 \U0001f600"),  # printable: as is
        ("system-systemd\\x2dfsck.slice", "system-systemd\\x2dfsck.slice"),
    ],
)
def test_printable(text: str, shown: str) -> None:
    assert printable(text) == shown


def test_table_escapes_cells_and_keeps_alignment() -> None:
    lines = table(("CGROUP", "N"), [("a\nb", 1), ("long-name", 2)]).splitlines()
    assert lines == ["CGROUP     N", "a\\nb       1", "long-name  2"]


@pytest.fixture
def odd_root(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    (root / "nodeagent.slice").mkdir(parents=True)
    for name in ODD:
        os.mkdir(os.path.join(os.fsencode(root / "nodeagent.slice"), name))
    for d, _, _ in os.walk(os.fsencode(root)):
        Path(os.fsdecode(d), "cgroup.procs").write_text("")
    return root


def test_workloads_shows_odd_names_escaped_on_a_strict_utf8_stdout(
    odd_root: Path, tmp_path: Path
) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(
        "version: 1\ntenants: {t: {shares: 1}}\n"
        "rules: [{name: jobs, match: {path: 'nodeagent.slice/job-*'}, tenant: t}]\n"
    )
    proc = nodeagent("workloads", "--cgroup-root", str(odd_root), "--config", str(config), **STRICT)
    assert proc.returncode == 0, proc.stderr
    assert_terminal_safe(proc.stdout)
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 + len(ODD)  # no name broke a row in two
    for shown in SHOWN_AS:
        row = next(line for line in lines if line.startswith(f"nodeagent.slice/{shown} "))
        assert row.split()[-3:] == ["t", "batch", "ok"]


def test_workloads_json_keeps_odd_names_exact(odd_root: Path) -> None:
    proc = nodeagent("workloads", "--cgroup-root", str(odd_root), "--json", **STRICT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.isascii()
    assert sorted(r["cgroup"] for r in json.loads(proc.stdout)["items"]) == sorted(
        odd(n) for n in ODD
    )


def allocation(cgroup: str) -> dict[str, Any]:
    """One row of /v1/allocations, as report.allocations makes it."""
    value = {"current": "100", "target": "200", "policy": "fair_share", "reason": "2 shares"}
    return {
        "cgroup": cgroup,
        "name": cgroup.rsplit("/", 1)[-1],
        "kind": "job",
        "runtime": "nodeagent",
        "owner": "nodeagent",
        "writable": True,
        "container_id": None,
        "pod_uid": None,
        "qos": None,
        "write": "direct",
        "job_id": None,
        "account": None,
        "rule": "jobs",
        "tenant": "t",
        "class": "batch",
        "container_name": None,
        "image": None,
        "namespace": None,
        "pod": None,
        "metadata": None,
        "metadata_problem": None,
        "matched": [],
        "refused": [],
        "level": False,
        "status": "ok",
        "problem": None,
        "values": {
            a: value for a in ("cpu.weight", "cpu.max", "memory.max", "memory.high", "pids.max")
        },
        "cpu_rate": 0.5,
        "memory_current": 4096,
        "reason": "fair share",
        "writes": [],
        "deadline": None,
        "notes": [],
        "gpus": [],
    }


def allocations_answer(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """/v1/allocations with these rows, as the route serves it."""
    return {
        "tick": 7,
        "time": 1_700_000_000.0,
        "dry_run": False,
        "tick_seconds": 0.01,
        "tenant_usage": {},
        "problems": [],
        "node_notes": [],
        "allocations": rows,
        "deadline_misses": 0,
    }


def explanation(cgroup: str) -> dict[str, Any]:
    """/v1/explain for one cgroup, as report.explain makes it."""
    row = allocation(cgroup)
    del row["memory_current"], row["gpus"]
    return {
        **row,
        "below": None,
        "tick": 7,
        "dry_run": False,
        "sensed": {"cpu_rate": 0.5},
        "trace": [f"{cgroup}: rule jobs"],
        "writes": [
            {"attribute": "cpu.weight", "old": "100", "new": "200", "outcome": "ok", "detail": ""}
        ],
    }


@pytest.fixture
def fake_daemon() -> Iterator[Any]:
    """Start an API server with the given routes; yields a function that returns its socket."""
    sockdir = Path(tempfile.mkdtemp(prefix="nodeagent-cli-"))
    servers: list[ApiServer] = []

    def start(routes: Routes) -> str:
        server = ApiServer(str(sockdir / "api.sock"), routes)
        server.start()
        servers.append(server)
        return server.socket_path

    yield start
    for server in servers:
        server.close()
    shutil.rmtree(sockdir, ignore_errors=True)


def odd_daemon(fake_daemon: Any) -> str:
    paths = [odd(n) for n in ODD]

    def explain(request: Request) -> object:
        if request.query.get("cgroup") not in paths:
            raise NotFound(f"no workload match {request.query.get('cgroup')!r}")
        return explanation(request.query["cgroup"])

    answer = allocations_answer([allocation(p) for p in paths])
    return str(
        fake_daemon({"/v1/allocations": {"GET": lambda _: answer}, "/v1/explain": {"GET": explain}})
    )


def test_allocations_shows_odd_names_escaped_on_a_strict_utf8_stdout(fake_daemon: Any) -> None:
    sock = odd_daemon(fake_daemon)
    proc = nodeagent("allocations", "--socket", sock, **STRICT)
    assert proc.returncode == 0, proc.stderr
    assert_terminal_safe(proc.stdout)
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 + len(ODD)
    for shown in SHOWN_AS:
        assert any(line.startswith(f"nodeagent.slice/{shown} ") for line in lines)
    proc = nodeagent("allocations", "--socket", sock, "--json", **STRICT)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["allocations"]
    assert [r["cgroup"] for r in rows] == [odd(n) for n in ODD]


@pytest.mark.parametrize(("name", "shown"), list(zip(ODD, SHOWN_AS, strict=True)))
def test_explain_finds_and_shows_an_odd_name(fake_daemon: Any, name: bytes, shown: str) -> None:
    sock = odd_daemon(fake_daemon)
    # The name as an operator passes it: the raw bytes, as the shell gives them.
    proc = nodeagent("explain", b"nodeagent.slice/" + name, "--socket", sock, **STRICT)
    assert proc.returncode == 0, proc.stderr
    assert_terminal_safe(proc.stdout)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"nodeagent.slice/{shown}  (job, ")
    assert f"  nodeagent.slice/{shown}: rule jobs" in lines
    proc = nodeagent("explain", b"nodeagent.slice/" + name, "--socket", sock, "--json", **STRICT)
    assert json.loads(proc.stdout)["explanation"]["cgroup"] == odd(name)


WRONG_SHAPES: list[object] = [
    {"unexpected": 1},
    [1, 2],
    "text",
    None,
    {"tick": 1, "dry_run": False, "allocations": [{"cgroup": 5}]},
    allocations_answer([{**allocation("a"), "cpu_rate": "fast"}]),
    allocations_answer([{**allocation("a"), "values": []}]),
    {**allocations_answer([allocation("a")]), "tick": None},
    {k: v for k, v in allocations_answer([allocation("a")]).items() if k != "time"},
]
"""Answers this CLI cannot read: another daemon's, or a version's with a key renamed."""


@pytest.mark.parametrize("answer", WRONG_SHAPES)
@pytest.mark.parametrize(
    ("command", "endpoint"), [("allocations", "allocations"), ("explain", "explain")]
)
def test_an_answer_of_the_wrong_shape_is_a_one_line_error(
    fake_daemon: Any, answer: object, command: str, endpoint: str
) -> None:
    sock = fake_daemon({f"/v1/{endpoint}": {"GET": lambda _: answer}})
    args = [command, "x"] if command == "explain" else [command]
    message = assert_one_line_error(nodeagent(*args, "--socket", sock))
    assert message.startswith(
        f"nodeagent: error: the nodeagent daemon on {sock} answered /v1/{endpoint} with what"
        " this nodeagent does not expect ("
    )
    assert message.endswith("); is the daemon the same version as this CLI?")


# --- workloads on a host without a usable cgroup v2 hierarchy (issue 13, item 13) -----------


def hybrid_host(tmp_path: Path, v2_controllers: str = "") -> tuple[Path, Path]:
    """A cgroup root laid out as a hybrid host mounts it, and a proc root whose mountinfo says
    so: tmpfs at the root, cpu and memory bound to v1 below it, an empty v2 at unified."""
    root = tmp_path / "sys-fs-cgroup"
    for sub in ("cpu", "memory", "unified", "systemd/system.slice/cron.service"):
        (root / sub).mkdir(parents=True)
    (root / "unified" / "cgroup.controllers").write_text(v2_controllers + "\n")
    (root / "systemd" / "system.slice" / "cron.service" / "cgroup.procs").write_text("1\n")
    base = os.path.realpath(root)
    proc_root = fake_proc(
        tmp_path,
        f"31 22 0:28 / {base} rw,relatime - tmpfs tmpfs rw,mode=755",
        f"32 31 0:29 / {base}/cpu rw,relatime - cgroup cgroup rw,cpu",
        f"35 31 0:32 / {base}/memory rw,relatime - cgroup cgroup rw,memory",
        f"40 31 0:37 / {base}/systemd rw,relatime - cgroup cgroup rw,name=systemd",
        f"41 31 0:38 / {base}/unified rw,relatime - cgroup2 cgroup2 rw",
    )
    return root, proc_root


@pytest.mark.parametrize("where", ["", "systemd", "unified"])
def test_workloads_on_a_hybrid_host_says_what_run_says(tmp_path: Path, where: str) -> None:
    """It printed an empty table and exited 0; `run` names what is missing: now both do."""
    root, proc_root = hybrid_host(tmp_path)
    at = ("--cgroup-root", str(root / where), "--proc-root", str(proc_root))
    run = assert_one_line_error(nodeagent("run", "--config", str(EXAMPLE), "--dry-run", *at))
    assert "cgroup v2" in run
    proc = nodeagent("workloads", *at)
    assert assert_one_line_error(proc) == run
    assert proc.stdout == ""


def test_workloads_on_a_v2_mount_without_the_memory_controller(tmp_path: Path) -> None:
    root, proc_root = hybrid_host(tmp_path, v2_controllers="cpu io")
    unified = os.path.realpath(root / "unified")
    proc = nodeagent("workloads", "--cgroup-root", unified, "--proc-root", str(proc_root))
    assert assert_one_line_error(proc) == (
        f"nodeagent: error: cgroup v2 at {unified} lacks the controllers nodeagent needs:"
        f" memory (bound to cgroup v1 at {os.path.realpath(root)}/memory)"
    )


def test_workloads_reads_a_plain_directory_as_it_is(cgroup_root: Path, tmp_path: Path) -> None:
    """A copy or fixture of a tree (no mount, in no cgroup mount) is listed, not refused."""
    _, proc_root = hybrid_host(tmp_path)
    proc = nodeagent("workloads", "--cgroup-root", str(cgroup_root), "--proc-root", str(proc_root))
    assert proc.returncode == 0, proc.stderr
    assert DOCKER[:30] in proc.stdout


def test_allocations_from_a_daemon_from_before_pids_max_was_shown(fake_daemon: Any) -> None:
    """A CLI upgraded before its daemon restarts: an answer without pids.max is shown, the
    cell empty, not a KeyError's traceback."""
    row = allocation(JOB)
    row["values"] = {a: v for a, v in row["values"].items() if a != "pids.max"}
    sock = fake_daemon({"/v1/allocations": {"GET": lambda _: allocations_answer([row])}})
    proc = nodeagent("allocations", "--socket", sock, COLUMNS="200")
    assert proc.returncode == 0, proc.stderr
    header, job = proc.stdout.splitlines()[1:3]
    assert header.split()[7] == "PIDS.MAX" and job.split()[7] == "-", proc.stdout


def test_allocations_fits_the_terminal(fake_daemon: Any) -> None:
    """Issue 13, item 24, for allocations: full ids, and reasons of a hundred characters, at
    110 columns: the reasons are cut, then the PIDS.MAX column goes (said in a last line),
    not the paths' leaves (issue 36, item 7: names cut to 12 characters lost what told
    rows apart)."""
    rows = [
        {**allocation(p), "reason": "cpu weight for a target of 1.33 cores; " * 3}
        for p in (DOCKER, POD_CONTAINER, JOB)
    ]
    answer = allocations_answer(rows)
    sock = fake_daemon({"/v1/allocations": {"GET": lambda _: answer}})
    proc = nodeagent("allocations", "--socket", sock, COLUMNS="110")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(map(len, lines)) <= 110, proc.stdout
    assert lines[1].split() == [
        "CGROUP",
        "TENANT",
        "CLASS",
        "CPU.WEIGHT",
        "CPU.MAX",
        "MEM.MAX",
        "MEM.HIGH",
        "CPU",
        "REASON",
    ]  # fmt: skip  (no GPUS column: no workload holds one)
    assert CID[12:] not in proc.stdout
    assert lines[2].startswith(f"\u2026/docker-{CID[:12]}.scope ")
    assert lines[-2].startswith(JOB + " ")
    assert lines[-2].endswith("\u2026")  # the reason, cut
    assert lines[-1] == "(no room in 110 columns for PIDS.MAX: see --wide)"
    proc = nodeagent("allocations", "--socket", sock, "--wide", COLUMNS="110")
    assert "GPUS" in proc.stdout.splitlines()[1].split()
    assert any(line.startswith(DOCKER + " ") for line in proc.stdout.splitlines())
    assert proc.stdout.count("cpu weight for a target of 1.33 cores;") == 9


# --- one versioned --json shape, units in key names (issue 13, item 23) ----------------------

UNITS = ("_bytes", "_cores", "_seconds", "_fraction", "_percent", "_watts", "_erlangs",
         "_per_second", "_requests")  # fmt: skip
COUNTS = {"tick", "servers", "pid", "threads", "workloads", "line", "column", "tenants",
          "rules", "parallelism", "omitted_problems", "rank"}  # fmt: skip
"""Numbers without a unit: counts and ids."""
BY_NAME = {"memory_events", "values"}
"""Mappings keyed by names (event names, cgroup files), not by figures."""


def figures_without_units(doc: object, key: str = "") -> list[str]:
    """Every number in `doc` whose key does not say its unit (and is no count)."""
    if isinstance(doc, dict):
        if key in BY_NAME:
            return []
        if key.endswith(UNITS):  # a mapping by tenant or cgroup of figures in that unit
            return []
        return [k for item, v in doc.items() for k in figures_without_units(v, item)]
    if isinstance(doc, list):
        return [k for v in doc for k in figures_without_units(v, key)]
    if isinstance(doc, int | float) and not isinstance(doc, bool):
        return [] if key in COUNTS or key.endswith(UNITS) else [key]
    return []


@pytest.fixture
def planned_daemon(fake_daemon: Any) -> str:
    """A daemon stand-in that serves what report.py makes of a real plan (test_report)."""
    from test_report import ticked

    from nodeagent import report

    record = ticked(deadline=True)
    job_b = next(i for i in report.identities(record) if i.path == "nodeagent.slice/job-b")
    allocations = report.allocations(record)
    explained = report.explain(record, job_b)
    return str(
        fake_daemon(
            {
                "/v1/allocations": {"GET": lambda _: allocations},
                "/v1/explain": {"GET": lambda _: explained},
            }
        )
    )


def read_commands(planned_daemon: str, cgroup_root: Path) -> dict[str, list[str]]:
    return {
        "WorkloadList": ["workloads", "--cgroup-root", str(cgroup_root), "-c", str(EXAMPLE)],
        "Allocations": ["allocations", "--socket", planned_daemon],
        "Explanation": ["explain", "job-b", "--socket", planned_daemon],
        "PolicyCheck": ["validate", str(EXAMPLE)],
        "CapacityPlan": [
            "capacity",
            "--arrival-rate",
            "3",
            "--service-rate",
            "1",
            "--servers",
            "4",
        ],
    }


def json_of(args: list[str]) -> Any:
    """What the command prints with --json (a process of its own: the daemon stand-in in
    this one logs to stdout)."""
    proc = nodeagent(*args, "--json")
    assert proc.returncode == 0, (args, proc.stderr)
    return json.loads(proc.stdout)


def test_every_read_command_prints_one_versioned_object(
    planned_daemon: str, cgroup_root: Path
) -> None:
    """workloads --json was a bare array while the others were objects, none versioned."""
    for kind, args in read_commands(planned_daemon, cgroup_root).items():
        doc = json_of(args)
        assert isinstance(doc, dict), args
        assert list(doc)[:2] == ["apiVersion", "kind"], args
        assert (doc["apiVersion"], doc["kind"]) == ("nodeagent/v1", kind)
    items = json_of(read_commands("", cgroup_root)["WorkloadList"])["items"]
    assert {i["cgroup"] for i in items} >= {DOCKER, POD_CONTAINER}


def test_every_figure_in_the_json_says_its_unit(planned_daemon: str, cgroup_root: Path) -> None:
    """`power_limit_w` beside a bare `memory_total`; here: `cpu_rate`, `memory_current`,
    `time`, `tenant_usage`, a deadline's `remaining`, `rate`, `slack`, capacity's `_s`."""
    for args in read_commands(planned_daemon, cgroup_root).values():
        assert figures_without_units(json_of(args)) == [], args
    doc = json_of(["allocations", "--socket", planned_daemon])
    job = next(a for a in doc["allocations"] if a["cgroup"] == "nodeagent.slice/job-b")
    assert job["cpu_rate_cores"] == 1.0
    assert set(job["deadline"]) >= {
        "deadline_timestamp_seconds",
        "remaining_cpu_seconds",
        "required_rate_cores",
        "slack_seconds",
    }
    assert doc["timestamp_seconds"] == 1_700_000_000.0
    assert set(doc["tenant_usage_cpu_seconds"]) <= {"a", "b"}


def test_the_json_helper_keeps_a_documents_kind_its_own() -> None:
    """For every command's --json (gpus too): the envelope's kind cannot be overwritten
    by a workload's `kind`, which is how explain --json first lost its own."""
    from nodeagent.cli.output import document, item_list

    assert item_list("GpuList", [{"index": 0}], node="n1") == {
        "apiVersion": "nodeagent/v1",
        "kind": "GpuList",
        "node": "n1",
        "items": [{"index": 0}],
    }
    with pytest.raises(ValueError, match="own apiVersion or kind"):
        document("Explanation", {"kind": "job"})


# --- NO_COLOR (issue 13, item 19, the CLI's part) ---------------------------------------------


@pytest.mark.parametrize(("no_color", "color"), [("1", False), ("", None), (None, None)])
def test_no_color_turns_off_every_style_the_commands_print(
    monkeypatch: pytest.MonkeyPatch, no_color: str | None, color: bool | None
) -> None:
    """Nothing the CLI prints is styled today; any click style a command adds (gpus, say)
    is stripped under NO_COLOR (set and not empty, as no-color.org says), even on a
    terminal. The console log renderer is nodeagent/logs.py's to fix."""
    from nodeagent.cli import entrypoint

    seen: list[bool | None] = []

    @click.command("colour-probe")
    def probe() -> None:
        seen.append(click.get_current_context().color)

    monkeypatch.setitem(main.commands, "colour-probe", probe)
    monkeypatch.setattr(sys, "argv", ["nodeagent", "colour-probe"])
    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    entrypoint()
    assert seen == [color]
