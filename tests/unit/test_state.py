"""The state file: round trip, atomic replacement, and one-line errors for bad files."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent import state
from nodeagent.errors import NodeagentError
from nodeagent.state import SavedState

OLD = SavedState(1_700_000_000.0, {"research": 1234.5, "prod": 0.0})
NEW = SavedState(1_700_000_600.0, {"research": 99.0})


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state.save(str(path), OLD)
    assert state.load(str(path)) == OLD
    assert json.loads(path.read_text())["version"] == state.VERSION


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
