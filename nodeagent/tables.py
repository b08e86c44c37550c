"""Plain-text tables for the CLI: aligned columns, no colour, safe to grep, paste and print.

Cgroup names come from whoever made the cgroup: they may hold bytes that are not UTF-8
(os.scandir hands them over as lone surrogates, which a strict UTF-8 stdout refuses) and
control characters (which a terminal would obey). Everything shown goes through `printable`.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from nodeagent.cgroupfs.values import Attribute

SHOWN = (
    Attribute.CPU_WEIGHT,
    Attribute.CPU_MAX,
    Attribute.MEMORY_MAX,
    Attribute.MEMORY_HIGH,
    Attribute.PIDS_MAX,
)
"""The attributes that allocations and explain show, in their column order."""


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, as surrogateescape keeps it
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return _NAMED.get(char) or f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(text: str) -> str:
    r"""`text` with every character a terminal should not get raw (controls, bytes that were
    not UTF-8, invisible format and separator characters) written as a Python-style escape:
    \n, \x1b, \xff, \u202e. Backslashes stay as they are (systemd names use \x2d)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


Keep = Literal["head", "tail", "leaf", "id"]
"""How a column too wide is cut, and how far. Text (a reason, a status) keeps its "head" or
its "tail" and is cut down to MIN_CUT or its header. A name tells its row apart, so it is
never cut so far that two names that differ show the same: a "leaf" (a cgroup's path, a
runtime's namespace/pod/container) loses whole components from its start, never its last
one (`\u2026/docker-4f1c2a9be7d3.scope`); an "id" (a GPU's UUID) keeps its head, at least
MIN_CUT of it."""
MIN_CUT = 12
"""A text column is never cut narrower than this or its header."""
_GAP = 2
_CUT = "\u2026"


@dataclass(frozen=True)
class Fitted:
    """A table fitted to a width, and what fitting it cost."""

    text: str
    hidden: tuple[str, ...] = ()
    """The headers of the columns that went."""
    leaves_cut: bool = False
    """Whether a name lost part of its leaf (the last step)."""
    over: int = 0
    """How far its widest row still runs past the width (0: it fits)."""


def fittest(*fits: Fitted, uncounted: Collection[str] = ()) -> Fitted:
    """The first of several layouts of one table that fits, keeps every name's leaf and
    hides the fewest columns (those `uncounted` aside), in that order."""
    return min(
        fits,
        key=lambda f: (f.over > 0, f.leaves_cut, len(set(f.hidden).difference(uncounted))),
    )


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    width: int | None = None,
    cut: Sequence[tuple[int, Keep]] = (),
    drop: Sequence[int] = (),
    more: str = "--wide",
) -> str:
    """Aligned columns, fitted to `width` (see `fit`)."""
    return fit(headers, rows, width=width, cut=cut, drop=drop, more=more).text


def fit(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    width: int | None = None,
    cut: Sequence[tuple[int, Keep]] = (),
    drop: Sequence[int] = (),
    more: str = "--wide",
) -> Fitted:
    """Aligned columns, fitted to `width` in three steps, each only while the lines are
    wider: the columns named in `cut` (by index, in its order: text before names) are
    narrowed, each no further than its `Keep` allows; then the columns in `drop` go, in its
    order, named in one last line that says where they are (`more`); then a name's leaf is
    cut too, from its start, no further than the names that differ still differ. A cell cut
    short ends (or, keeping its tail, starts) with an ellipsis. A table that still cannot
    fit is wider than `width`; without `width` (a pipe, a file) lines are whole."""
    full = [[printable(str(h)) for h in headers]] + [
        ["-" if c is None else printable(str(c)) for c in r] for r in rows
    ]
    cells = [list(row) for row in full]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    shown = list(range(len(headers)))

    def over() -> int:
        return sum(widths[i] for i in shown) + _GAP * (len(shown) - 1) - (width or 0)

    def narrow(column: int, keep: Keep, least: int) -> bool:
        target = widths[column] - min(over(), widths[column] - least)
        if target >= widths[column]:
            return False
        for row, whole in zip(cells[1:], full[1:], strict=True):
            row[column] = _cut(whole[column], target, keep)
        widths[column] = max(len(row[column]) for row in cells)
        return True

    for column, keep in cut if width else ():
        if over() > 0:
            body = [row[column] for row in full[1:]]
            narrow(column, keep, _least(body, keep, len(full[0][column])))
    hidden = []
    for column in drop if width else ():
        if over() > 0 and len(shown) > 1:
            shown.remove(column)
            hidden.append(full[0][column])
    leaves_cut = False
    for column, keep in cut if width else ():
        if keep == "leaf" and over() > 0:
            body = [row[column] for row in full[1:]]
            least = _least(body, keep, len(full[0][column]), leaf=False)
            leaves_cut = narrow(column, keep, least) or leaves_cut
    lines = [(" " * _GAP).join(row[i].ljust(widths[i]) for i in shown).rstrip() for row in cells]
    if hidden:
        lines.append(_hidden_line(hidden, width, more))
    return Fitted("\n".join(lines), tuple(hidden), leaves_cut, max(0, over()) if width else 0)


