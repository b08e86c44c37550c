"""Operator YAML files read safely, every problem at its FILE:LINE:COL: the policy file
(nodeagent.policyfile.load) and the others, such as the simulated GPU nodes in config/gpus/.

One SafeLoader composition for all (alias bombs and cycles refused before anything expands
them, duplicate keys, keys that are not strings and bad tags reported where they stand), a
locator from a pydantic error's location back to its YAML node, and the file's read (small,
regular, UTF-8). What each file's fields mean, and the words for their errors, stay with
their loaders.
"""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass

import yaml
from pydantic import ValidationError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from nodeagent.errors import NodeagentError
from nodeagent.regular_file import UnusableFile, read_regular_file

MAX_BYTES = 1 << 20  # a real policy is a few kilobytes; this also stops a read of /dev/zero

MAX_NODES = 100_000  # counted with every alias expanded, which stops "billion laughs" documents

# An operator reads the first problems and fixes them; 20,000 lines help nobody. All are
# still found (in linear time), and the count of the rest is given.
MAX_SHOWN = 100

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


class Report:
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


def compose_and_construct(text: str, report: Report) -> tuple[Locator | None, object]:
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
        where = Locator(root, loader.entries)
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


def _check_nodes(root: Node, report: Report) -> None:
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


def _check_duplicates(node: MappingNode, report: Report) -> None:
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


class Locator:
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

    def report_bad_keys(self, report: Report) -> None:
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
    inside = f" in {dotted(path)}" if path else ""
    if not isinstance(key, ScalarNode):
        return f"a key{inside} must be a string, got {_NODE_KINDS[type(key)]}"
    kind = key.tag.removeprefix("tag:yaml.org,2002:")
    message = f"key {key.value!r}{inside} must be a string, not {kind}"
    return message + ("; quote it if it is meant as a name" if kind in _IMPLICIT else "")


def dotted(loc: Loc) -> str:
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif re.fullmatch(r"[A-Za-z_][\w-]*", item):
            out += f".{item}" if out else item
        else:
            out += f"[{item!r}]"
    return out


def compose(text: str, filename: str, what: str) -> tuple[Locator, object]:
    """A locator over the YAML node tree and the plain data built from it; any problem,
    duplicate keys and keys that are not strings included, raises PolicyError."""
    report = Report(filename)
    where, data = compose_and_construct(text, report)
    if report.problems:
        raise PolicyError(report.sorted())
    if where is None:
        raise PolicyError([Problem(filename, 1, 1, f"the file is empty; expected {what}")])
    return where, data


def problem_at(filename: str, where: Locator, loc: Loc, message: str) -> Problem:
    """A problem at the YAML node that `loc` names (or its closest ancestor present)."""
    mark = where.mark(loc)
    return Problem(filename, mark.line + 1, mark.column + 1, message)


def validation_problems(filename: str, where: Locator, error: ValidationError) -> list[Problem]:
    """pydantic's errors as problems at their YAML positions, in plain words."""
    out = []
    for e in error.errors(include_url=False):
        loc = tuple(e["loc"])
        place = where.find(loc)
        node, key, found = place.node, place.key, place.found
        if e["type"] == "missing":
            message = f"missing required key {loc[-1]!r}" + (
                f" in {dotted(loc[:-1])}" if loc[:-1] else ""
            )
        elif e["type"] == "extra_forbidden":
            node = key or node
            message = f"unknown key {loc[-1]!r}" + (f" in {dotted(loc[:-1])}" if loc[:-1] else "")
        elif e["type"] == "string_type" and isinstance(node, ScalarNode) and node.style is None:
            # YAML 1.1 reads 00:1B:00.0 as a number in base 60, 0x10 as 16, yes as true.
            message = f"{dotted(loc)}: must be a string; quote it: '{node.value}'"
        else:
            detail = e.get("ctx", {}).get("error") if e["type"] == "value_error" else None
            text = str(detail or e["msg"]).replace("Input should be", "must be")
            message = f"{dotted(loc[:found])}: {text}" if found else text
        mark = node.start_mark
        problem = Problem(filename, mark.line + 1, mark.column + 1, message)
        if problem not in out:
            out.append(problem)
    return sorted(out, key=lambda p: (p.line, p.col))
