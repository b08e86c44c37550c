"""Another user's GPUs on a real kernel (issue 12, items 1 and 2): root runs a job with a
GPU through the real `nodeagent exec`, and holds a granted request; the real unprivileged
uid 65534 (nobody, in the socket's group), calling through setpriv and curl, can neither
release that job's GPU by name, nor read, cancel or claim root's request. The GPUs are a
simulated node (a labelled fake from config/gpus/; no GPU here); the cgroups, processes,
peer credentials and uids are real.

Issue 34, item 6: bob (uid 65533) cannot bind his reservation to a container of alice's
(uid 65534): its cgroup is named as docker's cgroupfs driver names a container (a
stand-in: no dockerd), and its process, alice's, is real.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import rel, running, spawn, spec, wait_for, wait_until

from nodeagent.api import client
from nodeagent.daemon import Agent

REPO = Path(__file__).resolve().parents[2]
NODE = str(REPO / "config" / "gpus" / "4x-a100-two-nvlink-pairs.yaml")
GROUP = 4242  # the socket's group: a gid no user on the node has
NOBODY = 65534
BOB = 65533
CGROUP_ROOT = Path("/sys/fs/cgroup")


@pytest.fixture
def daemon(cgroup_sandbox: Path, tmp_path: Path) -> Iterator[tuple[Agent, Path]]:
    run = Path(tempfile.mkdtemp(prefix="nodeagent-gpus-", dir="/run"))
    run.chmod(0o755)
    sock = run / "api" / "nodeagent.sock"
    policy = spec(
        rel(cgroup_sandbox) + "/managed",
        tmp_path,
        agent={"socket": str(sock), "socket_group": str(GROUP), "interval": 0.5},
        tenants={"research": {"shares": 1}},
        jobs={"default_tenant": "research"},
        gpu={"simulate": NODE},
    )
    try:
        with running(policy) as a:
            yield a, sock
    finally:
        shutil.rmtree(run, ignore_errors=True)


def as_nobody(
    sock: Path, method: str, path: str, body: str | None = None, uid: int = NOBODY
) -> tuple[int, str]:
    """One API call as `uid` (65534 unless told) in the socket's group, through curl:
    (status, body). In `body`, $CHILD is the pid of a child of the calling process (a sleep
    it started)."""
    curl = f"curl -sS --max-time 30 --unix-socket {sock} -X {method} -w '\\n%{{http_code}}'"
    if body is not None:
        curl += " -H 'Content-Type: application/json' -d \"$BODY\""
    fill = 'BODY=$(printf %s "$0" | sed "s/[$]CHILD/$CHILD/")'
    script = f"sleep 60 </dev/null >/dev/null 2>&1 & CHILD=$!; {fill}; exec {curl} http://localhost{path}"
    argv = ["setpriv", "--reuid", str(uid), "--regid", str(uid)]
    argv += ["--groups", str(GROUP), "sh", "-c", script, body or ""]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    out, _, code = done.stdout.rpartition("\n")
    return int(code or 0), out + done.stderr


def test_another_uid_can_neither_release_nor_claim_roots_gpus(daemon: tuple[Agent, Path]) -> None:
    a, sock = daemon
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "NVIDIA_"))}
    job = subprocess.Popen(
        ["nodeagent", "exec", "--socket", str(sock), "--name", "train", "--gpus", "1", "--",
         "sleep", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:

        def holds() -> set[tuple[str, str]]:
            return {(h.owner, str(h.kind)) for h in a.rec.gpus.ledger.holds()}

        assert wait_for(lambda: ("train", "job") in holds(), timeout=120), job.stderr
        granted = client.post(str(sock), "/v1/gpus/requests", {"name": "held", "count": 1})
        assert isinstance(granted, dict) and granted["status"] == "granted"
        rid = granted["id"]

        # item 1: the running job's GPU is not released by name, by anyone but its end
        status, out = as_nobody(sock, "DELETE", "/v1/gpus/reservations", '{"name": "train"}')
        assert status == 409 and "only reservations are released by name" in out, out
        # and what is left does not reach 4 GPUs: nobody's request for all of them waits
        status, out = as_nobody(sock, "POST", "/v1/gpus/requests", '{"name": "all", "count": 4}')
        assert status == 200 and json.loads(out)["status"] == "waiting", out

        # item 2: root's granted request is root's alone
        status, out = as_nobody(sock, "GET", f"/v1/gpus/requests?id={rid}")
        assert status == 403 and "belongs to uid 0" in out, out
        status, out = as_nobody(sock, "DELETE", "/v1/gpus/requests", json.dumps({"id": rid}))
        assert status == 403, out
        claim = {"name": "steal", "pid": "$CHILD", "gpu_request": rid}
        body = json.dumps(claim).replace('"$CHILD"', "$CHILD")
        status, out = as_nobody(sock, "POST", "/v1/jobs", body)
        assert status == 403 and "belongs to uid 0" in out, out

        assert {("train", "job"), ("held", "request")} <= holds()
        assert {h.uid for h in a.rec.gpus.ledger.holds() if h.owner in ("train", "held")} == {0}
        assert not any(j["name"] == "steal" for j in a.rec.jobs.dump())
    finally:
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=60)
    assert wait_for(lambda: ("train", "job") not in holds(), timeout=30), "its end frees it"


def test_a_member_cannot_bind_a_reservation_to_another_users_container(
    daemon: tuple[Agent, Path],
) -> None:
    a, sock = daemon
    cid = secrets.token_hex(32)
    container = CGROUP_ROOT / "docker" / cid
    container.mkdir(parents=True)
    alices = spawn(container, ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                               "--clear-groups", "sleep", "300"])  # fmt: skip
    try:
        reservations = "/v1/gpus/reservations"
        status, out = as_nobody(sock, "POST", reservations, '{"name": "bob-early"}', uid=BOB)
        assert status == 200, out
        theirs = json.dumps({"name": "bob-early", "container": cid})
        status, out = as_nobody(sock, "POST", reservations + "/container", theirs, uid=BOB)
        assert status == 200, out  # naming it is his to do; binding to it is not
        # alice's is made after bob's names her container: the pass that binds hers has
        # tried his (an earlier hold) against the same discovery
        mine = json.dumps({"name": "alice-web", "container": cid})
        status, out = as_nobody(sock, "POST", reservations, mine)
        assert status == 200, out

        def bound() -> dict[str, str | None]:
            return {h.owner: h.cgroup for h in a.rec.gpus.ledger.holds()}

        wait_until(lambda: bound().get("alice-web") == f"docker/{cid}", 120,
                   f"alice's reservation bound to docker/{cid}: {bound()}")  # fmt: skip
        assert bound()["bob-early"] is None, bound()
        status, out = as_nobody(sock, "GET", "/v1/gpus", uid=BOB)
        assert status == 200, out
        # the simulated node's own stray processes are violators; nothing is bob's to judge
        found = [v for g in json.loads(out)["gpus"] for v in g["violations"]]
        assert not [v for v in found if v["holder"] == "bob-early" or cid in v["cgroup"]], out
    finally:
        alices.kill()
        alices.wait(timeout=30)
        assert wait_for(lambda: not (container / "cgroup.procs").read_text().split(), timeout=30)
        container.rmdir()
        if not any(p.is_dir() for p in (CGROUP_ROOT / "docker").iterdir()):
            (CGROUP_ROOT / "docker").rmdir()