def _hidden_line(hidden: Sequence[str], width: int | None, more: str) -> str:
    """The line under a table that names the columns that went and where they are: said
    shorter where the whole sentence is wider than the table may be, wrapped only where
    even that is."""
    names = ", ".join(hidden)
    for line in (
        f"(no room in {width} columns for {names}: see {more})",
        f"(not shown: {names}; see {more})",
    ):
        if width is None or len(line) <= width:
            return line
    return wrap(line, width)


def _cut(text: str, width: int, keep: Keep) -> str:
    if keep == "leaf":
        return shorten_path(text, width)
    return shorten(text, width, "head" if keep == "id" else keep)


def _least(cells: Sequence[str], keep: Keep, header: int, *, leaf: bool = True) -> int:
    """The narrowest a column may be cut to: text to MIN_CUT or its header; a name to where
    the cells that differ still differ and (`leaf`) each still keeps its leaf."""
    if keep in ("head", "tail"):
        return max(MIN_CUT, header)
    if not cells:
        return header
    widest = max(map(len, cells))
    least = max(header, min(MIN_CUT, widest)) if keep == "id" else header
    if keep == "leaf" and leaf:
        least = max(least, *(min(len(c), len(_leaf(c)) + 2) for c in cells))
    differ = len(set(cells))
    while least < widest and len({_cut(c, least, keep) for c in cells}) < differ:
        least += 1
    return least


def _leaf(path: str) -> str:
    """What tells a path apart: its last component, without a note after it."""
    leaf, note = _note(path.rsplit("/", 1)[-1])
    return leaf + (" (\u2026)" if note else "")


_NOTE = re.compile(r"^(.+?)( \([^/]*\))$")


def _note(text: str) -> tuple[str, str]:
    """`text` and the note in parentheses at its end, if any: `dbus.service (via systemd)`."""
    m = _NOTE.match(text)
    return (m[1], m[2]) if m else (text, "")


def shorten(text: str, width: int, keep: Literal["head", "tail"] = "head") -> str:
    """`text` in at most `width` characters, an ellipsis standing for what is cut."""
    if len(text) <= width:
        return text
    return text[: width - 1] + _CUT if keep == "head" else _CUT + text[-(width - 1) :]


def shorten_path(path: str, width: int) -> str:
    """`path` in at most `width` characters: whole components cut from its start, `\u2026/`
    standing for them, so that its leaf stays (`\u2026/burstable/pod3b1e5f2a/4f1c2a9be7d3`);
    then a note after it (` (via systemd)`) shrinks to ` (\u2026)`; a leaf that alone is too
    wide keeps its end (and the note's mark)."""
    if len(path) <= width:
        return path
    parts = path.split("/")
    leaf, note = _note(parts[-1])
    kept = parts[-1]
    for part in reversed(parts[1:-1]):
        if len(part) + len(kept) + 3 > width:
            break
        kept = f"{part}/{kept}"
    if len(parts) > 1 and len(kept) + 2 <= width:
        return f"{_CUT}/{kept}"
    short = f"{_CUT}/{leaf}" if len(parts) > 1 else leaf
    if note and width > 5:
        return shorten(short, width - 4, "tail") + f" ({_CUT})"
    return shorten(path, width, "tail")


