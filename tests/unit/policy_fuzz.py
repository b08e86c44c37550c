"""Generated and mutated policy files for the fuzz tests, seeded from config/policy.yaml.

Two families of input, both drawn by hypothesis (so `--hypothesis-seed` reproduces a run
and a failure shrinks to a few edits):

- text mutations of the example policy: lines deleted, duplicated (duplicate keys), moved
  or re-indented (tabs too); keys and values replaced with other keys, other types, huge
  numbers, unicode, tags, anchors and aliases; YAML syntax inserted or cut anywhere;
- data mutations: the example policy loaded, changed at random places (values of any
  type, keys renamed, added or removed), and dumped again in a random YAML style.

`check_rejection` is the contract every rejection must keep, and `COUNTS` counts what ran,
for the pytest summary (tests/unit/conftest.py).
"""

from __future__ import annotations

import copy
import math
import random
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import yaml
from hypothesis import strategies as st

T = TypeVar("T")
SEED_FILE = Path(__file__).resolve().parents[2] / "config" / "policy.yaml"
# Comment lines are most of the example's bytes and the scanner's time; their mutations
# only test the comment scanner, so the seed keeps the YAML.
SEED = "".join(
    line
    for line in SEED_FILE.read_text().splitlines(keepends=True)
    if line.strip() and not line.lstrip().startswith("#")
)
SEED_LINES = SEED.splitlines(keepends=True)
SEED_DATA: dict[str, Any] = yaml.safe_load(SEED)

COUNTS: Counter[tuple[str, str]] = Counter()
"""Inputs run, by check (check_text, nodeagent validate, reload) and outcome."""


def count(check: str, outcome: str) -> None:
    COUNTS[check, outcome] += 1


def total(check: str) -> int:
    return sum(n for (c, _), n in COUNTS.items() if c == check)


KEYS = [
    "version", "agent", "fair_share", "tenants", "rules", "name", "match", "tenant", "class",
    "limits", "shares", "interval", "resync_interval", "managed_root", "state_file", "socket",
    "socket_group", "half_life", "weight_per_workload", "active_threshold", "deadband",
    "cpu_max", "cpu_period_us", "memory_max", "memory_high", "path", "runtime", "kind", "owner",
    "qos", "pod_uid", "container_id", "research", "prod", "<<", "Version", "tenants ",
    "pids_max", "per_user_limits",
]  # fmt: skip
SCALARS = [
    "", "~", "null", "true", "no", "On", "y", "0", "-0", "1.0", "-1", "1_000", "0x7f", "0o17",
    "0b101", "12:30:00", "190:20:30", ".nan", ".inf", "-.inf", "1e400", "-1e400", "1e-320",
    "1e308", "9" * 400, "-" + "9" * 40, "9223372036854775807", "9223372036854775808", "8Ei",
    "8191Pi", "1Pi", "4Gi", "-4Gi", "0.5Ki", "1.5", "max", "MAX", "2001-01-01",
    "2001-12-14t21:59:43.10-05:00", "30s", "500ms", "0.0001ms", "1e9d", "366d", "1h",
    "nodeagent.slice", "system.slice/x", "../x", "/abs", "a//b", "/dev/zero", "/proc/1/mem",
    "/tmp/a\\0b", "docker", "kubelet", "inference", "besteffort", "[!a-", "*" * 300,
    "[" * 2000, "x" * 5000, "'quoted'", '"\\u0000"', '"\\x85"', '"\\t\\n"',
]  # fmt: skip
UNICODE = [
    "é", "ﬁ", "\u00a0", "\u2028", "\u2029", "\x85", "\ufeff", "\u202e", "\U0001f600",
    "\u0301", "\x07", "\x1b[31m", "\t", "\r", "\r\n", "\x00", "\ud7ff", "\uffff", "İ",
]  # fmt: skip
SYNTAX = [
    "{", "}", "[", "]", ",", ":", ": ", "- ", "? ", "|", ">", "|-", ">+2", "'", '"', "#",
    "&a ", "*a", "<<: *a", "*nosuch", "&a [*a]", "!!binary ", "!!binary cHJvZA==", "!!int ",
    "!!str ", "!!float ", "!!bool ", "!!null ", "!!set ", "!!omap ", "!!pairs ", "!!seq ",
    "!!map ", "!!timestamp ", "!!merge ", "!!python/object/apply:os.system ", "!local ",
    "!<tag:x,2000:y> ", "%YAML 1.1\n---\n", "%TAG ! tag:x,2000:\n---\n", "---\n", "...\n",
    "--- |\n", "\n---\n", "@", "`", "%",
]  # fmt: skip
PAYLOADS = KEYS + SCALARS + UNICODE + SYNTAX


