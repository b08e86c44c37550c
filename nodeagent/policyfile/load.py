"""Load the operator's policy YAML, or explain every problem in it as FILE:LINE:COL: message.

The YAML is composed into nodes first (SafeLoader only), so that each pydantic error
location and each semantic check can be traced back to the line and column that caused it.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass

import annotated_types
import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from nodeagent.cgroupfs.paths import split_path
from nodeagent.cgroupfs.values import QUOTA_MAX_US, QUOTA_MIN_US
from nodeagent.errors import NodeagentError, UnsafePath
from nodeagent.identity import Owner, Runtime
from nodeagent.policyfile.glob import glob_matches
from nodeagent.policyfile.model import ANY, MAX, AgentMode, Limits, Match, PolicySpec, Rule
from nodeagent.policyfile.nesting import nesting_warnings
from nodeagent.regular_file import UnusableFile, read_regular_file

MAX_BYTES = 1 << 20  # a real policy is a few kilobytes; this also stops a read of /dev/zero
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
MAX_NODES = 100_000  # counted with every alias expanded, which stops "billion laughs" documents
# An operator reads the first problems and fixes them; 20,000 lines help nobody. All are
# still found (in linear time), and the count of the rest is given.
MAX_SHOWN = 100
# "Did you mean" compares a name with every candidate: it is offered for this many names at
# most, among at most this many candidates, so that a hostile file costs no quadratic time.
MAX_SUGGESTIONS = MAX_SHOWN
MAX_CANDIDATES = 1000
EXAMPLE = "config/policy.yaml"
_MERGE_TAG = "tag:yaml.org,2002:merge"
# A YAML line break, as PyYAML's reader counts them for marks.
_LINE_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a policy, at a 1-based line and column; a warning does not
    stop the policy from being used (`validate --strict` fails on it)."""

    file: str
    line: int
    col: int
    message: str
    severity: typing.Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        warning = "warning: " if self.severity == "warning" else ""
        return f"{self.file}:{self.line}:{self.col}: {warning}{self.message}"


class PolicyError(NodeagentError):
    """The policy cannot be used; `problems` lists the first MAX_SHOWN problems found, in
    file order, and `omitted` counts the others; `warnings` what is found besides."""

    def __init__(self, problems: Iterable[Problem], warnings: Iterable[Problem] = ()) -> None:
        found = tuple(problems)
        self.problems = found[:MAX_SHOWN]
        self.omitted = len(found) - len(self.problems)
        self.warnings = tuple(warnings)
        lines = [str(p) for p in self.problems]
        if self.omitted:
            lines.append(f"{found[0].file}: ... and {self.omitted} more problems")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Checked:
    """A policy that can be used, and what is questionable in it (`validate` shows both)."""

    spec: PolicySpec
    warnings: tuple[Problem, ...]


def load_policy(path: str | os.PathLike[str]) -> PolicySpec:
    """Read and parse the policy file at `path`."""
    return check_policy(path).spec


def check_policy(path: str | os.PathLike[str]) -> Checked:
    """Read and parse the policy file at `path`, with its warnings."""
    return check_text(read_text(path, "a policy"), os.fspath(path))


def read_text(path: str | os.PathLike[str], what: str) -> str:
    """The text of a small operator file that must be regular, UTF-8 and a few kilobytes;
    `what` names it in messages ('a policy'). Any problem is a PolicyError at line 1."""
    filename = os.fspath(path)

    def fail(message: str) -> PolicyError:
        return PolicyError([Problem(filename, 1, 1, message)])

    try:
        data = read_regular_file(filename, MAX_BYTES)
    except OSError as e:
        raise fail(f"cannot read: {e.strerror or e}") from None
    except UnusableFile as e:
        raise fail(f"cannot read: {e}") from None
    if len(data) > MAX_BYTES:
        raise fail(f"larger than {MAX_BYTES >> 20} MiB; {what} is a few kilobytes")
    if b"\0" in data:
        raise fail("not a text file: it contains NUL bytes")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise fail(f"not a text file: invalid UTF-8 at byte {e.start}") from None


def parse_policy(text: str, filename: str) -> PolicySpec:
    """Parse policy YAML held in memory; `filename` is only used in messages."""
    return check_text(text, filename).spec


