"""`nodeagent exec --gpus` on a real kernel, with a simulated GPU node (a labelled fake from
config/gpus/; no GPU here): the real child process sees exactly its GPUs; the hold is
kept across a restart and goes back when the job ends; a request that does not fit waits
and says so; a GPU that other processes use is never handed out.

The shipped node lists made-up processes on GPUs 0 and 2, which make those GPUs busy; most
tests run on a copy without them, so that all four GPUs are free."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, rel, running, spec, wait_for

from nodeagent.api import client
from nodeagent.daemon import Agent
from nodeagent.gpu.model import Hold
from nodeagent.policyfile.model import PolicySpec

REPO = Path(__file__).resolve().parents[2]
NODE = str(REPO / "config" / "gpus" / "4x-a100-two-nvlink-pairs.yaml")


def idle(tmp_path: Path) -> str:
    """The shipped node without its processes section: every GPU free."""
    path = tmp_path / "idle-node.yaml"
    path.write_text(Path(NODE).read_text().split("\nprocesses:")[0] + "\n")
    return str(path)


def policy_for(cgroup_sandbox: Path, tmp_path: Path, node: str) -> PolicySpec:
    return spec(
        rel(cgroup_sandbox) + "/managed",
        tmp_path,
        agent={"socket": str(tmp_path / "api.sock"), "interval": 0.5},
        tenants={"research": {"shares": 1}},
        jobs={"default_tenant": "research"},
        gpu={"simulate": node},
    )


@pytest.fixture
def daemon(cgroup_sandbox: Path, tmp_path: Path) -> Iterator[tuple[Agent, str]]:
    with running(policy_for(cgroup_sandbox, tmp_path, idle(tmp_path))) as a:
        yield a, str(tmp_path / "api.sock")


def exec_(sock: str, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "NVIDIA_"))}
    return subprocess.Popen(
        ["nodeagent", "exec", "--socket", sock, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def test_the_child_sees_exactly_its_gpus(daemon: tuple[Agent, str]) -> None:
    a, sock = daemon
    show = "env | grep -E '^(CUDA|NVIDIA)_' | sort"
    p = exec_(sock, "--name", "pair", "--gpus", "2", "--", "sh", "-c", show)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    env = dict(line.split("=", 1) for line in out.split())
    uuids = env["CUDA_VISIBLE_DEVICES"].split(",")
    devices = {d.uuid: d for d in a.rec.gpus.backend.inventory()}
    assert len(uuids) == 2 and all(u in devices for u in uuids)
    nvlinked = a.rec.gpus.backend.topology().link(devices[uuids[0]].index, devices[uuids[1]].index)
    assert nvlinked.nvlinks > 0, "two GPUs of one NVLink pair"
    assert env == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(uuids),
        "NVIDIA_VISIBLE_DEVICES": ",".join(uuids),
    }
    assert wait_for(lambda: not a.rec.gpus.ledger.holds(), timeout=30), "given back at the end"


def test_a_request_that_does_not_fit_waits_and_says_so(daemon: tuple[Agent, str]) -> None:
    a, sock = daemon
    holder = exec_(sock, "--name", "all", "--gpus", "4", "--", "sleep", "300")
    try:
        assert wait_for(
            lambda: any(h.kind == "job" for h in a.rec.gpus.ledger.holds()), timeout=120
        )
        waiter = exec_(sock, "--name", "more", "--gpus", "1", "--gpu-timeout", "3s", "--", "true")
        _, err = waiter.communicate(timeout=120)
        assert waiter.returncode == 1
        assert "waiting for 1 GPU(s): position 1" in err
        assert err.strip().splitlines()[-1].startswith("nodeagent: error: no GPUs within")
        listed = client.get(sock, "/v1/gpus")
        assert isinstance(listed, dict)
        owners = {x["owner"] for g in listed["gpus"] for x in g["assigned"]}
        assert owners == {"all"}
        assert listed["queue"] == [], "the timed-out request is gone"
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.communicate(timeout=60)


def test_a_gpu_other_processes_use_is_never_handed_out(
    cgroup_sandbox: Path, tmp_path: Path
) -> None:
    """On the shipped node GPU 0 (pid 31337) and GPU 2 (pid 4711) are busy: one GPU is
    GPU 1, and a request for all four is refused at once as one for five would be."""
    with running(policy_for(cgroup_sandbox, tmp_path, NODE)) as a:
        sock = str(tmp_path / "api.sock")
        show = "echo $CUDA_VISIBLE_DEVICES"
        p = exec_(sock, "--name", "one", "--gpus", "1", "--", "sh", "-c", show)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        devices = {d.uuid: d.index for d in a.rec.gpus.backend.inventory()}
        assert [devices[u] for u in out.strip().split(",")] == [1]
        five = exec_(sock, "--name", "five", "--gpus", "5", "--", "true")
        _, err = five.communicate(timeout=120)
        assert five.returncode == 1
        assert err.strip() == (
            "nodeagent: error: this node has 4 GPUs; the request can never be placed here"
        )


def _timeless(h: Hold) -> Hold:
    return dataclasses.replace(h, until=None, since=None, expected_end=None)


def test_holds_survive_a_restart(cgroup_sandbox: Path, tmp_path: Path) -> None:
    managed = rel(cgroup_sandbox) + "/managed"
    policy = policy_for(cgroup_sandbox, tmp_path, idle(tmp_path))
    sock = str(tmp_path / "api.sock")
    with running(policy) as a:
        p = exec_(sock, "--name", "keep", "--gpus", "1", "--", "sleep", "300")
        ledger = a.rec.gpus.ledger
        claimed = lambda: any(h.owner == "keep" and h.kind == "job" for h in ledger.holds())  # noqa: E731
        assert wait_for(claimed, timeout=120)
        before = a.rec.gpus.ledger.holds()
        a.save_state()
    saved = json.loads((tmp_path / "state.json").read_text())
    assert [g["owner"] for g in saved["gpus"]] == ["keep"]
    try:
        with running(policy) as again:
            # the same holds; their times went through Unix time in the state file and back
            # to a new monotonic clock, so they agree to the clocks' difference, not exactly
            assert [_timeless(h) for h in again.rec.gpus.ledger.holds()] == [
                _timeless(h) for h in before
            ]
            for h, was in zip(again.rec.gpus.ledger.holds(), before, strict=True):
                for field in ("until", "since", "expected_end"):
                    now, then = getattr(h, field), getattr(was, field)
                    assert (now is None) == (then is None)
                    assert now is None or now == pytest.approx(then, abs=0.5)
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=60)
            assert wait_for(lambda: not again.rec.gpus.ledger.holds(), timeout=30)
            assert not Path(ROOT, managed, "keep").exists()
    finally:
        if p.poll() is None:
            p.kill()
