"""What every command's output shares: counted nouns, and the width tables fit."""

from __future__ import annotations

import shutil


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 tenant', '2 tenants', '0 rules'."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def terminal_width() -> int | None:
    """The width tables are fitted to: COLUMNS, else the terminal's on stdout; None when
    stdout is a pipe or a file without COLUMNS (it gets whole lines)."""
    columns = shutil.get_terminal_size((0, 0)).columns
    return columns if columns > 0 else None
