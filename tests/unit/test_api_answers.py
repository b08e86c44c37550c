"""Every route's answer is its model in nodeagent.api.answers (issue 14, item 7): the routes
return the model, its wire form validates back into it byte for byte, and it has no key the
model does not name outside the parts left open; so a key renamed on the daemon's side
fails here, and one renamed in the model fails mypy where the CLI reads it. An answer the
CLI cannot read is one line naming the socket and the path.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from daemon_api import ALICE, ROOT, Daemon, daemon
from pydantic import BaseModel, RootModel

from nodeagent.api import answers, client
from nodeagent.api.peer import Peer
from nodeagent.api.server import ApiServer, Request
from nodeagent.api.wire import encode
from nodeagent.errors import NodeagentError
from nodeagent.policyfile.load import digest

OPEN = (answers.Note, answers.DeadlineFigures)
"""Models whose extra keys are their open part (a note's figures differ by kind)."""


def undeclared(model: BaseModel, where: str = "") -> list[str]:
    """Keys anywhere in `model` that no model names, outside the open parts."""
    if isinstance(model, RootModel):
        return undeclared(model.root, where)
    found = [] if isinstance(model, OPEN) else [f"{where}.{k}" for k in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else list(value.values()) if isinstance(
            value, dict
        ) else [value]  # fmt: skip
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                found += undeclared(item, f"{where}.{name}[{i}]")
    return found


def served(d: Daemon, model: type[BaseModel], method: str, path: str, peer: Peer = ALICE,
           body: Mapping[str, Any] | None = None, query: Mapping[str, str] | None = None,
           ) -> Any:  # fmt: skip
    """The route's answer, checked: its model, the same bytes after a trip through the CLI's
    validation, every key named. Returns what the CLI reads."""
    handler = d.agent.routes()[path][method]
    answer = handler(Request(method, path, dict(query or {}), peer, dict(body or {})))
    assert type(answer) is model, f"{method} {path} answers {type(answer).__name__}"
    wire = encode(answer)
    read = client.fit(model, "test.sock", path, json.loads(wire))
    assert encode(read) == wire, f"{method} {path}: the model changes the wire"
    assert undeclared(read) == [], f"{method} {path}: keys the model does not name"
    return read


def test_every_route_answers_its_model(tmp_path: Path) -> None:
    d = daemon(tmp_path, {"classes": {"batch": {"declared_deadlines": "scheduled"}}})
    status = served(d, answers.Status, "GET", "/v1/status", ROOT)
    assert status.tick == 1 and status.workloads == 0
    assert status.peers == [], "nothing outside the agent asked yet"
    assert status.policy_sha256 == digest(d.agent.rec.spec)
    granted = served(d, answers.GpuGrant, "POST", "/v1/gpus/requests",
                     body={"name": "train", "count": 1})  # fmt: skip
    assert granted.status == "granted" and granted.uuids and granted.position is None
    again = served(d, answers.GpuGrant, "GET", "/v1/gpus/requests", query={"id": granted.id})
    assert again.id == granted.id
    started = served(d, answers.StartedJob, "POST", "/v1/jobs",
                     body={"name": "train", "pid": d.child(ALICE), "gpu_request": granted.id,
                           "deadline": 4e9, "work": 60.0})  # fmt: skip
    assert started.env["CUDA_VISIBLE_DEVICES"] == ",".join(granted.uuids)
    assert [j.name for j in served(d, answers.Jobs, "GET", "/v1/jobs").jobs] == ["train"]
    reserved = served(d, answers.Reservation, "POST", "/v1/gpus/reservations",
                      body={"name": "web", "count": 1})  # fmt: skip
    assert reserved.container is None
    waiting = served(d, answers.GpuGrant, "POST", "/v1/gpus/requests",
                     body={"name": "later", "count": 1})  # fmt: skip
    assert waiting.status == "waiting" and waiting.uuids is None
    d.agent.tick()
    allocations = served(d, answers.Allocations, "GET", "/v1/allocations")
    (row,) = [a for a in allocations.allocations if a.cgroup == started.cgroup]
    assert row.gpus == granted.indices and row.workload_class == started.workload_class
    explained = served(d, answers.Explanation, "GET", "/v1/explain", query={"cgroup": "train"})
    assert explained.cgroup == started.cgroup and explained.trace
    gpus = served(d, answers.GpuList, "GET", "/v1/gpus", ROOT)
    assert gpus.queue and gpus.queue[0].owner == "later"
    assert {a.owner for g in gpus.gpus for a in g.assigned or ()} == {"train", "web"}
    nothing = served(d, answers.Placement, "GET", "/v1/gpus/place", query={"count": "1"})
    assert isinstance(nothing.root, answers.NotPlaced)
    served(d, answers.Cancelled, "DELETE", "/v1/gpus/requests", body={"id": waiting.id})
    attached = served(d, answers.Attached, "POST", "/v1/gpus/reservations/container",
                      body={"name": "web", "container": "4f1c2a9be7d3"})  # fmt: skip
    assert attached.container == "4f1c2a9be7d3"
    served(d, answers.Released, "DELETE", "/v1/gpus/reservations", body={"name": "web"})
    placed = served(d, answers.Placement, "GET", "/v1/gpus/place", query={"count": "1"})
    assert isinstance(placed.root, answers.Placed) and placed.root.request.count == 1
    finished = served(d, answers.Job, "DELETE", "/v1/jobs", body={"name": "train"})
    assert finished.name == "train"


@pytest.fixture
def odd_daemon() -> Iterator[tuple[str, dict[str, object]]]:
    """A stand-in daemon whose /v1/status answers whatever the test puts in the dict."""
    sockdir = Path(tempfile.mkdtemp(prefix="nodeagent-answers-"))
    said: dict[str, object] = {}
    server = ApiServer(str(sockdir / "api.sock"), {"/v1/status": {"GET": lambda _: said["it"]}})
    server.start()
    yield server.socket_path, said
    server.close()
    shutil.rmtree(sockdir, ignore_errors=True)


GOOD_STATUS: dict[str, object] = {
    "pid": 7, "dry_run": False, "policy_file": None, "cgroup_root": "/sys/fs/cgroup",
    "managed_root": "nodeagent.slice", "tick": 3, "workloads": 2, "slurm_problem": None,
    "deadline_misses": 0, "runtimes": {},
}  # fmt: skip


@pytest.mark.parametrize(
    "answer",
    [
        {k: v for k, v in GOOD_STATUS.items() if k != "pid"},  # an older daemon
        {**{k: v for k, v in GOOD_STATUS.items() if k != "pid"}, "process": 7},  # a rename
        {**GOOD_STATUS, "pid": "seven"},
        {**GOOD_STATUS, "runtimes": {"docker": {"socket": 1}}},
        [GOOD_STATUS],
        None,
    ],
)
def test_an_answer_that_does_not_fit_is_one_line_naming_socket_and_path(
    odd_daemon: tuple[str, dict[str, object]], answer: object
) -> None:
    socket, said = odd_daemon
    said["it"] = answer
    with pytest.raises(NodeagentError) as caught:
        client.get_as(answers.Status, socket, "/v1/status")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        f"the nodeagent daemon on {socket} answered /v1/status with what this nodeagent"
        " does not expect ("
    )


def test_a_newer_daemons_extra_key_is_kept(odd_daemon: tuple[str, dict[str, object]]) -> None:
    socket, said = odd_daemon
    said["it"] = {**GOOD_STATUS, "uptime_seconds": 12.5}
    status = client.get_as(answers.Status, socket, "/v1/status")
    assert status.pid == 7 and status.model_extra == {"uptime_seconds": 12.5}
