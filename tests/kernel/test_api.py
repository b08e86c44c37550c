"""The local API and the CLI against a real daemon (`nodeagent run`) on the real kernel.

A burst of 64 simultaneous calls all succeed (issue 5, item 12: a listen backlog of 5 and a
non-blocking connect lost most of them), and cgroups whose names are not UTF-8 or hold
control characters are managed, served, shown escaped on a strict UTF-8 stdout and found by
`explain` (item 11: a UnicodeEncodeError, or raw escape sequences on the terminal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, read, rel, sleeper, wait_for

from nodeagent.api import client

PLAIN = [b"job-0", b"job-1", b"job-2"]
# (The kernel refuses a newline in a cgroup name; a carriage return or a tab it takes.)
ODD = [b"job-\xff", b"job-\rfake\trow", b"job-\x1b[31mred"]
SHOWN_AS = ["job-\\xff", "job-\\rfake\\trow", "job-\\x1b[31mred"]
STRICT = dict(os.environ, PYTHONIOENCODING="utf-8:strict")
WEIGHT = 300


def nodeagent(*args: str | bytes) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nodeagent", *args],
        capture_output=True,
        text=True,
        env=STRICT,
        timeout=300,
        check=False,
    )


def assert_terminal_safe(stdout: str) -> None:
    assert all(c == "\n" or c.isprintable() for c in stdout), repr(stdout)


@pytest.fixture
def workloads(cgroup_sandbox: Path) -> Iterator[str]:
    """A managed root holding the PLAIN and ODD cgroups, a sleeping process in each."""
    managed = rel(cgroup_sandbox) + "/managed"
    base = Path(ROOT, managed)
    base.mkdir()
    for c in ("cpu", "memory"):
        Path(base, "cgroup.subtree_control").write_text(f"+{c}")
    procs = []
    for name in PLAIN + ODD:
        path = os.path.join(os.fsencode(base), name)
        os.mkdir(path)
        procs.append(sleeper(os.fsdecode(path)))
    yield managed
    for p in procs:
        p.kill()
        p.wait()


def policy(managed: str, tmp_path: Path) -> Path:
    config = tmp_path / "policy.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "agent": {
                    "managed_root": managed,
                    "state_file": str(tmp_path / "state.json"),
                    "socket": str(tmp_path / "api.sock"),
                    "interval": 1,
                },
                # weights of 300, not the kernel's default 100: what is read back was written
                "fair_share": {"weight_per_workload": WEIGHT},
                "tenants": {"t": {"shares": 1}},
                "rules": [{"name": "jobs", "match": {"path": f"{managed}/job-*"}, "tenant": "t"}],
            }
        )
    )
    return config


@pytest.fixture
def daemon(workloads: str, tmp_path: Path) -> Iterator[str]:
    """`nodeagent run` (strict UTF-8 output) managing the workloads; yields its socket."""
    config = policy(workloads, tmp_path)
    sock = str(tmp_path / "api.sock")
    log_path = tmp_path / "agent.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", "run", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=STRICT,
        )

    def serving_all() -> bool:
        try:
            answer = client.get(sock, "/v1/allocations", timeout=30)
        except Exception:
            return False
        return isinstance(answer, dict) and sum(
            not r["level"] for r in answer["allocations"]
        ) == len(PLAIN + ODD)

    try:
        assert wait_for(serving_all, timeout=120, step=0.2), log_path.read_text()
        yield sock
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0, log_path.read_text()
    assert "Traceback" not in log_path.read_text()


def test_64_simultaneous_allocations_calls_all_succeed(daemon: str) -> None:
    barrier = threading.Barrier(64)
    results: list[object] = [None] * 64

    def call(i: int) -> None:
        barrier.wait()
        try:
            results[i] = client.get(daemon, "/v1/allocations", timeout=30)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    failed = [r for r in results if not isinstance(r, dict)]
    assert failed == [], f"{len(failed)} of 64 failed: {failed[:3]}"


def test_odd_names_are_managed_and_shown_escaped(daemon: str, workloads: str) -> None:
    for name in PLAIN + ODD:  # the daemon set them like any other
        path = os.fsdecode(os.path.join(os.fsencode(Path(ROOT, workloads)), name))
        assert read(path, "cpu.weight") == str(WEIGHT), name

    proc = nodeagent("allocations", "--socket", daemon)
    assert proc.returncode == 0, proc.stderr
    assert_terminal_safe(proc.stdout)
    lines = proc.stdout.splitlines()
    shown = json.loads(nodeagent("allocations", "--socket", daemon, "--json").stdout)
    rows, notes = len(shown["allocations"]), len(shown["node_notes"])  # levels are rows too
    assert len(lines) == 2 + rows + notes, lines  # no name broke a row in two
    assert sum(line.startswith(f"{workloads}/") for line in lines) == len(PLAIN + ODD)
    for shown in SHOWN_AS:
        assert any(line.startswith(f"{workloads}/{shown} ") for line in lines), lines

    proc = nodeagent("allocations", "--socket", daemon, "--json")
    assert proc.returncode == 0, proc.stderr
    cgroups = {r["cgroup"] for r in json.loads(proc.stdout)["allocations"] if not r["level"]}
    assert cgroups == {f"{workloads}/{os.fsdecode(n)}" for n in PLAIN + ODD}

    for name, shown in zip(ODD, SHOWN_AS, strict=True):
        proc = nodeagent("explain", os.fsencode(workloads) + b"/" + name, "--socket", daemon)
        assert proc.returncode == 0, proc.stderr
        assert_terminal_safe(proc.stdout)
        assert proc.stdout.startswith(f"{workloads}/{shown}  (job, ")


def test_dry_run_shows_odd_names_escaped(workloads: str, tmp_path: Path) -> None:
    proc = nodeagent("run", "--config", str(policy(workloads, tmp_path)), "--dry-run", "--once")
    assert proc.returncode == 0, proc.stderr
    assert_terminal_safe(proc.stdout)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("tick 1 (dry run: nothing written): 6 workloads")
    for shown in SHOWN_AS:
        assert any(line.startswith(f"{workloads}/{shown} ") for line in lines), lines
