"""What every command's output shares: counted nouns in its text."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 tenant', '2 tenants', '0 rules'."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
