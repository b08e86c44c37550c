"""Load the operator's policy YAML, or explain every problem in it as FILE:LINE:COL: message.

The YAML is composed into nodes first (SafeLoader only), so that each pydantic error
location and each semantic check can be traced back to the line and column that caused it.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import os
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass

import annotated_types
import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from nodeagent.cgroupfs.paths import split_path
from nodeagent.cgroupfs.values import PIDS_MAX_LIMIT, QUOTA_MAX_US, QUOTA_MIN_US
from nodeagent.errors import UnsafePath
from nodeagent.identity import Owner, Runtime
from nodeagent.policyfile.glob import glob_matches
from nodeagent.policyfile.model import (
    ANY,
    MAX,
    AgentMode,
    DeadlineGrant,
    Limits,
    Match,
    PerUserLimits,
    PolicySpec,
    Rule,
    WorkloadClass,
)
from nodeagent.policyfile.nesting import nesting_warnings
from nodeagent.policyfile.yamlfile import (
    MAX_SHOWN,
    Loc,
    Locator,
    PolicyError,
    Problem,
    Report,
    compose_and_construct,
    dotted,
    read_text,
)

JOB_PERIOD_US = Limits().cpu_period_us
"""The cpu.max period of a job's cap (its Limits give none other)."""
MIN_MEMORY = 1 << 20  # a smaller memory limit is a unit mistake (512 meant as 512Mi), not a policy
# Trees that systemd or a container runtime owns: nodeagent's subtree must not be inside one,
# unless it is below a service of its own (Delegate=yes).
_OTHERS_TREES = frozenset(
    {
        "system.slice",
        "user.slice",
        "machine.slice",
        "init.scope",
        "kubepods",
        "kubepods.slice",
        "docker",
        "libpod_parent",
    }
)
# "Did you mean" compares a name with every candidate: it is offered for this many names at
# most, among at most this many candidates, so that a hostile file costs no quadratic time.
MAX_SUGGESTIONS = MAX_SHOWN
MAX_CANDIDATES = 1000
EXAMPLE = "config/policy.yaml"


@dataclass(frozen=True)
class Checked:
    """A policy that can be used, and what is questionable in it (`validate` shows both)."""

    spec: PolicySpec
    warnings: tuple[Problem, ...]


def digest(spec: PolicySpec) -> str:
    """The policy's sha256, over what it says (its fields, defaults included), not how the
    file says it: comments and layout do not count. `nodeagent validate --json` prints it
    for a file, the agent's status and metrics for the policy in force, so that a fleet can
    see which nodes run which policy (a canary pool's, the old one)."""
    return hashlib.sha256(spec.model_dump_json(by_alias=True).encode()).hexdigest()


def load_policy(path: str | os.PathLike[str]) -> PolicySpec:
    """Read and parse the policy file at `path`."""
    return check_policy(path).spec


def check_policy(path: str | os.PathLike[str]) -> Checked:
    """Read and parse the policy file at `path`, with its warnings."""
    return check_text(read_text(path, "a policy"), os.fspath(path))


def check_text(text: str, filename: str) -> Checked:
    """Parse policy YAML held in memory and find every problem in one pass: when fields
    have type errors, the checks across fields still run on every field that is valid
    alone, so that fixing the file never takes a second round; `filename` names it."""
    report = Report(filename)
    where, data = compose_and_construct(text, report)
    if where is None or data is None:
        report.add(None, f"the policy is empty; see {EXAMPLE} for an example")
        raise PolicyError(report.problems)
    if not isinstance(data, dict):
        report.add(
            where.root.start_mark,
            "the policy must be a mapping with keys such as version, tenants and rules, "
            f"got {_describe(data)}",
        )
        raise PolicyError(report.problems)
    try:
        spec = PolicySpec.model_validate(data)
    except ValidationError as e:
        for error in e.errors(include_url=False):
            explained = _explain(where, error)
            if explained is not None:
                report.add(*explained)
        partial = _partial(PolicySpec, data)
        with _SKIP_BROKEN:  # a check that reads a broken field without a guard of its own
            _check_semantics(partial, where, report)
        raise PolicyError(report.sorted(), _warnings(partial, where, filename)) from None
    _check_semantics(spec, where, report)
    warnings = _warnings(spec, where, filename)
    if not report.problems:  # rules are only tried on sample cgroups in a valid policy
        found = (*warnings, *_nesting_warnings(spec, where, filename))
        warnings = tuple(sorted(found, key=lambda p: (p.line, p.col)))
    if report.problems:
        raise PolicyError(report.sorted(), warnings)
    return Checked(spec, warnings)


