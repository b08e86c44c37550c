"""Load the operator's policy YAML, or explain every problem in it as FILE:LINE:COL: message.

The YAML is composed into nodes first (SafeLoader only), so that each pydantic error
location and each semantic check can be traced back to the line and column that caused it.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from nodeagent.cgroupfs.tree import split_path
from nodeagent.cgroupfs.values import QUOTA_MAX_US, QUOTA_MIN_US
from nodeagent.errors import NodeagentError, UnsafePath
from nodeagent.spec.model import MAX, PolicySpec

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
EXAMPLE = "config/policy.yaml"
_MERGE_TAG = "tag:yaml.org,2002:merge"

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a policy, at a 1-based line and column."""

    file: str
    line: int
    col: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.message}"


class PolicyError(NodeagentError):
    """The policy cannot be used; `problems` lists everything found, in file order."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(map(str, self.problems)))


def load_policy(path: str | os.PathLike[str]) -> PolicySpec:
    """Read and parse the policy file at `path`."""
    filename = os.fspath(path)

    def fail(message: str) -> PolicyError:
        return PolicyError([Problem(filename, 1, 1, message)])

    try:
        with open(filename, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise fail(f"cannot read: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise fail(f"larger than {MAX_BYTES >> 20} MiB; a policy is a few kilobytes")
    if b"\0" in data:
        raise fail("not a text file: it contains NUL bytes")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise fail(f"not a text file: invalid UTF-8 at byte {e.start}") from None
    return parse_policy(text, filename)


def parse_policy(text: str, filename: str) -> PolicySpec:
    """Parse policy YAML held in memory; `filename` is only used in messages."""
    report = _Report(filename)
    root, data = _compose_and_construct(text, report)
    if root is None or data is None:
        report.add(None, f"the policy is empty; see {EXAMPLE} for an example")
        raise PolicyError(report.problems)
    if not isinstance(data, dict):
        report.add(
            root.start_mark,
            "the policy must be a mapping with keys such as version, tenants and rules, "
            f"got {_describe(data)}",
        )
        raise PolicyError(report.problems)
    try:
        spec = PolicySpec.model_validate(data)
    except ValidationError as e:
        for error in e.errors(include_url=False):
            report.add(*_explain(root, error))
        raise PolicyError(report.sorted()) from None
    _check_semantics(spec, root, report)
    if report.problems:
        raise PolicyError(report.sorted())
    return spec


class _Report:
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.problems: list[Problem] = []

    def add(self, mark: yaml.Mark | None, message: str) -> None:
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = Problem(self.filename, line, col, message)
        if problem not in self.problems:
            self.problems.append(problem)

    def sorted(self) -> list[Problem]:
        return sorted(self.problems, key=lambda p: (p.line, p.col))


class _Loader(yaml.SafeLoader):
    """SafeLoader whose constructor failures always carry the node's position."""

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


def _compose_and_construct(text: str, report: _Report) -> tuple[Node | None, object]:
    """The node tree and the plain data built from it; fatal YAML problems raise PolicyError."""
    loader: _Loader | None = None
    try:
        loader = _Loader(text)
        root = loader.get_single_node()
        if root is None:
            return None, None
        _check_nodes(root, report)
        return root, loader.construct_document(root)
    except yaml.MarkedYAMLError as e:
        report.add(e.problem_mark or e.context_mark, _yaml_message(e))
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position)
        col = e.position - (text.rfind("\n", 0, e.position) + 1)
        report.add(yaml.Mark("", e.position, line, col, None, 0), str(e).split("\n")[0])
    except yaml.YAMLError as e:
        report.add(None, f"invalid YAML: {e}")
    except RecursionError:
        report.add(None, "the policy is nested too deeply")
    finally:
        if loader is not None:
            loader.dispose()
    raise PolicyError(report.sorted())


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


def _find(root: Node, loc: Loc) -> tuple[Node, Node | None, int]:
    """The node at `loc` (or its deepest ancestor present), the key node of the last
    mapping step, and how many items of `loc` were found. '[key]' selects that key node.
    """
    node, key = root, None
    for depth, item in enumerate(loc):
        if item == "[key]" and key is not None:
            return key, key, depth + 1
        if isinstance(node, MappingNode):
            # The last equal key wins, as when the mapping was constructed.
            pairs = [(k, v) for k, v in node.value if isinstance(k, ScalarNode)]
            match = [pair for pair in pairs if pair[0].value == str(item)]
            if not match:
                return node, key, depth
            key, node = match[-1]
        elif isinstance(node, SequenceNode) and isinstance(item, int) and item < len(node.value):
            key, node = None, node.value[item]
        else:
            return node, key, depth
    return node, key, len(loc)


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


