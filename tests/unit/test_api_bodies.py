"""Bad input to the daemon's write routes (issue 12, item 20): every wrong type, absurd
number and unbounded name is a one-line 400 naming the field, before anything is made;
never a 500 (any other exception from a route is one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from daemon_api import ALICE, ROOT, Daemon, daemon

from nodeagent.errors import BadRequest


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Daemon:
    return daemon(tmp_path_factory.mktemp("bodies"))


BIG = 10**401

CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("POST", "/v1/jobs", {"name": "j", "tenant": ["x"]}, "tenant: must be a string"),
    ("POST", "/v1/jobs", {"name": "j", "deadline": BIG, "work": 1}, "deadline: must be a number"),
    ("POST", "/v1/jobs", {"name": "j", "cpus": 1e300}, "cpus: must be at most"),
    ("POST", "/v1/jobs", {"name": "j", "memory": 2**70}, "memory: must be at most"),
    ("POST", "/v1/jobs", {"name": "j", "gpu_request": 7}, "gpu_request: must be a string"),
    ("POST", "/v1/jobs", {"name": "j", "class": ["batch"]}, "class: must be"),
    ("DELETE", "/v1/jobs", {"name": ["j"]}, "name: must be a string"),
    ("DELETE", "/v1/jobs", {"name": "j", "exit_status": "0"}, "exit_status: must be a whole"),
    ("POST", "/v1/gpus/requests", {"name": "x", "tenant": ["x"]}, "tenant: must be a string"),
    ("POST", "/v1/gpus/requests", {"name": "x", "deadline": BIG}, "deadline: must be a number"),
    ("POST", "/v1/gpus/requests", {"name": "x" * 60_000}, "not a safe cgroup name"),
    ("POST", "/v1/gpus/requests", {"name": "x", "count": "2"}, "count: must be a whole number"),
    ("POST", "/v1/gpus/requests", {"name": "x", "count": 10**6}, "count: must be at most 64"),
    ("POST", "/v1/gpus/requests", {"name": "x", "memory": -1}, "memory: must be at least 1"),
    ("POST", "/v1/gpus/requests", {"name": "x", "shared": "yes"}, "shared: must be true or"),
    ("POST", "/v1/gpus/requests", {"name": "x", "mig": "a" * 999}, "mig: must be a MIG profile"),
    ("POST", "/v1/gpus/requests", {"name": "x", "shared": True}, "needs the memory it uses"),
    ("POST", "/v1/gpus/requests", {"name": "x", "work": -1}, "work: must be above 0"),
    ("POST", "/v1/gpus/requests", {"name": "x", "cpus": 1e300}, "cpus: must be at most"),
    ("DELETE", "/v1/gpus/requests", {"id": 5}, "id: must be a string"),
    ("POST", "/v1/gpus/reservations", {"name": "w", "ttl": [1]}, "ttl: "),
    ("POST", "/v1/gpus/reservations", {"name": "w", "ttl": "10y"}, "ttl: expected a duration"),
    ("POST", "/v1/gpus/reservations", {"name": "w", "ttl": 1e300}, "ttl: must be at most"),
    ("POST", "/v1/gpus/reservations", {"name": "w", "container": "a/b"}, "container: must be"),
    ("POST", "/v1/gpus/reservations", {"name": "x" * 60_000}, "not a safe cgroup name"),
    ("DELETE", "/v1/gpus/reservations", {"name": 1}, "name: must be a string"),
]


@pytest.mark.parametrize(("method", "path", "body", "message"), CASES)
def test_bad_bodies_are_one_line_400s(
    d: Daemon, method: str, path: str, body: dict[str, Any], message: str
) -> None:
    if path == "/v1/jobs" and method == "POST":
        body = {**body, "pid": d.child(ALICE)}
    e = d.refused(ALICE, method, path, body)
    assert isinstance(e, BadRequest), f"{type(e).__name__}: {e}"
    assert message in str(e)
    assert "\n" not in str(e) and len(str(e)) < 400
    assert d.jobs() == [] and d.holds() == []
    assert not (d.root / "nodeagent.slice" / "j").exists()


def test_a_past_deadline_says_when_it_was(d: Daemon) -> None:
    body = {"name": "j", "pid": d.child(ROOT), "deadline": 1.0, "work": 1}
    e = d.refused(ROOT, "POST", "/v1/jobs", body)
    assert str(e).startswith("the deadline 1970-01-01T00:00:01Z has passed (now ")
    e = d.refused(ROOT, "POST", "/v1/gpus/requests", {"name": "x", "deadline": 1.0})
    assert str(e).startswith("the deadline 1970-01-01T00:00:01Z has passed (now ")


def test_exec_is_refused_in_kubernetes_mode(tmp_path: Path) -> None:
    """Beside the kubelet a job nodeagent starts itself would be invisible to it (issue 17:
    exec refused in that mode, with one line saying why); nothing is made."""
    kube = daemon(tmp_path, {"agent": {"mode": "kubernetes"}})
    refused = kube.refused(ALICE, "POST", "/v1/jobs", {"name": "j", "pid": kube.child(ALICE)})
    assert isinstance(refused, BadRequest)
    assert str(refused) == (
        "nodeagent exec is refused: agent.mode is kubernetes, where the kubelet runs the"
        " node's workloads and counts what they use; run it as a pod instead"
    )
    assert kube.jobs() == [] and not (kube.root / "nodeagent.slice" / "j").exists()