def _nesting_warnings(spec: PolicySpec, where: Locator, filename: str) -> list[Problem]:
    """Rules that can claim a cgroup and one below it (see spec.nesting), at their match."""
    out = []
    for i, message in nesting_warnings(spec):
        mark = where.mark(("rules", i, "match"))
        where_ = dotted(("rules", i, "match"))
        out.append(
            Problem(filename, mark.line + 1, mark.column + 1, f"{where_}: {message}", "warning")
        )
    return out


def _describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The schema model that validates the mapping at `loc`, for key suggestions."""
    tp: object = PolicySpec
    for item in loc:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            fields = tp.model_fields.items()
            tp = next((f.annotation for n, f in fields if item in (n, f.alias)), None)
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif typing.get_origin(tp) in (tuple, list):
            tp = typing.get_args(tp)[0]
        else:
            return None
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


_PLAIN = {
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
    "tuple_type": "must be a list",
    "list_type": "must be a list",
    "string_type": "must be a string",
    "int_type": "must be a whole number",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
}


def _explain(where: Locator, error: ErrorDetails) -> tuple[yaml.Mark, str] | None:
    """Where a pydantic error points in the YAML, and what to tell the operator; None when
    the problem is a key that is not a string, which is reported already."""
    loc, kind, ctx = error["loc"], error["type"], error.get("ctx", {})
    place = where.find(loc)
    # Items past the nodes found are union member labels such as "literal['max']".
    path = dotted(place.path)
    if kind == "missing" and place.found == len(loc) - 1:
        return place.node.start_mark, f"missing required key {loc[-1]!r}" + (
            f" in {path}" if path else ""
        )
    if kind == "extra_forbidden" and place.key is not None:
        if place.bad_key:
            return None
        parent, name = _model_at(loc[:-1]), str(loc[-1])
        fields = parent.model_fields.items() if parent else ()
        names = [n for field_name, f in fields for n in (field_name, f.alias) if n]
        inside = dotted(place.path[:-1])
        message = f"unknown key {name!r}" + (f" in {inside}" if inside else "")
        return place.key.start_mark, message + _did_you_mean(name, names)
    value = error["input"]
    if kind == "value_error":
        message = str(ctx.get("error", error["msg"]))
    elif kind in ("enum", "literal_error"):
        expected = str(ctx.get("expected", ""))
        message = f"must be {expected}, got {_describe(value)}"
        if isinstance(value, str):
            message += _did_you_mean(value, re.findall(r"'([^']*)'", expected))
    elif kind in ("too_short", "string_too_short") and ctx.get("min_length") == 1:
        message = "must not be empty"
    else:
        plain = _PLAIN.get(kind) or error["msg"].replace("Input should be", "must be")
        message = f"{plain}, got {_describe(value)}"
    return place.node.start_mark, f"{path}: {message}" if path else message


def _is_relative_path(path: str) -> bool:
    try:
        return bool(split_path(path))
    except UnsafePath:
        return False


class _Suggestions:
    """'Did you mean' among `choices`, for the first MAX_SUGGESTIONS distinct words asked
    about, and only among at most MAX_CANDIDATES choices: each costs a pass over them all."""

    def __init__(self, choices: list[str]) -> None:
        self.choices = choices if len(choices) <= MAX_CANDIDATES else []
        self.given: dict[str, str] = {}

    def __call__(self, word: str) -> str:
        if word not in self.given and len(self.given) < MAX_SUGGESTIONS:
            self.given[word] = _did_you_mean(word, self.choices)
        return self.given.get(word, "")


def _listed(names: list[str], most: int = 10) -> str:
    shown = ", ".join(map(repr, names[:most]))
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class _BrokenInput(BaseException):
    """A check read a field that failed validation: that check is skipped. A BaseException,
    so that no `except Exception` on the way swallows it into a wrong answer."""


class _Broken:
    """Stands for a field that failed validation in a partial spec (see `_partial`): any use
    of it but `is` and isinstance raises _BrokenInput."""

    def _refuse(self, *_: object) -> typing.NoReturn:
        raise _BrokenInput

    __getattr__ = _refuse

    def __repr__(self) -> str:
        return "<broken>"


# what a check may do with a value: compare, hash, test, count, iterate, format, compute
_REFUSED = "eq ne lt le gt ge hash bool len iter contains getitem str format"
_ARITHMETIC = "add radd sub rsub mul rmul truediv rtruediv floordiv mod rmod neg float int index"
for _dunder in f"{_REFUSED} {_ARITHMETIC}".split():
    setattr(_Broken, f"__{_dunder}__", _Broken._refuse)

BROKEN: typing.Any = _Broken()
_SKIP_BROKEN = contextlib.suppress(_BrokenInput)
"""Around each check: on a partial spec, the check that reads a broken field is skipped."""


def _partial(model: type[BaseModel], data: object) -> typing.Any:
    """`data` as `model`, built field by field without validating the whole: a field that
    validates alone keeps its value, one that does not (or a required one missing) is
    BROKEN; nested models, and lists and mappings of them, are built the same way, so one
    bad rule or limit leaves every other field to the checks across fields."""
    if not isinstance(data, dict):
        return BROKEN
    values: dict[str, typing.Any] = {}
    for name, info in model.model_fields.items():
        key = next((k for k in (info.alias, name) if k is not None and k in data), None)
        if key is not None:
            values[name] = _partial_field(model, name, data[key])
        elif info.is_required():
            values[name] = BROKEN
        else:
            values[name] = info.get_default(call_default_factory=True)
    return model.model_construct(**values)


def _partial_field(model: type[BaseModel], name: str, raw: object) -> object:
    info = model.model_fields[name]
    tp, args = info.annotation, typing.get_args(info.annotation)
    # without validators of its own (constraints such as a minimum length are checked
    # already), a model, or a list or mapping of them, is built part by part
    if all(isinstance(m, annotated_types.BaseMetadata) for m in info.metadata):
        if _is_model(tp):
            return _partial(typing.cast(type[BaseModel], tp), raw)
        if typing.get_origin(tp) is tuple and args and _is_model(args[0]):
            if not isinstance(raw, list):
                return BROKEN
            return tuple(_partial(args[0], item) for item in raw)
        if typing.get_origin(tp) is dict and _is_model(args[1]) and isinstance(raw, dict):
            return {key: _partial(args[1], value) for key, value in raw.items()}
    try:
        return _field_adapter(model, name).validate_python(raw)
    except ValidationError:
        return BROKEN


def _is_model(tp: object) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


@functools.cache
def _field_adapter(model: type[BaseModel], name: str) -> TypeAdapter[typing.Any]:
    """Validates one field of `model` alone, with its validators, constraints and config."""
    info = model.model_fields[name]
    tp: typing.Any = info.annotation
    if info.metadata:
        tp = typing.Annotated[(tp, *info.metadata)]
    return TypeAdapter(tp, config=None if _is_model(tp) else model.model_config)


def _check_semantics(spec: PolicySpec, where: Locator, report: Report) -> None:
    """What the schema cannot say alone: cross references, uniqueness and safe paths.

    `spec` may be partial (some fields BROKEN, see `_partial`): each check stands in a
    `with _SKIP_BROKEN:` of its own, so that only the checks whose inputs are broken are
    skipped."""

    def add(loc: Loc, message: str) -> None:
        report.add(where.mark(loc), f"{dotted(loc)}: {message}")

    def line_of(loc: Loc) -> int:
        return where.mark(loc).line + 1

    with _SKIP_BROKEN:
        managed = spec.agent.managed_root
        if not _is_relative_path(managed):
            add(
                ("agent", "managed_root"),
                "must be a path relative to the cgroup root, such as nodeagent.slice, without "
                f"'..' or empty parts, got {managed!r}",
            )
        parts = managed.split("/")
        if parts[0] in _OTHERS_TREES and not any(p.endswith(".service") for p in parts[:-1]):
            add(
                ("agent", "managed_root"),
                f"{managed!r} is inside {parts[0]}, which systemd or a container runtime owns;"
                " use nodeagent.slice, or a path below nodeagent's own service cgroup with"
                " Delegate=yes, such as system.slice/nodeagent.service/workloads",
            )
    with _SKIP_BROKEN:
        if spec.agent.state_file == spec.agent.socket:
            add(("agent", "socket"), "must not be the same path as agent.state_file")
    tenants: list[str] = []
    with _SKIP_BROKEN:
        tenants = [t for t in spec.tenants if t not in where.markers]
    suggest = _Suggestions(tenants)
    first_rule: dict[str, int] = {}
    for i, rule in enumerate(_items(spec.rules)):
        with _SKIP_BROKEN:
            if rule.name in first_rule:
                first = line_of(("rules", first_rule[rule.name], "name"))
                add(
                    ("rules", i, "name"),
                    f"duplicate rule name {rule.name!r} (first at line {first})",
                )
            first_rule.setdefault(rule.name, i)
        with _SKIP_BROKEN:
            if rule.tenant not in spec.tenants:
                hint = suggest(rule.tenant) or f"; tenants are {_listed(tenants)}"
                add(("rules", i, "tenant"), f"unknown tenant {rule.tenant!r}{hint}")
        with _SKIP_BROKEN:
            _check_rule(
                rule, i, spec, lambda t: suggest(t) or f"; tenants are {_listed(tenants)}", add
            )
        with _SKIP_BROKEN:
            _check_limits(rule.limits, ("rules", i, "limits"), add, rule.match)
    with _SKIP_BROKEN:
        default = spec.jobs.default_tenant
        if default is not None and default not in spec.tenants:
            hint = suggest(default) or f"; tenants are {_listed(tenants)}"
            add(("jobs", "default_tenant"), f"unknown tenant {default!r}{hint}")
    for i, entry in enumerate(_items(spec.jobs.access)):
        with _SKIP_BROKEN:
            if not entry.users and not entry.groups:
                add(("jobs", "access", i), "an entry needs users or groups: whom it lets in")
        for j, tenant in enumerate(_items(entry.tenants)):
            with _SKIP_BROKEN:
                if tenant != ANY and tenant not in spec.tenants:
                    hint = suggest(tenant) or f"; tenants are {_listed(tenants)} (or '*')"
                    add(("jobs", "access", i, "tenants", j), f"unknown tenant {tenant!r}{hint}")
    with _SKIP_BROKEN:
        _check_caps(spec.jobs.per_user_limits, JOB_PERIOD_US, ("jobs", "per_user_limits"), add)
    _check_power(spec, add)
    with _SKIP_BROKEN:
        _check_kubernetes(spec, add, suggest, tenants)


def _check_power(spec: PolicySpec, add: typing.Callable[[Loc, str], None]) -> None:
    for i, power in enumerate(_items(spec.gpu.power)):
        with _SKIP_BROKEN:
            if (power.start is None) != (power.end is None):
                have = "from" if power.end is None else "to"
                add(
                    ("gpu", "power", i, have),
                    "a window needs both from and to (local times such as '22:00'),"
                    f" got only {have}",
                )


def _check_rule(
    rule: Rule,
    i: int,
    spec: PolicySpec,
    hint: typing.Callable[[str], str],
    add: typing.Callable[[Loc, str], None],
) -> None:
    """A deadline needs its work; tenant_from and class_from list what they may give, and
    tenant_from only tenants of the policy; a rule's own deadline leaves the annotations
    unread."""
    at = ("rules", i)
    with _SKIP_BROKEN:
        if (rule.deadline is None) != (rule.work is None):
            have, lacks = ("deadline", "work") if rule.work is None else ("work", "deadline")
            add(
                ("rules", i, have),
                f"{have} needs {lacks}: the deadline policy plans the CPU rate from both",
            )
    for key in ("tenant_from", "class_from"):
        with _SKIP_BROKEN:
            source = getattr(rule, key)
            if source is not None and not source.allowed and not source.kubernetes:
                what = "tenants" if key == "tenant_from" else "classes"
                add((*at, key), f"needs allowed: the {what} this rule may give (at least one)")
    with _SKIP_BROKEN:
        if rule.tenant_from is not None:
            for j, tenant in enumerate(_items(rule.tenant_from.allowed)):
                if tenant not in spec.tenants:
                    where = ("rules", i, "tenant_from", "allowed", j)
                    add(where, f"unknown tenant {tenant!r}{hint(tenant)}")
    with _SKIP_BROKEN:
        if rule.deadline_from_annotations and rule.deadline is not None:
            add(
                ("rules", i, "deadline_from_annotations"),
                "the rule gives a deadline itself: annotations would never be read",
            )


def _claims_slurm_jobs(match: Match) -> bool:
    """A rule meant for Slurm's jobs: by runtime, owner or account."""
    return match.runtime is Runtime.SLURM or match.owner is Owner.SLURM or match.account is not None