def check_text(text: str, filename: str) -> Checked:
    """Parse policy YAML held in memory and find every problem in one pass: when fields
    have type errors, the checks across fields still run on every field that is valid
    alone, so that fixing the file never takes a second round; `filename` names it."""
    report = _Report(filename)
    where, data = _compose_and_construct(text, report)
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


def _nesting_warnings(spec: PolicySpec, where: _Locator, filename: str) -> list[Problem]:
    """Rules that can claim a cgroup and one below it (see spec.nesting), at their match."""
    out = []
    for i, message in nesting_warnings(spec):
        mark = where.mark(("rules", i, "match"))
        where_ = _dotted(("rules", i, "match"))
        out.append(
            Problem(filename, mark.line + 1, mark.column + 1, f"{where_}: {message}", "warning")
        )
    return out


class _Report:
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.problems: list[Problem] = []
        self._seen: set[Problem] = set()

    def add(self, mark: yaml.Mark | None, message: str) -> None:
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = Problem(self.filename, line, col, message)
        if problem not in self._seen:
            self._seen.add(problem)
            self.problems.append(problem)

    def sorted(self) -> list[Problem]:
        return sorted(self.problems, key=lambda p: (p.line, p.col))


@dataclass(frozen=True)
class _Entry:
    """One pair of a mapping: its nodes, and whether its key had to be replaced."""

    key: Node
    value: Node
    bad_key: bool