def wrap(text: str, width: int | None) -> str:
    """`text` with each line wider than `width` wrapped at spaces, its continuation indented
    two more than the line; no word is broken (a path or a UUID wider than `width` stays
    whole). Without `width` (a pipe, a file) lines are whole."""
    if width is None:
        return text
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip(" ")))
        out += textwrap.wrap(
            line.lstrip(" "),
            width,
            initial_indent=indent,
            subsequent_indent=indent + "  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(out)


def fold(text: str, width: int | None, hang: int | None = None) -> str:
    """`text` with each line wider than `width` folded so that none is: at spaces where it
    can be, and a word wider than a line (a path, an id) after a `/`, else after a `-`, `_`,
    `.`, `,`, `:` or `=` in it, else where the line ends; nothing is cut. A continuation
    starts at column `hang` (by default two more than its line's indent). Without `width`
    (a pipe, a file) lines are whole."""
    if width is None:
        return text
    return "\n".join(part for line in text.split("\n") for part in _fold(line, width, hang))


_BREAKS = ("/", "-_.,:;=")
"""Where a word wider than a line is broken, the first that a line has room for."""


def _fold(line: str, width: int, hang: int | None) -> list[str]:
    if len(line) <= width:
        return [line]
    indent = len(line) - len(line.lstrip(" "))
    cont = " " * (indent + 2 if hang is None else hang)
    if len(cont) > width // 2:
        cont = " " * 2
    out: list[str] = []
    current = line[:indent]
    for space, word in re.findall(r"(\s*)(\S+)", line[indent:]):
        gap = space if current.strip() else ""
        if len(current) + len(gap) + len(word) <= width:
            current += gap + word
            continue
        rest = word
        if current.strip():
            if len(cont) + len(word) <= width:  # the next line has room for it whole
                out.append(current)
                current = cont + word
                continue
            head, rest = _break(word, width - len(current) - len(gap), hard=False)
            out.append(current + (gap + head if head else ""))
            current = cont
        while len(current) + len(rest) > width:
            head, rest = _break(rest, width - len(current), hard=True)
            out.append(current + head)
            current = cont
        current += rest
    out.append(current)
    return [part.rstrip() for part in out]


def _break(word: str, room: int, *, hard: bool) -> tuple[str, str]:
    """`word` in two, the first at most `room` wide and ending at the first of `_BREAKS`
    that has room; ('', word) where none has. Not `hard` (the rest of a line that holds
    words already): a path only after a `/`, so that a line never ends inside a component
    it could have held whole. `hard` (a line of its own): where no break has room, at
    `room`, never empty."""
    for marks in _BREAKS if hard or "/" not in word else _BREAKS[:1]:
        at = max((i + 1 for i, c in enumerate(word[: max(0, room)]) if c in marks), default=0)
        if at:
            return word[:at], word[at:]
    if not hard:
        return "", word
    at = max(1, room)
    return word[:at], word[at:]


_LONG_ID = re.compile(r"(?<![0-9a-f])([0-9a-f]{12})[0-9a-f]{52}(?![0-9a-f])")
# no look-behind: a pod's UID follows 'pod'; 8 hex digits then a separator fix its start
_UUID = re.compile(
    r"([0-9a-f]{8})[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}(?![0-9a-f])"
)


def short_ids(text: str) -> str:
    """Container ids (64 hex digits) cut to their first 12 and pod UIDs to their first 8, as
    `docker ps` and `crictl ps` show them: system.slice/docker-4f1c2a9be7d3.scope. `explain`
    takes these forms back."""
    return _UUID.sub(r"\1", _LONG_ID.sub(r"\1", text))


def change(current: str | None, target: str | None) -> str:
    """'333' when applied, '100->333' when the kernel still holds another value, '-' when unset."""
    if target is None:
        return current or "-"
    if current == target:
        return target
    return f"{current or '?'}->{target}"


def setting(
    attribute: str,
    current: str | None,
    target: str | None,
    written: bool = True,
    *,
    compact: bool = False,
) -> str:
    """One cgroup setting as allocations and explain show it: memory in sizes (4Gi), and
    OLD->NEW where the kernel still holds another value than the plan's. For a cgroup the
    agent does not write (read-only), NEW would read as "will be written": the value the
    kernel keeps comes first, the plan's beside it, '100 (plan: 133)'. `compact`: cpu.max in
    cores (`cap`)."""
    if attribute.startswith("memory."):
        current, target = size(current), size(target)
    elif compact and attribute == "cpu.max":
        shown = cap(current), cap(target)
        if shown[0] != shown[1] or current == target:  # a change of period alone: as it is
            current, target = shown
    if not written and target is not None and current != target:
        return f"{current or '?'} (plan: {target})"
    return change(current, target)


def cap(value: str | None) -> str | None:
    """cpu.max's text in cores: '150000 100000' as 1.50, 'max 100000' as max; any other
    text as it is."""
    if value is None:
        return None
    parts = value.split()
    if parts[:1] == ["max"] and len(parts) <= 2:
        return "max"
    if len(parts) == 2 and all(p.isdigit() for p in parts) and int(parts[1]) > 0:
        return cores(int(parts[0]) / int(parts[1]))
    return value


def yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def age(seconds: float) -> str:
    """A duration as an operator reads it: 45s, 12m 3s, 3h 12m, 2d 4h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def cores(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.2f}"


def size(value: str | None) -> str | None:
    """Bytes as 4Gi or 1.5Gi; 'max', unknowns and None pass through."""
    if value is None or not value.isdigit():
        return value
    n = int(value)
    for power, unit in ((4, "Ti"), (3, "Gi"), (2, "Mi"), (1, "Ki")):
        factor = 1024**power
        if n >= factor:
            return f"{n // factor}{unit}" if n % factor == 0 else f"{n / factor:.1f}{unit}"
    return str(n)


def workload_name(row: Mapping[str, Any]) -> str | None:
    """The name the runtime gave a workload: `namespace/pod/container` for a pod's container
    (`namespace/pod` for the pod itself and its sandbox), else the container's name; None
    when the runtime said nothing."""
    container = row.get("container_name")
    return runtime_name(
        container if isinstance(container, str) else None, row.get("namespace"), row.get("pod")
    )


def runtime_name(container: str | None, namespace: str | None, pod: str | None) -> str | None:
    """`workload_name` from its parts."""
    if namespace is not None and pod is not None:
        return f"{namespace}/{pod}" if container is None else f"{namespace}/{pod}/{container}"
    return container