def _check_limits(
    limits: Limits, at: Loc, add: typing.Callable[[Loc, str], None], match: Match
) -> None:
    """A rule's limits: none for Slurm's jobs, memory.high not above memory.max, and caps
    the kernel takes (`_check_caps`)."""
    with _SKIP_BROKEN:
        if _claims_slurm_jobs(match) and limits != Limits():
            add(
                at,
                "Slurm's jobs take no limits from nodeagent: slurmd sets their cpu.max,"
                " memory and cpuset; nodeagent writes at most their cpu.weight"
                " (agent.slurm.cpu_weight: write)",
            )
    with _SKIP_BROKEN:
        high, cap = limits.memory_high, limits.memory_max
        if isinstance(cap, int) and (high == MAX or (isinstance(high, int) and high > cap)):
            add(
                (*at, "memory_high"),
                f"memory_high ({high if high == MAX else f'{high} bytes'}) is above"
                f" memory_max ({cap} bytes)",
            )
    with _SKIP_BROKEN:
        _check_caps(limits, limits.cpu_period_us, at, add)


def _check_caps(
    caps: Limits | PerUserLimits, period_us: int, at: Loc, add: typing.Callable[[Loc, str], None]
) -> None:
    """Caps the kernel takes, a rule's or `jobs.per_user_limits`: sizes of at least 1Mi, a
    CPU quota within the kernel's bounds at `period_us`, pids from 1 to PID_MAX_LIMIT."""
    for key in ("memory_max", "memory_high"):
        with _SKIP_BROKEN:
            size = getattr(caps, key, None)
            if isinstance(size, int) and size < MIN_MEMORY:
                add(
                    (*at, key),
                    f"{size} bytes is below 1Mi; sizes are bytes unless they have a unit,"
                    " such as 512Mi",
                )
    with _SKIP_BROKEN:
        if isinstance(caps.cpu_max, float):
            quota = caps.cpu_max * period_us
            if quota < QUOTA_MIN_US:
                add(
                    (*at, "cpu_max"),
                    f"{caps.cpu_max} cores is less than the kernel's minimum quota of "
                    f"{QUOTA_MIN_US}us per {period_us}us period",
                )
            elif quota > QUOTA_MAX_US:
                add(
                    (*at, "cpu_max"),
                    f"{caps.cpu_max} cores is more than the kernel's maximum quota of "
                    f"{QUOTA_MAX_US}us per period",
                )
    with _SKIP_BROKEN:
        pids = caps.pids_max
        if pids is not None and not 1 <= pids <= PIDS_MAX_LIMIT:
            add(
                (*at, "pids_max"),
                f"{pids} is outside 1..{PIDS_MAX_LIMIT}: at least the one process a workload"
                " starts with, at most the kernel's PID_MAX_LIMIT",
            )


