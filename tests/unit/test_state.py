"""The state file: round trip, atomic replacement, and one-line errors for bad files."""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path

import pytest
import structlog
from hostile import outcome_without_blocking_on
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nodeagent import state
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import Agent, open_agent
from nodeagent.errors import NodeagentError
from nodeagent.policyfile.load import check_text
from nodeagent.state import SavedState

OLD = SavedState(1_700_000_000.0, {"research": 1234.5, "prod": 0.0})
NEW = SavedState(1_700_000_600.0, {"research": 99.0})


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state.save(str(path), OLD)
    assert state.load(str(path)) == OLD
    assert json.loads(path.read_text())["version"] == state.VERSION


def test_the_gpu_history_round_trips_and_older_files_have_none(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    saved = SavedState(1.0, {}, gpu_history={"training": [3600.0, 5400.0]})
    state.save(str(path), saved)
    assert state.load(str(path)) == saved
    state.save(str(path), OLD)
    raw = json.loads(path.read_text())
    del raw["gpu_history"]
    path.write_text(json.dumps(raw))
    loaded = state.load(str(path))
    assert loaded is not None and loaded.gpu_history == {}


def test_save_creates_the_directory(tmp_path: Path) -> None:
    path = tmp_path / "var" / "lib" / "nodeagent" / "state.json"
    state.save(str(path), OLD)
    assert state.load(str(path)) == OLD


def test_save_replaces_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state.save(str(path), OLD)
    inode = path.stat().st_ino
    state.save(str(path), NEW)
    assert state.load(str(path)) == NEW
    assert os.listdir(tmp_path) == ["state.json"]
    assert path.stat().st_ino != inode, "a new file renamed over the old, not rewritten in place"


@settings(max_examples=50, deadline=None)  # each example fsyncs a real file
@given(
    st.floats(min_value=0, max_value=4e9),
    st.dictionaries(
        st.text(min_size=1, max_size=20),
        st.floats(min_value=0, max_value=1e15, allow_nan=False),
        max_size=10,
    ),
)
def test_round_trip_property(saved_at: float, usage: dict[str, float]) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "state.json")
        state.save(path, SavedState(saved_at, usage))
        assert state.load(path) == SavedState(saved_at, usage)
        assert os.listdir(d) == ["state.json"]


def test_a_failed_rename_keeps_the_old_file_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    state.save(str(path), OLD)
    before = path.read_bytes()

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        state.save(str(path), NEW)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failed_write_keeps_the_old_file_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    state.save(str(path), OLD)
    before = path.read_bytes()

    def fail(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="Input/output error"):
        state.save(str(path), NEW)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["state.json"]


def test_unserialisable_state_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state.save(str(path), OLD)
    before = path.read_bytes()
    with pytest.raises(TypeError):
        state.save(str(path), SavedState(1.0, {"research": object()}))  # type: ignore[dict-item]
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["state.json"]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_save_refuses_what_load_would_reject(tmp_path: Path, bad: float) -> None:
    """save must not replace a good file with one that load refuses at the next start."""
    path = tmp_path / "state.json"
    state.save(str(path), OLD)
    before = path.read_bytes()
    with pytest.raises((ValueError, NodeagentError)):
        state.save(str(path), SavedState(2.0, {"research": bad}))
    assert path.read_bytes() == before
    assert state.load(str(path)) == OLD


