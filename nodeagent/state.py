"""The state file: what must survive a restart, written atomically.

Only the decayed usage history lives here; current limits are re-read from the
kernel on the first tick, so the file can never contradict the kernel. Writes
go to a temp file that is fsynced and renamed over the old one, and the
directory is fsynced, so a crash leaves either the old file or the new one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from nodeagent.errors import NodeagentError

VERSION = 1


@dataclass(frozen=True, slots=True)
class SavedState:
    saved_at: float
    tenant_usage: Mapping[str, float]


def save(path: str, state: SavedState) -> None:
    """Refuses what load would reject, so a bad value never replaces a good file."""
    if not all(math.isfinite(v) and v >= 0 for v in state.tenant_usage.values()):
        raise NodeagentError(f"refusing to save {path}: usage must be finite and non-negative")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o750, exist_ok=True)
    body = json.dumps(
        {"version": VERSION, "saved_at": state.saved_at, "tenant_usage": dict(state.tenant_usage)},
        sort_keys=True,
        allow_nan=False,
    )
    fd, tmp = tempfile.mkstemp(prefix=".state-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def load(path: str) -> SavedState | None:
    """The saved state, None when there is none yet; a one-line error when it is unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NodeagentError(f"state file {path} is unreadable: {e}") from e
    try:
        if data["version"] != VERSION:
            raise ValueError(f"version {data['version']} is not {VERSION}")
        usage = {str(k): float(v) for k, v in data["tenant_usage"].items()}
        if not all(math.isfinite(v) and v >= 0 for v in usage.values()):
            raise ValueError("usage must be finite and non-negative")
        return SavedState(float(data["saved_at"]), usage)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise NodeagentError(f"state file {path} is malformed: {e}") from e
