"""Plain-text tables for the CLI: aligned columns, no colour, safe to grep and paste."""

from __future__ import annotations

from collections.abc import Sequence

from nodeagent.cgroupfs.values import Attribute

SHOWN = (Attribute.CPU_WEIGHT, Attribute.CPU_MAX, Attribute.MEMORY_MAX, Attribute.MEMORY_HIGH)
"""The attributes that allocations and explain show, in their column order."""


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def change(current: str | None, target: str | None) -> str:
    """'333' when applied, '100->333' when the kernel still holds another value, '-' when unset."""
    if target is None:
        return current or "-"
    if current == target:
        return target
    return f"{current or '?'}->{target}"


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