def test_missing_file_is_none(tmp_path: Path) -> None:
    assert state.load(str(tmp_path / "nope.json")) is None


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"{not json", "unreadable"),
        (b"", "unreadable"),
        (b"\xff\xfe\x00", "unreadable"),
        (b"[]", "malformed"),
        (b'"state"', "malformed"),
        (b'{"saved_at": 1.0, "tenant_usage": {}}', "malformed"),
        (b'{"version": 2, "saved_at": 1.0, "tenant_usage": {}}', "malformed: version 2 is not 1"),
        (b'{"version": 1, "tenant_usage": {}}', "malformed"),
        (b'{"version": 1, "saved_at": 1.0}', "malformed"),
        (b'{"version": 1, "saved_at": 1.0, "tenant_usage": []}', "malformed"),
        (b'{"version": 1, "saved_at": 1.0, "tenant_usage": {"a": -1.0}}', "non-negative"),
        (b'{"version": 1, "saved_at": 1.0, "tenant_usage": {"a": NaN}}', "finite"),
        (b'{"version": 1, "saved_at": 1.0, "tenant_usage": {"a": Infinity}}', "finite"),
        (b'{"version": 1, "saved_at": 1.0, "tenant_usage": {"a": "lots"}}', "malformed"),
        (b'{"version": 1, "saved_at": "yesterday", "tenant_usage": {}}', "malformed"),
        (
            b'{"version": 1, "saved_at": 1.0, "tenant_usage": {}, "gpu_history": []}',
            "gpu_history must be an object",
        ),
    ],
)
def test_bad_files_are_one_line_errors_naming_the_file(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(NodeagentError) as info:
        state.load(str(path))
    message = str(info.value)
    assert message.startswith(f"state file {path} is ")
    assert problem in message
    assert "\n" not in message


def test_a_directory_in_place_of_the_file(tmp_path: Path) -> None:
    with pytest.raises(NodeagentError, match=f"state file {tmp_path} is unreadable"):
        state.load(str(tmp_path))


# Hostile state files (issue 5, item 7): only NodeagentError, whatever the file holds


def _file(saved_at: bytes = b"1.0", usage: bytes = b'{"a": 1.0}', version: bytes = b"1") -> bytes:
    return b'{"version": %s, "saved_at": %s, "tenant_usage": %s}' % (version, saved_at, usage)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (_file(saved_at=b"9" * 309), "malformed: saved_at must be finite"),
        (_file(saved_at=b"9" * 5000), "malformed: saved_at must be finite"),
        (_file(usage=b'{"a": 1%s}' % (b"0" * 308)), "malformed: usage must be finite"),
        (_file(usage=b'{"a": %s}' % (b"9" * 5000)), "malformed: usage must be finite"),
        (_file(usage=b'{"a": 1e400}'), "malformed: usage must be finite"),
        (_file(usage=b'{"a": 1e300}'), "at most 1e+18"),
        (_file(saved_at=b"NaN"), "malformed: saved_at must be finite"),
        (_file(saved_at=b"true"), "malformed: saved_at must be a number, got bool"),
        (_file(usage=b'{"a": true}'), "malformed: usage of tenant 'a' must be a number, got bool"),
        (_file(usage=b'{"a": [1]}'), "malformed: usage of tenant 'a' must be a number, got list"),
        (_file(usage=b'{"a": {"b": 1}}'), "must be a number, got dict"),
        (_file(version=b"true"), "malformed: version True is not 1"),
        (_file(version=b"1.0"), "malformed: version 1.0 is not 1"),
        (_file(version=b"9" * 5000), "malformed: version inf is not 1"),
        (b"[" * 100_000 + b"]" * 100_000, "unreadable: nested too deeply"),
        (_file(usage=b'{"a": ' * 100_000 + b"1" + b"}" * 100_000), "unreadable: nested too deeply"),
        (b"1" * 5000, "malformed: not a JSON object"),
        (b"null", "malformed: not a JSON object"),
    ],
)
def test_hostile_files_are_one_line_errors(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(NodeagentError) as info:
        state.load(str(path))
    message = str(info.value)
    assert message.startswith(f"state file {path} is ")
    assert problem in message
    assert "\n" not in message


def test_a_file_too_large_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(_file()[:-1] + b" " * state.MAX_BYTES + b"}")
    with pytest.raises(NodeagentError, match="is unreadable: larger than 4 MiB"):
        state.load(str(path))


def test_save_refuses_what_load_would_refuse_as_too_large(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    huge = SavedState(1.0, {f"{i:04d}" + "t" * 1000: 1.0 for i in range(5000)})
    with pytest.raises(NodeagentError, match="larger than 4 MiB"):
        state.save(str(path), huge)
    assert not path.exists()


def test_a_device_is_refused_without_reading_it() -> None:
    with pytest.raises(NodeagentError) as info:
        state.load("/dev/zero")
    assert str(info.value) == (
        "state file /dev/zero is unreadable: it is a character device, not a regular file"
    )


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "state.json"
    os.mkfifo(fifo)
    error = outcome_without_blocking_on(str(fifo), lambda: state.load(str(fifo)))
    assert isinstance(error, NodeagentError)
    assert str(error) == f"state file {fifo} is unreadable: it is a FIFO, not a regular file"


def test_a_nul_byte_in_the_path_is_a_one_line_error() -> None:
    with pytest.raises(NodeagentError, match="is unreadable: the path contains a NUL byte"):
        state.load("/var/lib/nodeagent/a\0b")


def test_tenants_no_longer_in_the_policy_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(_file(usage=b'{"a": 1.0, "gone": 2.0, "bad-but-gone": true}'))
    assert state.load(str(path), tenants={"a", "new"}) == SavedState(1.0, {"a": 1.0})
    assert state.load(str(path), tenants=set()) == SavedState(1.0, {})


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300, max_value=10**400)
    | st.floats()
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@example(_file(usage=b'{"a": %d}' % 10**400))  # int() is fine, float() of it overflowed
@example(_file(saved_at=b"true"))
@example(b"[" * 50_000)
@given(
    st.one_of(
        st.binary(max_size=200),
        st.fixed_dictionaries(
            {"version": JSON | st.just(1), "saved_at": JSON, "tenant_usage": JSON}
        ).map(lambda d: json.dumps(d).encode()),
        st.dictionaries(st.text(max_size=5), JSON, max_size=3).map(
            lambda usage: _file(usage=json.dumps(usage).encode())
        ),
    )
)
def test_any_content_gives_state_or_a_nodeagent_error(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "state.json")
        with open(path, "wb") as f:
            f.write(content)
        try:
            saved = state.load(path)
        except NodeagentError as e:
            assert "\n" not in str(e)
        else:
            assert saved is not None
            assert math.isfinite(saved.saved_at)
            assert all(0 <= v <= state.MAX_USAGE for v in saved.tenant_usage.values())


# The daemon's side: what it loads and how often a failing save is logged


def _agent(tmp_path: Path, state_file: Path, tenants: str = "a: {shares: 1}") -> Agent:
    cgroups = tmp_path / "cgroup"
    cgroups.mkdir(exist_ok=True)
    spec = check_text(
        f"version: 1\nagent: {{state_file: {state_file}}}\ntenants: {{{tenants}}}\n", "p.yaml"
    ).spec
    return open_agent(spec, CgroupTree(str(cgroups)))


def test_the_agent_loads_only_the_tenants_of_its_policy(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state.save(str(path), SavedState(time.time(), {"a": 10.0, "gone": 5.0}))
    agent = _agent(tmp_path, path)
    assert set(agent.rec.feedback.usage) == {"a"}
    assert agent.rec.feedback.usage["a"] == pytest.approx(10.0, rel=0.01)


def test_a_failing_save_is_logged_once_per_interval_not_every_tick(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("")  # a file where a directory is needed: ENOTDIR
    agent = _agent(tmp_path, tmp_path / "blocker" / "state.json")
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            agent.tick()
    assert [e["event"] for e in logs if e["event"].startswith("state.")] == ["state.save_failed"]


def test_jobs_and_carried_state_round_trip(tmp_path: Path) -> None:
    path = str(tmp_path / "state.json")
    saved = state.SavedState(
        1.0,
        {"a": 2.0},
        ({"name": "j", "cgroup": "nodeagent.slice/j"},),
        {"protection": {"caps": {"batch": 0.5}, "frozen": []}},
    )
    state.save(path, saved)
    assert state.load(path) == saved


@pytest.mark.parametrize(
    ("extra", "message"),
    [({"jobs": {"j": 1}}, "jobs must be a list"), ({"carry": {"p": 1}}, "carry must be an object")],
)
def test_malformed_jobs_or_carry_are_one_line_errors(
    tmp_path: Path, extra: dict[str, object], message: str
) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"version": 1, "saved_at": 1.0, "tenant_usage": {}, **extra}))
    with pytest.raises(NodeagentError, match=message):
        state.load(str(path))


