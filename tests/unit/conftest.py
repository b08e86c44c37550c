"""Shared pytest hooks for the unit suite."""

from __future__ import annotations

import pytest
from policy_fuzz import COUNTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many fuzzed policies ran, and with what outcome: the figure to report."""
    for check in sorted({c for c, _ in COUNTS}):
        outcomes = {o: n for (c, o), n in sorted(COUNTS.items()) if c == check}
        detail = ", ".join(f"{n} {o}" for o, n in outcomes.items())
        terminalreporter.write_line(
            f"fuzzed policies through {check}: {sum(outcomes.values())} ({detail})"
        )