class _Loader(yaml.SafeLoader):
    """SafeLoader whose constructor failures always carry the node's position, and which
    indexes every mapping by its constructed keys, so that a location that pydantic reports
    leads back to its node in constant time.

    The policy's keys are all strings. A key that is not (`1:`, `~:`, `.nan:`, `no:`,
    `2001-01-01:`, a list) is replaced by a marker that no YAML key can equal: the key is
    reported where it stands, and what is under it is still checked.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.entries: dict[int, dict[str, _Entry]] = {}
        self._marker_count = 0

    def construct_object(self, node: Node, deep: bool = False) -> typing.Any:
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, RecursionError):
            raise
        except Exception as e:  # untrusted input: `!!int x` raises ValueError, `!!bool x` KeyError
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"invalid {node.tag.removeprefix('tag:yaml.org,2002:')} value: {e}",
                node.start_mark,
            ) from e

    def construct_mapping(self, node: Node, deep: bool = False) -> dict[typing.Any, typing.Any]:
        if not isinstance(node, MappingNode):
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"expected a mapping node, but found {type(node).__name__}",
                node.start_mark,
            )
        self.flatten_mapping(node)
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        taken = {k for k in keys if isinstance(k, str)}
        entries: dict[str, _Entry] = {}
        mapping: dict[typing.Any, typing.Any] = {}
        for constructed, (key_node, value_node) in zip(keys, node.value, strict=True):
            bad = not isinstance(constructed, str)
            key = self._marker(taken) if bad else constructed
            entries[key] = _Entry(key_node, value_node, bad)
            mapping[key] = self.construct_object(value_node, deep=deep)
        self.entries[id(node)] = entries
        return mapping

    def _marker(self, taken: set[str]) -> str:
        while True:
            self._marker_count += 1
            marker = f"\0{self._marker_count}"
            if marker not in taken:  # a quoted key may hold a NUL, but not this one as well
                return marker


def _compose_and_construct(text: str, report: _Report) -> tuple[_Locator | None, object]:
    """A locator over the node tree and the plain data built from it, (None, None) for an
    empty document; fatal YAML problems raise PolicyError."""
    loader: _Loader | None = None
    try:
        loader = _Loader(text)
        root = loader.get_single_node()
        if root is None:
            return None, None
        _check_nodes(root, report)
        data = loader.construct_document(root)
        where = _Locator(root, loader.entries)
        where.report_bad_keys(report)
        return where, data
    except yaml.MarkedYAMLError as e:
        report.add(e.problem_mark or e.context_mark, _yaml_message(e))
    except yaml.reader.ReaderError as e:
        report.add(_mark_at(text, e.position), str(e).split("\n")[0])
    except yaml.YAMLError as e:
        report.add(None, f"invalid YAML: {e}")
    except RecursionError:
        report.add(None, "the policy is nested too deeply")
    finally:
        if loader is not None:
            loader.dispose()
    raise PolicyError(report.sorted())


def _mark_at(text: str, position: int) -> yaml.Mark:
    """The mark of a character position, counting line breaks as YAML does (CR alone too)."""
    line, start = 0, 0
    for m in _LINE_BREAK.finditer(text, 0, position):
        line, start = line + 1, m.end()
    return yaml.Mark("", position, line, position - start, None, 0)


def _yaml_message(e: yaml.MarkedYAMLError) -> str:
    parts = []
    if e.context:
        mark = e.context_mark
        if mark is None or e.problem_mark is None or mark.line == e.problem_mark.line:
            parts.append(e.context)
        else:
            parts.append(f"{e.context} (line {mark.line + 1})")
    parts.append(e.problem or "invalid YAML")
    return ": ".join(parts)


class _FatalNode(Exception):
    def __init__(self, node: Node, message: str) -> None:
        super().__init__(message)
        self.node = node


def _check_nodes(root: Node, report: _Report) -> None:
    """Reject alias bombs and cycles before anything expands them; note duplicate keys.

    PyYAML keeps the last of two equal keys without a word, which hides typos.
    """
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in active:
            raise _FatalNode(node, "an alias refers to a node that contains it")
        active.add(id(node))
        children: list[Node] = []
        if isinstance(node, SequenceNode):
            children = node.value
        elif isinstance(node, MappingNode):
            _check_duplicates(node, report)
            children = [n for pair in node.value for n in pair]
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_NODES:
                raise _FatalNode(
                    root,
                    f"the policy has more than {MAX_NODES} YAML nodes, counting each use "
                    "of an alias; a policy is far smaller",
                )
        active.discard(id(node))
        sizes[id(node)] = total
        return total

    try:
        size(root)
    except _FatalNode as e:
        report.add(e.node.start_mark, str(e))
        raise PolicyError(report.sorted()) from None


def _check_duplicates(node: MappingNode, report: _Report) -> None:
    first: dict[tuple[str, str], Node] = {}
    for key, _ in node.value:
        if not isinstance(key, ScalarNode) or key.tag == _MERGE_TAG:
            continue
        seen = first.setdefault((key.tag, key.value), key)
        if seen is not key:
            line = seen.start_mark.line + 1
            report.add(key.start_mark, f"duplicate key {key.value!r} (first at line {line})")


@dataclass(frozen=True)
class _Place:
    """Where a location leads in the YAML: the node at it (or its deepest ancestor present),
    the key node of the last mapping step, how many items of the location were found, and
    the path found, written as the file writes it."""

    node: Node
    key: Node | None
    found: int
    path: Loc
    bad_key: bool


class _Locator:
    """Finds the YAML node behind a location such as ('rules', 0, 'limits', 'cpu_max')."""

    def __init__(self, root: Node, index: dict[int, dict[str, _Entry]]) -> None:
        self.root = root
        self.index = index
        self.markers = {k for entries in index.values() for k, e in entries.items() if e.bad_key}

    def find(self, loc: Loc) -> _Place:
        node, key, path, bad = self.root, None, list[str | int](), False
        for depth, item in enumerate(loc):
            entries = self.index.get(id(node)) if isinstance(node, MappingNode) else None
            if entries is not None and isinstance(item, str) and item in entries:
                entry = entries[item]
                node, key, bad = entry.value, entry.key, entry.bad_key
                path.append(_key_text(key) if bad else item)
            elif (
                isinstance(node, SequenceNode)
                and isinstance(item, int)
                and 0 <= item < len(node.value)
            ):
                node, key, bad = node.value[item], None, False
                path.append(item)
            else:
                return _Place(node, key, depth, tuple(path), bad)
        return _Place(node, key, len(loc), tuple(path), bad)

    def mark(self, loc: Loc) -> yaml.Mark:
        return self.find(loc).node.start_mark

    def report_bad_keys(self, report: _Report) -> None:
        """Report each key that is not a string at the key itself, naming its mapping."""
        seen: set[int] = set()
        todo: list[tuple[Node, _Link]] = [(self.root, None)]
        while todo:
            node, link = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            children: list[tuple[Node, _Link]] = []
            if isinstance(node, SequenceNode):
                children = [(child, (link, i)) for i, child in enumerate(node.value)]
            for key, entry in self.index.get(id(node), {}).items():
                if entry.bad_key:
                    report.add(entry.key.start_mark, _bad_key_message(entry.key, _unlink(link)))
                children.append(
                    (entry.value, (link, _key_text(entry.key) if entry.bad_key else key))
                )
            todo.extend(reversed(children))  # in file order, so an alias is named by its anchor


# A path as a linked list (parent, last item): extending it costs O(1) whatever its depth.
_Link = tuple["_Link", str | int] | None


def _unlink(link: _Link) -> Loc:
    items: list[str | int] = []
    while link is not None:
        link, item = link
        items.append(item)
    return tuple(reversed(items))


_IMPLICIT = {"int", "float", "bool", "null", "timestamp"}  # what a plain scalar resolves to


def _key_text(key: Node) -> str:
    return key.value if isinstance(key, ScalarNode) else f"<{_NODE_KINDS[type(key)]}>"


_NODE_KINDS: dict[type[Node], str] = {MappingNode: "a mapping", SequenceNode: "a list"}


def _bad_key_message(key: Node, path: Loc) -> str:
    inside = f" in {_dotted(path)}" if path else ""
    if not isinstance(key, ScalarNode):
        return f"a key{inside} must be a string, got {_NODE_KINDS[type(key)]}"
    kind = key.tag.removeprefix("tag:yaml.org,2002:")
    message = f"key {key.value!r}{inside} must be a string, not {kind}"
    return message + ("; quote it if it is meant as a name" if kind in _IMPLICIT else "")


def _dotted(loc: Loc) -> str:
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif re.fullmatch(r"[A-Za-z_][\w-]*", item):
            out += f".{item}" if out else item
        else:
            out += f"[{item!r}]"
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


def _explain(where: _Locator, error: ErrorDetails) -> tuple[yaml.Mark, str] | None:
    """Where a pydantic error points in the YAML, and what to tell the operator; None when
    the problem is a key that is not a string, which is reported already."""
    loc, kind, ctx = error["loc"], error["type"], error.get("ctx", {})
    place = where.find(loc)
    # Items past the nodes found are union member labels such as "literal['max']".
    path = _dotted(place.path)
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
        inside = _dotted(place.path[:-1])
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


def _check_semantics(spec: PolicySpec, where: _Locator, report: _Report) -> None:
    """What the schema cannot say alone: cross references, uniqueness and safe paths.

    `spec` may be partial (some fields BROKEN, see `_partial`): each check stands in a
    `with _SKIP_BROKEN:` of its own, so that only the checks whose inputs are broken are
    skipped."""

    def add(loc: Loc, message: str) -> None:
        report.add(where.mark(loc), f"{_dotted(loc)}: {message}")

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
    """A rule's limits: none for Slurm's jobs, memory.high not above memory.max, sizes of at
    least 1Mi, and a CPU quota the kernel takes."""
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
    for key in ("memory_max", "memory_high"):
        with _SKIP_BROKEN:
            size = getattr(limits, key)
            if isinstance(size, int) and size < MIN_MEMORY:
                add(
                    (*at, key),
                    f"{size} bytes is below 1Mi; sizes are bytes unless they have a unit,"
                    " such as 512Mi",
                )
    with _SKIP_BROKEN:
        if isinstance(limits.cpu_max, float):
            quota = limits.cpu_max * limits.cpu_period_us
            if quota < QUOTA_MIN_US:
                add(
                    (*at, "cpu_max"),
                    f"{limits.cpu_max} cores is less than the kernel's minimum quota of "
                    f"{QUOTA_MIN_US}us per {limits.cpu_period_us}us period",
                )
            elif quota > QUOTA_MAX_US:
                add(
                    (*at, "cpu_max"),
                    f"{limits.cpu_max} cores is more than the kernel's maximum quota of "
                    f"{QUOTA_MAX_US}us per period",
                )


def _items(values: typing.Any) -> list[typing.Any]:
    """The items of a list field of a partial spec; none when the list itself is broken."""
    with _SKIP_BROKEN:
        return list(values)
    return []


def _warnings(spec: PolicySpec, where: _Locator, filename: str) -> tuple[Problem, ...]:
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


_GLOB_SPECIAL = re.compile(r"[*?\[\]]")


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
