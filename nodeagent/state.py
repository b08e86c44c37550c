"""The state file: what must survive a restart, written atomically.

The decayed usage history, the jobs `nodeagent exec` started, the policies' carried
state (the protection controller's caps and frozen cgroups), the GPU holds, and the values
the agent changed with what they were before (for `nodeagent release`) live here; current limits are
re-read from the kernel on the first tick, so the file can never contradict the kernel. Writes
go to a temp file that is fsynced and renamed over the old one, and the
directory is fsynced, so a crash leaves either the old file or the new one.

Between saves, the first change of an attribute is appended to a journal beside the file
(`journal_path`), one fsynced JSON line each: release must find the value from before even
after a crash, and a new cgroup's writes must not wait for a save of the whole state, which
grows with the node (a 10x slower mkdir-to-first-write at 1000 cgroups when every newcomer
saved it). `load` folds the journal in; `save` removes it once the file holds it all.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Annotated, Any, Literal

import structlog
from pydantic import ConfigDict, Field, Strict, TypeAdapter

from nodeagent.api.bodies import (
    CgroupPath,
    Cpus,
    Instant,
    Memory,
    Name,
    Pid,
    Pids,
    Text,
    Token,
    Uid,
    Work,
)
from nodeagent.errors import NodeagentError
from nodeagent.policyfile.model import WorkloadClass
from nodeagent.regular_file import UnusableFile, read_regular_file, write_atomically

log = structlog.get_logger("nodeagent")

VERSION = 1
# What a valid policy can need, twice over: its tenant names fit in the policy's 1 MiB, and
# with at most 25,000 tenants (the loader's node limit) the rest is under 1 MiB. The bound
# keeps what a corrupt or hostile file costs at start to a few seconds and ~100 MB.
MAX_BYTES = 4 << 20
# Decayed core-seconds: a million cores busy for a thousand years is 3e16. A larger value is
# corruption, and near the float limit the fair-share sums would overflow to inf.
MAX_USAGE = 1e18


CapName = Literal["cpus", "memory", "pids"]
"""A job's caps by its record's names: cpu.max in cores, memory.max in bytes, pids.max."""


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job as the state file keeps it: the file's own type, not an API body or the job
    itself (nodeagent.jobs.Job converts to and from it at dump and load), so that either
    may change without changing what an earlier agent wrote. Its fields are checked by the
    rules the API checks a request with (nodeagent.api.bodies), strictly (no coercion: "1"
    is no number), so that what the API refuses never comes back through a restart; a
    field added later has a default, so a file from before it loads."""

    __pydantic_config__ = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: Annotated[Name, Strict()]
    cgroup: Annotated[CgroupPath, Strict()]
    tenant: Annotated[Text, Strict()]
    workload_class: WorkloadClass
    uid: Annotated[Uid, Strict()]
    pid: Annotated[Pid, Strict()]
    submitted_at: Annotated[Instant, Strict()]
    deadline: Annotated[Instant, Strict()] | None = None
    work: Annotated[Work, Strict()] | None = None
    cpus: Annotated[Cpus, Strict()] | None = None
    memory: Annotated[Memory, Strict()] | None = None
    gpus: Annotated[tuple[Annotated[Text, Strict()], ...], Field(max_length=64)] = ()
    gpu_hold: Annotated[Token, Strict()] | None = None
    """The id of its GPU hold (absent in files from before holds had ids)."""
    pinned_cpus: Annotated[
        tuple[Annotated[int, Strict(), Field(ge=0, lt=1 << 16)], ...],
        Field(max_length=1 << 16),
    ] = ()
    pids: Annotated[Pids, Strict()] | None = None
    limits_from: Mapping[CapName, Annotated[Text, Strict()]] = field(default_factory=dict)
    """Where each cap came from, by name."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["workload_class"] = str(self.workload_class)
        data["gpus"] = list(self.gpus)
        data["pinned_cpus"] = list(self.pinned_cpus)
        data["limits_from"] = dict(self.limits_from)
        return data

    @classmethod
    def from_json(cls, data: object) -> JobRecord:
        """A record as the file holds it, checked field by field: ValidationError (one line
        through nodeagent.api.bodies.problem) if it is malformed."""
        return _JOB_RECORD.validate_python(data)


_JOB_RECORD = TypeAdapter(JobRecord)


@dataclass(frozen=True, slots=True)
class SavedState:
    saved_at: float
    tenant_usage: Mapping[str, float]
    jobs: Sequence[Any] = ()
    """Job records as JSON (JobRecord.to_json); checked one by one when restored
    (JobRecord.from_json), so that a bad one costs only itself."""
    carry: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Each policy's state for its next tick."""
    gpus: Sequence[Any] = ()
    """GPU holds of jobs and reservations (nodeagent.gpualloc.ledger.HoldRecord); checked one by
    one when restored."""
    gpu_history: Mapping[str, Any] = field(default_factory=dict)
    """Per class, how long its last jobs held their GPUs; checked when restored."""
    originals: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """What the agent changed, and the value before (nodeagent.originals), for release."""


