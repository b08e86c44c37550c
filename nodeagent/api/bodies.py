"""The API's request bodies as small strict models, and the rules their fields share with the
records in the state file: one place says what a job name, a number of CPUs or a deadline
may be, so that what the API refuses can never come back through a restart.

Every model is strict (no coercion: `"1"` is not a number, `true` is not 1), finite (no
NaN or infinity) and closed (an unknown key is refused). A bad body is one 400 whose
message names the field: `parse` turns pydantic's error into that one line.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from nodeagent.cgroupfs.paths import split_path
from nodeagent.errors import BadRequest, UnsafePath
from nodeagent.policyfile.model import WorkloadClass

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@+-]{0,62}")
"""A job name is its cgroup's name: one path component, no '/', not '.', at most 63. GPU
reservations and requests are named by the same rule."""
_RESERVED_SUFFIXES = (".slice", ".scope", ".service", ".mount", ".socket")
_CONTROLLER_FILE = re.compile(
    r"(?:cgroup|cpu|cpuacct|cpuset|io|blkio|memory|pids|rdma|hugetlb|misc|irq|perf_event"
    r"|freezer|devices|net_cls|net_prio|dmem)\..*",
    re.DOTALL,
)
"""A name that is, or may one day be, a cgroup interface file (io.max before the io
controller is enabled): a directory of that name would block the controller's files."""

