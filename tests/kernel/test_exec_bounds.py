"""A job keeps its caller's limits on a real kernel (issue 34 item 4): with
`user.slice/user-65534.slice` at pids.max 16 and memory.max 96M, a job that uid 65534
(nobody) starts from a session in that slice starts fewer than 17 of 60 children, and one
that touches 300 MiB is held to 96M (OOM-killed). Before, the job's process left the slice
for the managed root, which had neither a pids controller nor a memory.max: 60 of 60
children started and 300 MiB were touched.

The slice is made under the test's sandbox, as systemd makes a login's. The caller is the
real uid 65534 in the API socket's group, calling as `nodeagent exec` calls (the venv's
Python lives under /root, which nobody may enter, so curl stands in for the CLI, as in
test_api_abuse.py): its child waits, the daemon moves it into the job's cgroup, then it
runs the command. One daemon serves both tests.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import CGROUP_ROOT, enable_controllers, new_sandbox_path, remove_cgroup_tree
from helpers import read, rel, running, spec, wait_until

from nodeagent.api import client
from nodeagent.daemon import Agent

NOBODY = 65534
GROUP = 4242  # the socket's group: a gid no user on the node has
CONTROLLERS = ("cpu", "memory", "pids")
MEMORY_MAX = 96 << 20


@dataclass
class Node:
    agent: Agent
    sock: Path
    slice: Path
    """user.slice/user-65534.slice, under the sandbox."""
    shared: Path
    """A directory uid 65534 may write to."""

    def job(self, name: str) -> Path:
        return CGROUP_ROOT / self.agent.rec.spec.agent.managed_root / name


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    offered = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
    assert "pids" in offered, f"the cgroup root offers no pids controller: {offered}"
    enable_controllers(CGROUP_ROOT, CONTROLLERS)
    sandbox = new_sandbox_path()
    run = Path(tempfile.mkdtemp(prefix="nodeagent-bounds-", dir="/run"))
    run.chmod(0o755)
    shared = Path(tempfile.mkdtemp(prefix="nodeagent-bounds-", dir="/run"))
    shared.chmod(0o777)
    try:
        enable_controllers(sandbox, CONTROLLERS)
        users = sandbox / "user.slice"
        users.mkdir()
        enable_controllers(users, CONTROLLERS)
        user = users / f"user-{NOBODY}.slice"
        user.mkdir()
        (user / "pids.max").write_text("16")
        (user / "memory.max").write_text("96M")
        sock = run / "nodeagent.sock"
        policy = spec(
            rel(sandbox) + "/managed",
            tmp_path_factory.mktemp("bounds"),
            agent={"socket": str(sock), "socket_group": str(GROUP), "interval": 0.5},
            tenants={"research": {"shares": 1}},
            jobs={"default_tenant": "research"},
        )
        with running(policy) as a:
            yield Node(a, sock, user, shared)
    finally:
        remove_cgroup_tree(sandbox)
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)


def start(node: Node, name: str, command: str) -> None:
    """`command` as job `name` of uid 65534, asked for from its session in the slice as
    `nodeagent exec` asks: the calling shell starts a child that waits until it is in the
    job's cgroup, then execs curl, whose child it then is, to name it to the daemon."""
    waits = f'until grep -q "/{name}$" /proc/self/cgroup; do sleep 0.1; done; {command}'
    curl = (
        f"exec curl -sS --max-time 60 --unix-socket {node.sock} -X POST"
        " -H 'Content-Type: application/json' -w '\\n%{http_code}'"
        ' -d "{\\"name\\": \\"$2\\", \\"pid\\": $CHILD}" http://localhost/v1/jobs'
    )
    script = f'sh -c "$1" </dev/null >/dev/null 2>&1 & CHILD=$!; {curl}'
    as_nobody = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY)]
    as_nobody += ["--groups", str(GROUP), "sh", "-c", script, "sh", waits, name]
    enter = 'echo $$ > "$0/cgroup.procs" && exec "$@"'  # into the slice, then as nobody
    done = subprocess.run(
        ["sh", "-c", enter, str(node.slice), *as_nobody],
        capture_output=True, text=True, check=False, timeout=90,
    )  # fmt: skip
    body, _, status = done.stdout.rpartition("\n")
    assert status == "200", f"job {name} refused: {status} {body} {done.stderr}"


def flat(cgroup: Path, name: str) -> dict[str, int]:
    """A flat-keyed file (pids.events, memory.events); empty where it is missing."""
    with contextlib.suppress(FileNotFoundError):
        return {k: int(v) for k, v in (line.split() for line in read(cgroup, name).splitlines())}
    return {}


def comms(cgroup: Path) -> list[str]:
    """The command names of the processes in `cgroup` (those that have not gone)."""
    names = []
    for pid in read(cgroup, "cgroup.procs").split():
        with contextlib.suppress(OSError):
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
    return names


def sleeps(cgroup: Path) -> int:
    """The `sleep` processes in `cgroup`: the children a job started."""
    return comms(cgroup).count("sleep")


def forked_not_run(cgroup: Path) -> int:
    """The job's children forked but not yet exec'd into `sleep`: every `sh` in `cgroup`
    but the job's own shell (which may also have gone, refused a fork)."""
    return max(0, comms(cgroup).count("sh") - 1)


def listed(node: Node, name: str) -> dict[str, object]:
    jobs = client.get(str(node.sock), "/v1/jobs")
    assert isinstance(jobs, dict)
    [job] = [j for j in jobs["jobs"] if j["name"] == name]
    assert isinstance(job, dict)
    return job


def test_a_jobs_children_stop_at_the_callers_pids_max(node: Node) -> None:
    start(node, "forks", "i=0; while [ $i -lt 60 ]; do sleep 600 & i=$((i + 1)); done; wait")
    job = node.job("forks")
    wait_until(
        lambda: flat(job, "pids.events").get("max", 0) >= 1 or sleeps(job) >= 60,
        timeout=120,
        what="a fork refused at the job's pids.max, or all 60 children started",
    )
    # The shell may fork up to the limit before any child has run: a child is `sh` until
    # it execs sleep (CI saw "0 of 60 started" with the fork already refused, under TCG).
    wait_until(
        lambda: forked_not_run(job) == 0,
        timeout=60,
        what="the job's forked children to have become sleep",
    )
    started = sleeps(job)
    assert 0 < started < 17, f"{started} of 60 children started"
    assert read(job, "pids.max") == "16"
    got = listed(node, "forks")
    assert (got["pids"], got["limits_from"]) == (
        16,
        {"memory": f"cgroup {rel(node.slice)}", "pids": f"cgroup {rel(node.slice)}"},
    )


def test_a_job_that_touches_300_mib_is_held_to_the_callers_memory_max(node: Node) -> None:
    status = node.shared / "status"
    start(
        node,
        "touch",
        f"head -c 300M /dev/zero | tail; echo $? > {status}; exec sleep 600",
    )
    job = node.job("touch")
    wait_until(status.exists, timeout=120, what="the 300 MiB toucher to end")
    assert read(job, "memory.max") == str(MEMORY_MAX)
    events = flat(job, "memory.events")
    peak = job / "memory.peak"  # Linux 5.19 and later
    held = int(peak.read_text()) <= MEMORY_MAX if peak.exists() else False
    assert events.get("oom_kill", 0) >= 1 or held, (events, status.read_text())
    assert listed(node, "touch")["memory"] == MEMORY_MAX