def _usable_usage(value: float) -> bool:
    return 0 <= value <= MAX_USAGE


def save(path: str, state: SavedState) -> None:
    """Refuses what load would reject, so a bad value never replaces a good file."""
    if not all(_usable_usage(v) for v in state.tenant_usage.values()):
        raise NodeagentError(
            f"refusing to save {path}: usage must be a number from 0 to {MAX_USAGE:g}"
        )
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o750, exist_ok=True)
    body = _body(state)
    if len(body) > MAX_BYTES and state.originals:
        # what release would hand back is the least of it: the jobs, the holds and the usage
        # must not be lost with it (a node with many thousands of changed cgroups)
        records = sum(len(attrs) for attrs in state.originals.values())
        log.warning(
            "state.originals_dropped",
            file=path,
            records=records,
            why=f"the state would be larger than {MAX_BYTES >> 20} MiB",
            action="release will not hand back what this agent changed before now",
        )
        body = _body(replace(state, originals={}))
    if len(body) > MAX_BYTES:
        raise NodeagentError(f"refusing to save {path}: larger than {MAX_BYTES >> 20} MiB")
    write_atomically(path, body, prefix=".state-")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(journal_path(path))  # a crash before this replays lines the file holds


def keep_aside(path: str, now: float) -> list[str]:
    """Move a state file the agent cannot use (another version's, or damaged), and its
    journal, out of the way under new names, so that this agent's first save does not
    replace what they record: the jobs, the holds, and what `nodeagent release` would hand
    back, for the version that wrote them. The new names; a move that fails raises."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    kept = []
    for old in (path, journal_path(path)):
        new = f"{old}.unusable-{stamp}"
        try:
            os.rename(old, new)
        except (FileNotFoundError, NotADirectoryError):
            continue  # nothing there to keep
        except OSError as e:
            raise NodeagentError(f"cannot move {old} aside to {new}: {e.strerror}") from e
        kept.append(new)
    return kept


def journal_path(path: str) -> str:
    """The journal of originals noted since the state file at `path` was last saved."""
    return path + ".originals"


def append_originals(path: str, records: Sequence[tuple[str, str, Mapping[str, str]]]) -> None:
    """Append (cgroup, attribute, original) records to the journal of the state file at
    `path`, fsynced (and its directory, when this creates it). Raises OSError."""
    if not records:
        return
    journal = journal_path(path)
    lines = "".join(
        json.dumps({"cgroup": c, "attribute": a, **o}, sort_keys=True) + "\n" for c, a, o in records
    ).encode()
    created = not os.path.exists(journal)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(journal, flags, 0o600)
    try:
        view = memoryview(lines)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        dir_fd = os.open(os.path.dirname(os.path.abspath(journal)), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _journal(path: str) -> dict[str, dict[str, Any]]:
    """The journal's records as the state file's `originals` object. A torn last line (a
    crash mid-append) or any other bad line is dropped with a warning, one by one; an
    unreadable journal costs only itself."""
    journal = journal_path(path)
    try:
        raw = read_regular_file(journal, MAX_BYTES)
    except FileNotFoundError:
        return {}
    except (OSError, UnusableFile) as e:
        log.warning("state.journal_unreadable", file=journal, error=str(e)[:200])
        return {}
    out: dict[str, dict[str, Any]] = {}
    for number, line in enumerate(raw[:MAX_BYTES].splitlines(), 1):
        try:
            record = json.loads(line.decode("utf-8"))
            cgroup, attribute = record.pop("cgroup"), record.pop("attribute")
            if not isinstance(cgroup, str) or not isinstance(attribute, str):
                raise ValueError("cgroup and attribute must be strings")
        except (UnicodeDecodeError, ValueError, RecursionError, KeyError, AttributeError) as e:
            log.warning("state.journal_line_dropped", file=journal, line=number, error=str(e)[:200])
            continue
        out.setdefault(cgroup, {}).setdefault(attribute, record)  # the first change holds
    return out


def _with_journal(
    path: str, originals: Mapping[str, Mapping[str, Any]]
) -> dict[str, Mapping[str, Any]]:
    """The file's originals with the journal's added where the file has none (the file's
    are never older: a save removes the journal)."""
    merged: dict[str, Mapping[str, Any]] = dict(originals)
    for cgroup, attrs in _journal(path).items():
        known = merged.get(cgroup)
        merged[cgroup] = {**attrs, **known} if isinstance(known, Mapping) else attrs
    return merged


def _body(state: SavedState) -> str:
    return json.dumps(
        {
            "version": VERSION,
            "saved_at": state.saved_at,
            "tenant_usage": dict(state.tenant_usage),
            "jobs": list(state.jobs),
            "carry": dict(state.carry),
            "gpus": list(state.gpus),
            "gpu_history": dict(state.gpu_history),
            "originals": dict(state.originals),
        },
        sort_keys=True,
        allow_nan=False,
    )


def _number(value: object, what: str) -> float:
    """A JSON number as a float; bool is an int in Python, but not a number here."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what[:60]} must be a number, got {type(value).__name__}")
    return float(value)