def _items(values: typing.Any) -> list[typing.Any]:
    """The items of a list field of a partial spec; none when the list itself is broken."""
    with _SKIP_BROKEN:
        return list(values)
    return []


def _warnings(spec: PolicySpec, where: Locator, filename: str) -> tuple[Problem, ...]:
    """What is valid but almost surely not meant: no rules, and rules that never apply."""
    found: list[Problem] = []

    def warn(loc: Loc, message: str) -> None:
        mark = where.mark(loc)
        found.append(Problem(filename, mark.line + 1, mark.column + 1, message, "warning"))

    rules = _items(spec.rules)
    with _SKIP_BROKEN:
        if not spec.rules:
            warn(
                ("rules",),
                "the policy has no rules: it claims no workload, and manages only the jobs"
                " that `nodeagent exec` starts",
            )
    for j, rule in enumerate(rules):
        with _SKIP_BROKEN:
            account = rule.match.account
            if account is not None and account != account.lower():
                warn(
                    ("rules", j, "match", "account"),
                    f"rules[{j}].match.account: {account!r} never matches: Slurm records"
                    " accounts in lower case (sbatch --account=A runs under 'a');"
                    f" write {account.lower()!r}",
                )
    for j, rule in enumerate(rules):
        with _SKIP_BROKEN:
            may = _classes_given(rule)
            refused = all(spec.classes[c].declared_deadlines is DeadlineGrant.REFUSED for c in may)
            if rule.deadline_from_annotations and rule.deadline is None and refused:
                names = ", ".join(str(c) for c in may)
                warn(
                    ("rules", j, "deadline_from_annotations"),
                    f"rules[{j}]: annotations never give a deadline: every class the rule"
                    f" may give ({names}) refuses a deadline a workload declares"
                    " (classes.<class>.declared_deadlines, refused by default); set it to"
                    " scheduled or defended for the class these deadlines are for",
                )
    with _SKIP_BROKEN:
        _kubernetes_warnings(spec, rules, warn)
    for j, later in enumerate(rules):
        for i, earlier in enumerate(rules[:j]):
            with _SKIP_BROKEN:
                if _covers(earlier.match, later.match):
                    what = "every cgroup" if _unset(earlier.match) else "every cgroup it matches"
                    line = where.mark(("rules", i)).line + 1
                    warn(
                        ("rules", j, "match"),
                        f"rules[{j}]: rule {later.name!r} never applies: rule {earlier.name!r}"
                        f" (line {line}) comes first and matches {what} (the first match wins)",
                    )
                    break
    return tuple(found)


