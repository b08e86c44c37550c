"""The API's threads post what changes state; the loop's thread runs it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from nodeagent.api.answers import Jobs
from nodeagent.api.peer import Peer
from nodeagent.api.server import Checked, Request
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.commands import Commands
from nodeagent.daemon import open_agent
from nodeagent.errors import BadRequest, Conflict, TryLater
from nodeagent.jobs import FinishBody
from nodeagent.policyfile.model import PolicySpec
from nodeagent.wakeup import Wakeup


def _loop(commands: Commands, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        commands.bind()
        while not stop.is_set():
            commands.run_pending()
            stop.wait(0.005)
        commands.unbind()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_command_runs_on_the_loop_thread_and_its_answer_or_error_comes_back() -> None:
    commands = Commands(Wakeup(), timeout=10)
    stop = threading.Event()
    loop = _loop(commands, stop)
    try:
        assert commands.call(threading.get_ident) == loop.ident

        def refuse() -> None:
            raise Conflict("taken")

        with pytest.raises(Conflict, match="taken"):
            commands.call(refuse)
    finally:
        stop.set()
        loop.join(10)


def test_without_a_loop_a_command_runs_in_its_caller() -> None:
    commands = Commands(Wakeup())
    assert commands.call(threading.get_ident) == threading.get_ident()


def test_a_command_the_loop_does_not_take_in_time_is_withdrawn_and_never_runs() -> None:
    commands = Commands(Wakeup(), timeout=0.05)
    commands.bind()  # this thread is "the loop", and it is busy: it runs nothing
    ran: list[int] = []
    answer: list[BaseException] = []

    def api() -> None:
        try:
            commands.call(lambda: ran.append(1))
        except TryLater as e:
            answer.append(e)

    t = threading.Thread(target=api)
    t.start()
    t.join(10)
    assert [str(e) for e in answer] == [
        "the daemon's loop did not take this request within 0.05 s (a tick that long is"
        " logged as tick.slow); try again"
    ]
    assert commands.run_pending() == 0  # withdrawn: the loop skips it
    assert ran == []


def test_a_stopping_loop_answers_what_is_still_queued() -> None:
    commands = Commands(Wakeup(), timeout=10)
    commands.bind()
    answer: list[BaseException] = []

    def api() -> None:
        try:
            commands.call(lambda: None)
        except TryLater as e:
            answer.append(e)

    t = threading.Thread(target=api)
    t.start()
    while commands._queue.empty():
        threading.Event().wait(0.001)
    commands.unbind()
    t.join(10)
    assert [str(e) for e in answer] == ["the daemon is stopping"]


def test_a_command_after_the_loop_stopped_is_refused_not_run_in_its_caller() -> None:
    """The stopping loop's last save reads the jobs: a job started then on an API thread
    would change them under it. Where no loop ever ran (--once, tests), commands run in
    their callers."""
    commands = Commands(Wakeup())
    assert commands.call(lambda: "ran") == "ran"
    commands.unbind()  # no loop had run: nothing changes
    assert commands.call(lambda: "ran") == "ran"
    commands.bind()
    commands.unbind()
    ran: list[int] = []
    with pytest.raises(TryLater, match="the daemon is stopping"):
        commands.call(lambda: ran.append(1))
    assert ran == []


def test_the_agent_runs_what_changes_state_on_its_loop_and_reads_on_the_api_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, POST /v1/jobs started the job and saved the state file on the API's thread,
    racing the loop's own save; now it runs between the loop's ticks."""
    root = tmp_path / "cgroup"
    root.mkdir()
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"state_file": str(tmp_path / "state.json"), "interval": "1s"},
            "tenants": {"t": {"shares": 1}},
            "rules": [{"name": "all", "match": {}, "tenant": "t"}],
        }
    )
    agent = open_agent(spec, CgroupTree(str(root)))
    seen: dict[str, int] = {}

    def record(*_: object, **__: object) -> object:
        seen["start"] = threading.get_ident()
        raise Conflict("recorded")

    monkeypatch.setattr(agent.rec.jobs, "start", record)
    routes = agent.routes()
    loop = threading.Thread(target=agent.run)
    loop.start()
    try:
        me = Peer(os.getpid(), os.getuid(), os.getgid(), frozenset())
        body = {"name": "j", "pid": os.getpid()}
        request = Request(method="POST", path="/v1/jobs", query={}, peer=me, body=body)
        with pytest.raises(Conflict):
            routes["/v1/jobs"]["POST"](request)
        assert seen["start"] == loop.ident
        listed = routes["/v1/jobs"]["GET"](request)
        assert listed == Jobs(jobs=[])
    finally:
        agent.stop.set()
        loop.join(30)
    assert not loop.is_alive()


def test_a_body_is_checked_on_the_api_thread_and_a_bad_one_never_reaches_the_loop() -> None:
    """Checked: the body is parsed where the request was read; the loop, here bound and
    busy (it runs nothing), is handed only a checked one, and `then` (a new view) runs after
    each command it does run, whatever the command did."""
    commands = Commands(Wakeup(), timeout=10)
    commands.bind()  # this thread is "the loop"
    handled: list[tuple[int, FinishBody]] = []
    published: list[int] = []

    def finish(_: Request, body: FinishBody) -> None:
        handled.append((threading.get_ident(), body))
        raise Conflict(f"{body.name} is taken")

    routes = commands.serve(
        {"/v1/jobs": {"DELETE": Checked(FinishBody, finish)}},
        then=lambda: published.append(threading.get_ident()),
    )
    me = Peer(os.getpid(), os.getuid(), os.getgid(), frozenset())
    answers: list[object] = []

    def api(body: dict[str, object]) -> None:
        request = Request("DELETE", "/v1/jobs", {}, me, body)
        try:
            answers.append(routes["/v1/jobs"]["DELETE"](request))
        except (BadRequest, Conflict) as e:
            answers.append(e)

    bad = threading.Thread(target=api, args=({"name": "j", "pid": 1},))
    bad.start()
    bad.join(10)
    assert [str(a) for a in answers] == ["unknown field 'pid'"]
    assert commands._queue.empty() and commands.run_pending() == 0

    good = threading.Thread(target=api, args=({"name": "taken"},))
    good.start()
    while commands._queue.empty():
        threading.Event().wait(0.001)
    assert commands.run_pending() == 1
    good.join(10)
    loop = threading.get_ident()
    assert [(who, b.name) for who, b in handled] == [(loop, "taken")]
    assert published == [loop], "a new view after the command, though it was refused"
    assert [type(a) for a in answers] == [BadRequest, Conflict]