class Chooser(Protocol):
    """Where a mutation's choices come from: hypothesis (shrinkable, for failures a person
    reads) or a seeded random.Random (a hundred times cheaper, for volume)."""

    def pick(self, options: Sequence[T]) -> T: ...
    def number(self, low: int, high: int) -> int: ...
    def text(self) -> str: ...
    def value(self) -> Any: ...


values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300, max_value=10**400)
    | st.floats()
    | st.sampled_from(SCALARS + UNICODE)
    | st.text(max_size=10)
    | st.binary(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@dataclass
class Drawn:
    draw: st.DrawFn

    def pick(self, options: Sequence[T]) -> T:
        return self.draw(st.sampled_from(options))

    def number(self, low: int, high: int) -> int:
        return self.draw(st.integers(low, high))

    def text(self) -> str:
        return self.draw(st.sampled_from(PAYLOADS) | st.text(max_size=12))

    def value(self) -> Any:
        return self.draw(values)


_ALPHABET = string.printable + "".join(UNICODE) + "éü€漢"


@dataclass
class Seeded:
    random: random.Random

    def pick(self, options: Sequence[T]) -> T:
        return self.random.choice(options)

    def number(self, low: int, high: int) -> int:
        return self.random.randint(low, high)

    def text(self) -> str:
        if self.random.random() < 0.7:
            return self.random.choice(PAYLOADS)
        return "".join(self.random.choices(_ALPHABET, k=self.random.randint(0, 12)))

    def value(self, depth: int = 0) -> Any:
        r = self.random
        kind = r.randrange(10 if depth < 2 else 8)
        if kind == 0:
            return r.choice([None, True, False])
        if kind == 1:
            return r.choice([0, -1, 1, 2**63, -(2**63) - 1, r.randint(-(10**6), 10**6)])
        if kind == 2:
            return r.randint(10**300, 10**400)
        if kind == 3:
            return r.choice([0.0, -0.0, 1e-320, 1e308, math.inf, -math.inf, math.nan, r.random()])
        if kind in (4, 5):
            return r.choice(SCALARS + UNICODE)
        if kind == 6:
            return self.text()
        if kind == 7:
            return r.randbytes(r.randint(0, 6))
        if kind == 8:
            return [self.value(depth + 1) for _ in range(r.randint(0, 3))]
        return {self.text(): self.value(depth + 1) for _ in range(r.randint(0, 3))}


OPS = ["value", "key", "delete", "duplicate", "move", "indent", "anchor", "wrap", "huge"]
_KEY_LINE = re.compile(r"^(?P<indent>[ \t]*(?:- )?)(?P<key>[^:#\n]*?)(?P<colon>:(?: |$))")


def _split(line: str) -> tuple[str, str, str] | None:
    """(indent, key, value) of a `key: value` line, or None."""
    m = _KEY_LINE.match(line.rstrip("\n"))
    if m is None:
        return None
    return m["indent"], m["key"], line[m.end() :].rstrip("\n")


def _edit(lines: list[str], op: str, i: int, j: int, text: str) -> list[str]:
    """One text edit of the policy; positions wrap around, so every draw is an edit."""
    if not lines:
        return [text]
    i, j = i % len(lines), j % len(lines)
    line = lines[i]
    parts = _split(line)
    end = "\n" if line.endswith("\n") else ""
    if op == "value" and parts:
        lines[i] = f"{parts[0]}{parts[1]}: {text}{end}"
    elif op == "key" and parts:
        lines[i] = f"{parts[0]}{text}: {parts[2]}{end}"
    elif op == "delete":
        del lines[i]
    elif op == "duplicate":  # a duplicate key when the line lands in its own mapping
        lines.insert(j, line)
    elif op == "move":
        lines.insert(j, lines.pop(i))
    elif op == "indent":
        shift = (j % 9) - 4
        body = line.lstrip(" \t")
        indent = len(line) - len(body)
        lines[i] = " " * max(0, indent + shift) + body if text != "\t" else "\t" + body
    elif op == "anchor" and parts:  # an anchor on one value, its alias (or merge) elsewhere
        lines[i] = f"{parts[0]}{parts[1]}: &a {parts[2]}{end}"
        other = _split(lines[j])
        if other:
            alias = "<<: *a" if text.startswith("<") else f"{other[1]}: *a"
            lines[j] = f"{other[0]}{alias}\n"
    elif op == "wrap" and parts:
        inner = parts[2] or text
        wrapped = f"[{inner}]" if j % 2 else "{" + inner + "}"
        lines[i] = f"{parts[0]}{parts[1]}: {wrapped}{end}"
    elif op == "huge" and parts:
        digits = "9" * (1 + j % 700)
        lines[i] = f"{parts[0]}{parts[1]}: {digits if j % 3 else '-' + digits + '.5e9'}{end}"
    else:  # insert text at a character of the line, or cut part of it
        at = j % (len(line) + 1)
        lines[i] = line[:at] + text + line[at:] if op != "cut" else line[:at] + line[at + 3 :]
    return lines


def _text_edits(c: Chooser, lines: list[str]) -> str:
    """1 to 8 text edits of `lines`."""
    lines = list(lines)
    for _ in range(c.number(1, 8)):
        op = c.pick([*OPS, "insert", "cut"])
        lines = _edit(lines, op, c.number(0, 1 << 16), c.number(0, 1 << 16), c.text())
    return "".join(lines)


def _places(data: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside `data`."""
    found = [path]
    if isinstance(data, dict):
        for k, v in data.items():
            found += _places(v, (*path, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            found += _places(v, (*path, i))
    return found


def _get(data: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        data = data[step]
    return data


def _data_edits(c: Chooser) -> str:
    """The example policy's data, changed at 1 to 5 places and dumped in a random style."""
    data: Any = copy.deepcopy(SEED_DATA)
    for _ in range(c.number(1, 5)):
        path = c.pick(_places(data))
        what = c.pick(["replace", "drop", "add", "rename"])
        if not path:
            data = c.value() if what == "replace" else data
            continue
        parent, last = _get(data, path[:-1]), path[-1]
        if what == "replace":
            parent[last] = c.value()
        elif what == "drop":
            del parent[last]
        elif what == "add" and isinstance(parent, dict):
            key = c.value() if c.number(0, 3) == 0 else c.pick(KEYS)
            parent[key if _hashable(key) else repr(key)] = c.value()
        elif what == "add":
            parent.append(c.value())
        elif isinstance(parent, dict):  # rename
            parent[c.pick(KEYS) if c.number(0, 1) else c.text()] = parent.pop(last)
    return yaml.dump(
        data,
        Dumper=_DUMPER,
        default_flow_style=c.pick([False, True, None]),
        indent=c.number(2, 9),
        width=c.pick([20, 80, 1 << 16]),
        allow_unicode=c.pick([False, True]),
        sort_keys=c.pick([False, True]),
        explicit_start=c.pick([False, True]),
        canonical=c.number(0, 9) == 0,
    )


_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's: 20x faster


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def mutate(c: Chooser) -> str:
    """A policy file's text: the example edited as text, as data, or as data then text."""
    family = c.number(0, 2)
    if family == 0:
        return _text_edits(c, SEED_LINES)
    text = _data_edits(c)
    return text if family == 1 else _text_edits(c, text.splitlines(keepends=True))


@st.composite
def _drawn_policy(draw: st.DrawFn) -> str:
    return mutate(Drawn(draw))


policies = _drawn_policy()
"""One policy per example, every choice drawn by hypothesis: a failure shrinks."""


def seeded_policies(seed: int, n: int) -> list[str]:
    """n policies from one seed: `seeded_policies(SEED, N)` gives a failing batch again."""
    chooser = Seeded(random.Random(seed))
    return [mutate(chooser) for _ in range(n)]


_LINE_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")  # what YAML counts as a new line


def check_rejection(message: str, filename: str, text: str) -> None:
    """Every line of a rejection is FILE:LINE:COL: message, at a line of the file, with
    nothing a terminal would act on; the last may be 'FILE: ... and N more problems'."""
    lines = message.split("\n")
    assert lines and message, "a rejection with no message"
    last_line = len(_LINE_BREAK.findall(text)) + 1
    located = re.compile(rf"{re.escape(filename)}:(\d+):(\d+): (\S.*)", re.DOTALL)
    more = re.compile(rf"{re.escape(filename)}: \.\.\. and \d+ more problems")
    for n, line in enumerate(lines):
        if n == len(lines) - 1 and n > 0 and more.fullmatch(line):
            continue
        m = located.fullmatch(line)
        assert m, f"not FILE:LINE:COL: message: {line!r}"
        assert 1 <= int(m[1]) <= last_line + 1, f"line {m[1]} is past the end: {line!r}"
        assert int(m[2]) >= 1, line
        assert line.isprintable(), f"a control character or line break in {line!r}"