def _explain(root: Node, error: ErrorDetails) -> tuple[yaml.Mark, str]:
    """Where a pydantic error points in the YAML, and what to tell the operator."""
    loc, kind, ctx = error["loc"], error["type"], error.get("ctx", {})
    node, key, found = _find(root, loc)
    # Items past the nodes found are union member labels such as "literal['max']".
    path = _dotted(tuple(i for i in loc[:found] if i != "[key]"))
    where = f" in {path}" if path else ""
    if kind == "missing" and found == len(loc) - 1:
        return node.start_mark, f"missing required key {loc[-1]!r}{where}"
    if kind == "extra_forbidden" and key is not None:
        parent, name = _model_at(loc[:-1]), str(loc[-1])
        fields = parent.model_fields.items() if parent else ()
        names = [n for field_name, f in fields for n in (field_name, f.alias) if n]
        inside = _dotted(loc[:-1])
        message = f"unknown key {name!r}" + (f" in {inside}" if inside else "")
        return key.start_mark, message + _did_you_mean(name, names)
    if key is not None and (kind == "invalid_key" or "[key]" in loc):
        # The loc is ('tenants', 1, '[key]') for a dict, or (..., 1) for a model.
        inside = _dotted(loc[: found - (2 if "[key]" in loc else 1)])
        message = f"key {key.value!r}" + (f" in {inside}" if inside else "")
        return key.start_mark, f"{message} must be a string"
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
    return node.start_mark, f"{path}: {message}" if path else message


def _is_relative_path(path: str) -> bool:
    try:
        return bool(split_path(path))
    except UnsafePath:
        return False


def _check_semantics(spec: PolicySpec, root: Node, report: _Report) -> None:
    """What the schema cannot say alone: cross references, uniqueness and safe paths."""

    def add(loc: Loc, message: str) -> None:
        report.add(_find(root, loc)[0].start_mark, f"{_dotted(loc)}: {message}")

    def line_of(loc: Loc) -> int:
        return _find(root, loc)[0].start_mark.line + 1

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
    first_rule: dict[str, int] = {}
    for i, rule in enumerate(spec.rules):
        if rule.name in first_rule:
            first = line_of(("rules", first_rule[rule.name], "name"))
            add(("rules", i, "name"), f"duplicate rule name {rule.name!r} (first at line {first})")
        first_rule.setdefault(rule.name, i)
        if rule.tenant not in spec.tenants:
            hint = _did_you_mean(rule.tenant, spec.tenants) or (
                f"; tenants are {', '.join(map(repr, spec.tenants))}"
            )
            add(("rules", i, "tenant"), f"unknown tenant {rule.tenant!r}{hint}")
        limits = rule.limits
        high, cap = limits.memory_high, limits.memory_max
        if isinstance(cap, int) and (high == MAX or (isinstance(high, int) and high > cap)):
            add(
                ("rules", i, "limits", "memory_high"),
                f"memory_high ({high if high == MAX else f'{high} bytes'}) is above"
                f" memory_max ({cap} bytes)",
            )
        for key, size in (("memory_max", cap), ("memory_high", high)):
            if isinstance(size, int) and size < MIN_MEMORY:
                add(
                    ("rules", i, "limits", key),
                    f"{size} bytes is below 1Mi; sizes are bytes unless they have a unit,"
                    " such as 512Mi",
                )
        if isinstance(limits.cpu_max, float):
            quota = limits.cpu_max * limits.cpu_period_us
            if quota < QUOTA_MIN_US:
                add(
                    ("rules", i, "limits", "cpu_max"),
                    f"{limits.cpu_max} cores is less than the kernel's minimum quota of "
                    f"{QUOTA_MIN_US}us per {limits.cpu_period_us}us period",
                )
            elif quota > QUOTA_MAX_US:
                add(
                    ("rules", i, "limits", "cpu_max"),
                    f"{limits.cpu_max} cores is more than the kernel's maximum quota of "
                    f"{QUOTA_MAX_US}us per period",
                )