def _parse_int(digits: str) -> int | float:
    """A long JSON integer as a float: 5000 digits would hit Python's int digit limit, and
    a 309-digit int would overflow float() later; as a float it is inf, refused below."""
    return int(digits) if len(digits) <= 20 else float(digits)


def load(path: str, tenants: Collection[str] | None = None) -> SavedState | None:
    """The saved state, None when there is none yet; a one-line error when it is unusable.

    Whatever the file holds, only NodeagentError comes out. With `tenants`, the usage of any
    other tenant (one removed from the policy) is dropped.
    """
    try:
        raw = read_regular_file(path, MAX_BYTES)
    except FileNotFoundError:
        journal = _journal(path)  # an agent that crashed before its first save
        return SavedState(time.time(), {}, originals=journal) if journal else None
    except (OSError, UnusableFile) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise NodeagentError(f"state file {path} is unreadable: {why}") from e
    if len(raw) > MAX_BYTES:
        raise NodeagentError(f"state file {path} is unreadable: larger than {MAX_BYTES >> 20} MiB")
    try:
        data = json.loads(raw.decode("utf-8"), parse_int=_parse_int)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise NodeagentError(f"state file {path} is unreadable: {why}") from e
    try:
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        version = data.get("version")
        if type(version) is not int or version != VERSION:
            raise ValueError(f"version {version!r} is not {VERSION}")
        saved_at = _number(data["saved_at"], "saved_at")
        if not math.isfinite(saved_at):
            raise ValueError("saved_at must be finite")
        entries = data["tenant_usage"]
        if not isinstance(entries, dict):
            raise ValueError("tenant_usage must be an object")
        usage = {
            name: _number(value, f"usage of tenant {name!r}")
            for name, value in entries.items()
            if tenants is None or name in tenants
        }
        if not all(_usable_usage(v) for v in usage.values()):
            raise ValueError(f"usage must be finite, non-negative and at most {MAX_USAGE:g}")
        # each job and hold is checked on its own when restored: a bad one costs only itself
        jobs = data.get("jobs", [])  # absent in files written before jobs existed
        if not isinstance(jobs, list):
            raise ValueError("jobs must be a list")
        carry = data.get("carry", {})
        if not isinstance(carry, dict) or not all(isinstance(c, dict) for c in carry.values()):
            raise ValueError("carry must be an object of objects")
        gpus = data.get("gpus", [])
        if not isinstance(gpus, list):
            raise ValueError("gpus must be a list")
        history = data.get("gpu_history", {})  # absent in files written before it
        if not isinstance(history, dict):
            raise ValueError("gpu_history must be an object")
        originals = data.get("originals", {})  # absent in files written before release
        if not isinstance(originals, dict):
            raise ValueError("originals must be an object")
        originals = _with_journal(path, originals)
        return SavedState(saved_at, usage, tuple(jobs), carry, tuple(gpus), history, originals)
    except (KeyError, ValueError) as e:
        raise NodeagentError(f"state file {path} is malformed: {e}") from e