MIN_MEMORY = 1 << 20
MAX_MEMORY = 2**63 - 1  # the kernel's page counter limit, as spec.units.MAX_SIZE
MAX_CPUS = 100_000.0
MAX_WORK = 1e12
"""CPU-seconds: a thousand cores busy for thirty years."""
MAX_INSTANT = 253_402_300_800.0
"""Unix seconds at 10000-01-01: a later deadline is a unit mistake, not a plan."""
PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT
UID_MAX = 2**32 - 2  # (uid_t)-1 is "no uid"
MAX_GPUS = 64
MAX_GPU_MEMORY = 1 << 50
MAX_TTL = 7 * 86400.0
MAX_TEXT = 253
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CONTAINER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@:+-]{0,252}")
_MIG = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+-]{0,31}")


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a job (or a GPU hold); None when it can."""
    if (
        not NAME.fullmatch(name)
        or name.endswith(_RESERVED_SUFFIXES)
        or _CONTROLLER_FILE.fullmatch(name)
    ):
        shown = repr(name) if len(name) <= 80 else repr(name[:80]) + f"... ({len(name)} chars)"
        return (
            f"{shown} is not a safe cgroup name: use 1 to 63 letters, digits and"
            " '_.@+-', starting with a letter or digit, not ending in a systemd unit suffix"
            " and not named like a cgroup interface file (cpu.*, io.*, memory.*, ...)"
        )
    return None


def check_name(name: str) -> str:
    """The name, or BadRequest with the one-line reason it cannot name a cgroup."""
    problem = name_problem(name)
    if problem is not None:
        raise BadRequest(f"job name {problem}")
    return name


def _name(value: str) -> str:
    problem = name_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _cgroup_path(value: str) -> str:
    try:
        split_path(value)
    except UnsafePath as e:
        raise ValueError(str(e)) from None
    if not value:
        raise ValueError("must name a cgroup below the root")
    return value


def _matching(pattern: re.Pattern[str], what: str) -> Any:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            shown = repr(value) if len(value) <= 40 else repr(value[:40]) + "..."
            raise ValueError(f"must be {what}, got {shown}")
        return value

    return AfterValidator(check)


Name = Annotated[str, AfterValidator(_name)]
Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]
Token = Annotated[str, _matching(_TOKEN, "an id the daemon gave (letters, digits, '_', '-')")]
Container = Annotated[
    str,
    _matching(_CONTAINER, "a container id or a workload name, such as 4f1c2a9be7d3"),
]
CgroupPath = Annotated[str, Field(max_length=4096), AfterValidator(_cgroup_path)]
MigProfile = Annotated[str, _matching(_MIG, "a MIG profile name such as 1g.10gb")]
Cpus = Annotated[float, Field(gt=0, le=MAX_CPUS)]
Memory = Annotated[int, Field(ge=MIN_MEMORY, le=MAX_MEMORY)]
Instant = Annotated[float, Field(gt=0, lt=MAX_INSTANT)]
Work = Annotated[float, Field(gt=0, le=MAX_WORK)]
Pid = Annotated[int, Field(ge=2, le=PID_MAX)]
Pids = Annotated[int, Field(ge=1, le=PID_MAX)]
"""A pids.max: at least the job's own process, at most the kernel's PID_MAX_LIMIT."""
Uid = Annotated[int, Field(ge=0, le=UID_MAX)]
GpuCount = Annotated[int, Field(ge=1, le=MAX_GPUS)]
GpuMemory = Annotated[int, Field(ge=1, le=MAX_GPU_MEMORY)]


class Body(BaseModel):
    """A request body or a state-file record: strict, finite, closed, frozen."""

    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, frozen=True, populate_by_name=True
    )


def _class(value: object) -> object:
    if isinstance(value, str) and value not in set(WorkloadClass):
        names = ", ".join(c.value for c in WorkloadClass)
        shown = repr(value) if len(value) <= 40 else repr(value[:40]) + "..."
        raise ValueError(f"unknown class {shown} (classes: {names})")
    return value


class Classed(Body):
    """A body that names a tenant and a class (both default from the policy)."""

    tenant: Text | None = None
    workload_class: (
        Annotated[WorkloadClass, Field(strict=False), BeforeValidator(_class)] | None
    ) = Field(None, alias="class")


M = TypeVar("M", bound=BaseModel)


_PLAIN = {
    "string_type": "must be a string",
    "int_type": "must be a whole number",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "list_type": "must be a list",
    "model_type": "must be an object",
    "dict_type": "must be an object",
}
_BOUNDS = {
    "greater_than": ("gt", "must be above"),
    "greater_than_equal": ("ge", "must be at least"),
    "less_than": ("lt", "must be below"),
    "less_than_equal": ("le", "must be at most"),
    "too_long": ("max_length", "must have at most this many items:"),
    "string_too_long": ("max_length", "must have at most this many characters:"),
    "too_short": ("min_length", "must have at least this many items:"),
    "string_too_short": ("min_length", "must have at least this many characters:"),
}


def problem(error: ValidationError) -> str:
    """pydantic's first error as one line: the field, what it must be, what it got."""
    first = error.errors(include_url=False)[0]
    field = ".".join(str(p) for p in first["loc"]) or "the body"
    kind, ctx = first["type"], first.get("ctx", {})
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):  # a model's, a dataclass's
        return f"unknown field {field!r}"
    if kind == "missing":
        return f"{field} is required"
    if kind in _PLAIN:
        message = _PLAIN[kind]
    elif kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        bound = ctx.get(key)
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        message = f"{words} {bound}"
    elif kind == "value_error":  # our validators' own words, which say what they got
        return " ".join(f"{field}: {ctx.get('error', first['msg'])}".split())
    else:
        message = first["msg"].replace("Input should be", "must be")
    shown = repr(first.get("input"))
    if len(shown) > 40:
        shown = shown[:40] + f"... ({len(shown)} characters)"
    return " ".join(f"{field}: {message}, got {shown}".split())


def parse(model: type[M], body: object) -> M:
    """The body as `model`, or BadRequest naming the first problem in one line."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise BadRequest(problem(e)) from None


def when(t: float) -> str:
    """A Unix time as operators read it (UTC, to the second)."""
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_future(deadline: float | None, now: float) -> None:
    """A deadline that has passed is refused, saying when it was (an Instant is in range)."""
    if deadline is not None and deadline <= now:
        raise BadRequest(f"the deadline {when(deadline)} has passed (now {when(now)})")