def test_too_many_originals_are_dropped_rather_than_the_jobs_and_holds(tmp_path: Path) -> None:
    """Past the file's bound, what release would hand back goes (with a warning), not the
    whole save: the jobs, holds and usage are still written."""
    long = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-{}.scope"
    originals = {
        long.format(i, "0" * 64): {
            a: {"was": "max 100000", "set": "50000 100000", "via": "systemd"}
            for a in ("cpu.max", "memory.max", "memory.high", "cpu.weight")
        }
        for i in range(20_000)
    }
    job = {"name": "train", "cgroup": "nodeagent.slice/train"}
    path = tmp_path / "state.json"
    with structlog.testing.capture_logs() as logs:
        state.save(str(path), state.SavedState(1.0, {"a": 2.0}, [job], originals=originals))
    raw = json.loads(path.read_text())
    assert (raw["jobs"], raw["tenant_usage"], raw["originals"]) == ([job], {"a": 2.0}, {})
    assert [(e["event"], e["records"]) for e in logs] == [("state.originals_dropped", 80_000)]


def test_the_journal_adds_originals_the_file_lacks_and_drops_a_torn_line(tmp_path: Path) -> None:
    """Between saves the agent appends first changes to the journal; a crash mid-append
    leaves a torn last line, dropped alone; the file's record of an attribute wins (a save
    removes the journal, so its lines are never newer than the file)."""
    path = str(tmp_path / "state.json")
    kept = {"was": "max 100000", "set": "5000 100000", "via": "direct"}
    state.save(path, state.SavedState(1.0, {}, originals={"a": {"cpu.max": kept}}))
    journaled = {"was": "100", "set": "50", "via": "direct"}
    records = [
        ("a", "cpu.max", {**kept, "set": "1 100000"}),
        ("a", "cpu.weight", journaled),
        ("b", "cpu.weight", journaled),
    ]
    state.append_originals(path, records)
    with open(state.journal_path(path), "a") as f:
        f.write('{"cgroup": "c", "attri')  # killed mid-write
    with structlog.testing.capture_logs() as logs:
        loaded = state.load(path)
    assert loaded is not None
    assert loaded.originals == {
        "a": {"cpu.max": kept, "cpu.weight": journaled},
        "b": {"cpu.weight": journaled},
    }
    assert [(e["event"], e["line"]) for e in logs] == [("state.journal_line_dropped", 4)]
    state.save(path, loaded)
    assert not os.path.exists(state.journal_path(path))
    assert state.load(path).originals == loaded.originals  # type: ignore[union-attr]


