"""Plain-text tables for the CLI: aligned columns, no colour, safe to grep, paste and print.

Cgroup names come from whoever made the cgroup: they may hold bytes that are not UTF-8
(os.scandir hands them over as lone surrogates, which a strict UTF-8 stdout refuses) and
control characters (which a terminal would obey). Everything shown goes through `printable`.
"""

from __future__ import annotations

import re
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


Keep = Literal["head", "tail"]
"""Which end of a cell that is too wide stays: a reason's head, a path's tail (its leaf)."""
MIN_CUT = 12
"""A column is never cut narrower than this or its header."""
_GAP = 2


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    width: int | None = None,
    cut: Sequence[tuple[int, Keep]] = (),
) -> str:
    """Aligned columns. With `width`, the columns named in `cut` (by index, the first cut
    first) are narrowed until the lines fit, each to no less than MIN_CUT or its header;
    a cell cut short ends (or, keeping its tail, starts) with an ellipsis. What the other
    columns need is never cut: a table that cannot fit is wider than `width`."""
    cells = [[printable(str(h)) for h in headers]] + [
        ["-" if c is None else printable(str(c)) for c in r] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    over = sum(widths) + _GAP * (len(widths) - 1) - (width or 0)
    for column, keep in cut if width else ():
        narrower = min(over, widths[column] - max(MIN_CUT, len(cells[0][column])))
        if narrower > 0:
            widths[column] -= narrower
            over -= narrower
            for row in cells[1:]:
                row[column] = shorten(row[column], widths[column], keep)
    lines = [
        (" " * _GAP).join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in cells
    ]
    return "\n".join(lines)


def shorten(text: str, width: int, keep: Keep = "head") -> str:
    """`text` in at most `width` characters, an ellipsis standing for what is cut."""
    if len(text) <= width:
        return text
    return text[: width - 1] + "\u2026" if keep == "head" else "\u2026" + text[-(width - 1) :]


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
