"""Shared pytest hooks for the unit suite."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from policy_fuzz import COUNTS
from readguard import Guarded

from nodeagent.cgroupfs.tree import CgroupDir
from nodeagent.policy import plan
from nodeagent.policy.base import Output, Policy, PolicyInput

# Speed goals live in the benchmarks: on a loaded host one example can take longer than
# hypothesis's default 200 ms deadline (a "flaky" failure that says nothing of the code).
settings.register_profile("nodeagent", deadline=None)
settings.load_profile("nodeagent")

# xdist gives its workers COLUMNS=80 (and LINES): the CLI would fit its tables to 80 columns.
# A test reads the CLI's output as a pipe's, whole lines, as in a serial run (a test of the
# fitted tables sets COLUMNS itself).
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)


@pytest.fixture(autouse=True)
def reads_declared(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every plan a test makes runs its policies on views that refuse what a policy did
    not declare it reads (readguard.py): an undeclared read would let the plan cache keep
    a stale plan, so it fails the test that planned it."""
    refused: list[str] = []
    isolated = plan.decide_isolated

    def decide(policy: Policy, given: PolicyInput) -> tuple[list[Output], Exception | None]:
        return isolated(Guarded(policy, refused), given)

    monkeypatch.setattr(plan, "decide_isolated", decide)
    yield
    assert not refused, f"read but not declared in Policy.reads: {sorted(set(refused))}"


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A directory for a server's socket that an unprivileged child can traverse (pytest's
    tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="nodeagent-sock-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def files_replace_their_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel interface file takes the whole value written; a plain file standing in for
    one must be truncated for that (the tree opens it O_WRONLY)."""
    opened = CgroupDir._open_file

    def open_file(self: CgroupDir, name: str, mode: int) -> int:
        return opened(self, name, mode | os.O_TRUNC if mode & os.O_WRONLY else mode)

    monkeypatch.setattr(CgroupDir, "_open_file", open_file)


@pytest.fixture
def needs_root() -> None:
    """For the tests that chgrp a socket or take on another uid: ./scripts/test runs the
    suite as root; anywhere else they fail saying so, since a skip would prove nothing."""
    if os.geteuid() != 0:
        pytest.fail(
            "needs root to chgrp and setuid: run ./scripts/test unit as root", pytrace=False
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """A unit test must never skip (as tests/kernel/conftest.py holds for the kernel suite):
    a skip is reported as a failure with its reason. FAST=1's `-m "not fuzz"` deselects,
    which is no skip."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"unit tests must never skip, but this one did: {reason}"


# ./scripts/test runs the suite in pytest-xdist workers: each sends its counts to the controller,
# which prints the sum (the summary below runs there).
def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["fuzz_counts"] = [[c, o, n] for (c, o), n in COUNTS.items()]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    for check, outcome, n in getattr(node, "workeroutput", {}).get("fuzz_counts", []):
        COUNTS[check, outcome] += n


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many fuzzed policies ran, and with what outcome: the figure to report."""
    for check in sorted({c for c, _ in COUNTS}):
        outcomes = {o: n for (c, o), n in sorted(COUNTS.items()) if c == check}
        detail = ", ".join(f"{n} {o}" for o, n in outcomes.items())
        terminalreporter.write_line(
            f"fuzzed policies through {check}: {sum(outcomes.values())} ({detail})"
        )


FUZZ_TIMEOUT_S = 900
"""The ceiling of a test marked fuzz, unless it has its own (pyproject.toml gives every other
unit test 180 s): 10,000 policies through the loader took 630 s on this 2-core host with a
load of 12 to 16."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("fuzz") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FUZZ_TIMEOUT_S))