def test_a_journal_without_a_state_file_is_loaded(tmp_path: Path) -> None:
    """An agent killed before its first save of the file: its first changes are kept."""
    path = str(tmp_path / "state.json")
    assert state.load(path) is None
    record = {"was": "0", "set": "1", "via": "systemd"}
    state.append_originals(path, [("x.scope", "cgroup.freeze", record)])
    loaded = state.load(path)
    assert loaded is not None
    assert loaded.originals == {"x.scope": {"cgroup.freeze": record}}
    assert loaded.jobs == () and dict(loaded.tenant_usage) == {}


# A state file of another version (a downgrade, an upgrade that changed it) or a damaged one


def _file_of_another_version(path: Path) -> str:
    """Version 2's file, with what release would need; and its journal beside it."""
    originals = {"system.slice/x.scope": {"cpu.max": {"old": "max"}}}
    body = json.dumps(
        {"version": 2, "saved_at": 1.0, "tenant_usage": {"a": 1.0}, "originals": originals}
    )
    path.write_text(body)
    Path(state.journal_path(str(path))).write_text('{"cgroup": "y"}\n')
    return body


def test_a_file_this_version_cannot_read_is_kept_aside_not_overwritten(tmp_path: Path) -> None:
    """Issue 36 item 3: the agent logged state.unusable, started empty, and its first save
    replaced the file, losing the originals that `release` of the version that wrote it
    needs."""
    path = tmp_path / "state.json"
    body = _file_of_another_version(path)
    with structlog.testing.capture_logs() as logs:
        agent = _agent(tmp_path, path)
    [said] = [e for e in logs if e["event"] == "state.unusable"]
    kept = [Path(k) for k in said["kept"]]
    assert [k.name[: -len("YYYYmmddTHHMMSSZ")] for k in kept] == [
        "state.json.unusable-",
        "state.json.originals.unusable-",
    ]
    assert said["error"] == f"state file {path} is malformed: version 2 is not 1"
    assert f"{kept[0]} keeps what it recorded: `nodeagent release" in said["action"]
    agent.save_state()
    assert kept[0].read_text() == body, "kept as it was"
    assert kept[1].read_text() == '{"cgroup": "y"}\n'
    assert state.load(str(path)) is not None, "this agent's own file, new"


def test_a_dry_run_leaves_a_file_it_cannot_read_where_it_is(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    body = _file_of_another_version(path)
    (tmp_path / "cgroup").mkdir()
    text = f"version: 1\nagent: {{state_file: {path}}}\ntenants: {{a: {{shares: 1}}}}\n"
    spec = check_text(text, "p.yaml").spec
    open_agent(spec, CgroupTree(str(tmp_path / "cgroup")), dry_run=True)
    assert path.read_text() == body
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cgroup", "state.json", "state.json.originals"
    ]  # fmt: skip


def test_a_file_that_cannot_be_moved_aside_stops_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    _file_of_another_version(path)

    def refuse(old: str, new: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(NodeagentError) as e:
        _agent(tmp_path, path)
    assert str(e.value).startswith(
        f"state file {path} is malformed: version 2 is not 1; and cannot move {path} aside to"
        f" {path}.unusable-"
    )
    assert str(e.value).endswith(": Permission denied: refusing to start over it")