def _kubernetes_warnings(
    spec: PolicySpec, rules: list[typing.Any], warn: typing.Callable[[Loc, str], None]
) -> None:
    """In Kubernetes mode: nothing spared as node-critical, and pods that say nothing of
    their class falling to one the protection controller may freeze."""
    if spec.agent.mode is not AgentMode.KUBERNETES:
        return
    critical = spec.kubernetes.node_critical
    if not critical.namespaces and critical.min_priority is None:
        warn(
            ("kubernetes", "node_critical"),
            "kubernetes.node_critical spares no pod: kube-system's (kube-proxy, the CNI, DNS,"
            " the GPU device plugin) may be capped and frozen like any other",
        )
    if not spec.protection.enabled:
        return
    for j, rule in enumerate(rules):
        with _SKIP_BROKEN:
            cls, source = rule.workload_class, rule.class_from
            if source is not None and source.kubernetes and spec.classes[cls].freezable:
                warn(
                    ("rules", j, "class"),
                    f"rules[{j}]: a pod that names no class of its own gets class {cls},"
                    f" which the protection controller may freeze (classes.{cls}.freezable:"
                    " true): give the rule a class that is not freezable, so that only a"
                    " pod that says so (nodeagent.io/class) may be frozen",
                )


_GLOB_SPECIAL = re.compile(r"[*?\[\]]")


