"""Plain-text tables for the CLI: aligned columns, no colour, safe to grep, paste and print.

Cgroup names come from whoever made the cgroup: they may hold bytes that are not UTF-8
(os.scandir hands them over as lone surrogates, which a strict UTF-8 stdout refuses) and
control characters (which a terminal would obey). Everything shown goes through `printable`.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence
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


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    width: int | None = None,
    cut: Sequence[tuple[int, Keep]] = (),
    drop: Sequence[int] = (),
    more: str = "--wide",
) -> str:
    """Aligned columns, fitted to `width` in three steps, each only while the lines are
    wider: the columns named in `cut` (by index, in its order: text before names) are
    narrowed, each no further than its `Keep` allows; then the columns in `drop` go, in its
    order, named in a last line that says where they are (`more`); then a name's leaf is
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

    def narrow(column: int, keep: Keep, least: int) -> None:
        target = widths[column] - min(over(), widths[column] - least)
        if target >= widths[column]:
            return
        for row, whole in zip(cells[1:], full[1:], strict=True):
            row[column] = _cut(whole[column], target, keep)
        widths[column] = max(len(row[column]) for row in cells)

    for column, keep in cut if width else ():
        if over() > 0:
            body = [row[column] for row in full[1:]]
            narrow(column, keep, _least(body, keep, len(full[0][column])))
    hidden = []
    for column in drop if width else ():
        if over() > 0 and len(shown) > 1:
            shown.remove(column)
            hidden.append(full[0][column])
    for column, keep in cut if width else ():
        if keep == "leaf" and over() > 0:
            body = [row[column] for row in full[1:]]
            narrow(column, keep, _least(body, keep, len(full[0][column]), leaf=False))
    lines = [(" " * _GAP).join(row[i].ljust(widths[i]) for i in shown).rstrip() for row in cells]
    if hidden:
        lines.append(
            wrap(f"(no room in {width} columns for {', '.join(hidden)}: see {more})", width)
        )
    return "\n".join(lines)


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


def setting(attribute: str, current: str | None, target: str | None, written: bool = True) -> str:
    """One cgroup setting as allocations and explain show it: memory in sizes (4Gi), and
    OLD->NEW where the kernel still holds another value than the plan's. For a cgroup the
    agent does not write (read-only), NEW would read as "will be written": the value the
    kernel keeps comes first, the plan's beside it, '100 (plan: 133)'."""
    if attribute.startswith("memory."):
        current, target = size(current), size(target)
    if not written and target is not None and current != target:
        return f"{current or '?'} (plan: {target})"
    return change(current, target)


def yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


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
