"""Whose deadline is defended, on a real kernel (issue 34, item 9): the real unprivileged uid
65534 (nobody, in the socket's group), calling through setpriv and curl with real peer
credentials, may not declare a deadline in a class that takes none (batch, by default);
in a class whose `declared_deadlines` is `scheduled` its job runs, spinning, short of the
floor its declaration asks for, and the protection controller throttles and freezes
nobody for it: a busy besteffort cgroup beside it keeps `cpu.max` max and stays thawed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import busy, read, rel, running, spec, wait_for

from nodeagent.daemon import Agent

GROUP = 4242  # the socket's group: a gid no user on the node has
NOBODY = 65534
SPIN = "sh -c 'while :; do :; done'"
SLEEP = "sleep 60"


@pytest.fixture
def daemon(cgroup_sandbox: Path, tmp_path: Path) -> Iterator[tuple[Agent, Path, Path]]:
    run = Path(tempfile.mkdtemp(prefix="nodeagent-deadlines-", dir="/run"))
    run.chmod(0o755)
    sock = run / "api" / "nodeagent.sock"
    managed = cgroup_sandbox / "managed"
    policy = spec(
        rel(managed),
        tmp_path,
        agent={"socket": str(sock), "socket_group": str(GROUP), "interval": 0.5},
        tenants={"a": {"shares": 1}},
        jobs={
            "default_tenant": "a",
            "access": [{"users": [NOBODY], "tenants": ["a"], "classes": ["training"]}],
        },
        classes={"training": {"declared_deadlines": "scheduled"}},
        protection={"step": 0.5, "freeze_after": 2},
        rules=[{"name": "be", "match": {"name": "be-*"}, "tenant": "a", "class": "besteffort"}],
    )
    try:
        with running(policy) as a:
            yield a, sock, managed
    finally:
        shutil.rmtree(run, ignore_errors=True)


def start_as_nobody(sock: Path, body: dict[str, object], child: str) -> tuple[int, str]:
    """POST /v1/jobs as uid 65534 in the socket's group, through curl, naming as the job's
    process a child of the calling process (`child`, started by the shell that then
    becomes curl): (status, answer)."""
    payload = json.dumps({**body, "pid": "$CHILD"}).replace('"$CHILD"', "$CHILD")
    curl = (
        f"curl -sS --max-time 30 --unix-socket {sock} -X POST -w '\\n%{{http_code}}'"
        ' -H "Content-Type: application/json" -d "$BODY"'
    )
    fill = 'BODY=$(printf %s "$0" | sed "s/[$]CHILD/$CHILD/")'
    script = f"{child} </dev/null >/dev/null 2>&1 & CHILD=$!; {fill}; exec {curl} http://localhost/v1/jobs"
    argv = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--groups", str(GROUP)]
    argv += ["sh", "-c", script, payload]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    out, _, code = done.stdout.rpartition("\n")
    return int(code or 0), out + done.stderr


def test_a_members_deadline_is_refused_where_its_class_takes_none(
    daemon: tuple[Agent, Path, Path],
) -> None:
    a, sock, managed = daemon
    due = {"name": "due", "deadline": time.time() + 60, "work": 1000}
    status, out = start_as_nobody(sock, due, SLEEP)  # batch, the default class
    assert status == 403, out
    assert "uid 65534" in out and "may not declare a deadline in class batch" in out, out
    assert not (managed / "due").exists() and a.rec.jobs.dump() == []
    status, out = start_as_nobody(sock, {"name": "plain"}, SLEEP)
    assert status == 200, out  # without a deadline, as before
    # root's is the operator's word, through the real CLI
    root = subprocess.Popen(
        ["nodeagent", "exec", "--socket", str(sock), "--name", "roots", "--deadline", "+60s",
         "--work", "10", "--", "sleep", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:

        def names() -> set[str]:
            return {str(j["name"]) for j in a.rec.jobs.dump()}

        assert wait_for(lambda: "roots" in names(), timeout=120), root.stderr
        assert names() == {"plain", "roots"}
    finally:
        root.send_signal(signal.SIGTERM)
        root.communicate(timeout=60)
        for job in a.rec.jobs.dump():
            if job["name"] == "plain":
                os.kill(int(job["pid"]), signal.SIGKILL)


def test_a_deadline_the_policy_schedules_throttles_and_freezes_nobody(
    daemon: tuple[Agent, Path, Path], procs: list[subprocess.Popen[bytes]]
) -> None:
    a, sock, managed = daemon
    be = managed / "be-1"
    be.mkdir()
    procs += [busy(be), busy(be), busy(be)]
    body = {"name": "due", "class": "training", "deadline": time.time() + 60, "work": 1000}
    status, out = start_as_nobody(sock, body, SPIN)
    assert status == 200, out
    (job,) = a.rec.jobs.dump()
    try:
        cgroup = rel(managed / "due")

        def planned() -> bool:
            last = a.rec.last
            return last is not None and any(
                n.kind == "deadline-grant" and n.path == cgroup for n in last.plan.notes
            )

        assert wait_for(planned, timeout=60), "the job is planned, with why it is not defended"
        seen = []
        end = time.monotonic() + 15  # 30 ticks: enough for protection to freeze, if it would
        while time.monotonic() < end:
            last = a.rec.last
            assert last is not None
            (note,) = [n for n in last.plan.notes if n.kind == "protection"]
            grants = [n for n in last.plan.notes if n.kind == "deadline-grant"]
            assert [(n.path, n.status) for n in grants] == [(cgroup, "scheduled")]
            seen.append((note.status, read(be, "cpu.max"), read(be, "cgroup.freeze")))
            time.sleep(0.5)
        assert set(seen) == {("idle", "max 100000", "0")}, seen
    finally:
        os.kill(int(job["pid"]), signal.SIGKILL)