def _classes_given(rule: Rule) -> list[WorkloadClass]:
    """The classes a rule may give: its own and its class_from's `allowed` (in Kubernetes
    mode, any: a namespace's entry names its default and what its pods may claim)."""
    if rule.class_from is not None and rule.class_from.kubernetes:
        return list(WorkloadClass)
    allowed = rule.class_from.allowed if rule.class_from is not None else ()
    return [c for c in WorkloadClass if c == rule.workload_class or c in allowed]


def _unset(match: Match) -> bool:
    return all(getattr(match, f) is None for f in Match.model_fields)


def _covers(earlier: Match, later: Match) -> bool:
    """Whether every cgroup `later` matches is matched by `earlier` too: each field
    `earlier` sets, `later` sets to the same value, to a literal the glob matches, or (for
    container_id, a prefix) to a longer id."""
    for name in Match.model_fields:
        want, got = getattr(earlier, name), getattr(later, name)
        if want is None:
            continue
        if got is None:
            return False
        if name in ("path", "name", "account"):
            same = want == got or (not _GLOB_SPECIAL.search(got) and glob_matches(want, got))
        elif name == "container_id":
            same = got.startswith(want)
        else:
            same = want == got
        if not same:
            return False
    return True


def _check_kubernetes(
    spec: PolicySpec,
    add: typing.Callable[[Loc, str], None],
    suggest: _Suggestions,
    tenants: list[str],
) -> None:
    """Namespaces name known tenants; each class source says where it reads from once."""
    kube = spec.kubernetes
    for glob, entry in kube.namespaces.items():
        for key, tenant in (("tenant", entry.tenant), *(("allow", t) for t in entry.allow)):
            if tenant not in spec.tenants:
                hint = suggest(tenant) or f"; tenants are {_listed(tenants)}"
                add(("kubernetes", "namespaces", glob, key), f"unknown tenant {tenant!r}{hint}")
    for i, source in enumerate(kube.class_from):
        given = [k for k in ("annotation", "label", "priority", "qos") if getattr(source, k)]
        if len(given) != 1:
            add(
                ("kubernetes", "class_from", i),
                "give exactly one of annotation, label, priority or qos"
                + (f", got {' and '.join(given)}" if given else ""),
            )
        elif source.values is not None and given[0] not in ("annotation", "label"):
            add(("kubernetes", "class_from", i, "values"), "values go with an annotation or label")
    for key in ("node_features", "node_resource_topology"):
        if getattr(spec.publish, key) and spec.agent.mode is not AgentMode.KUBERNETES:
            add(("publish", key), "publishing to the cluster needs agent.mode: kubernetes")
    if kube.api_server.watch is False and kube.tenant_label is not None:
        add(
            ("kubernetes", "tenant_label"),
            "namespace labels are read through the API server: set kubernetes.api_server.watch",
        )
