"""scripts/junit_report.py: what ./scripts/test prints from pytest's JUnit files and from the
kernel suite's progress file (the one trace a run killed before its report leaves)."""

from __future__ import annotations

import time
from pathlib import Path

import junit_report

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="1" tests="7">
<testcase classname="tests.kernel.test_a" name="test_slow" time="301.5"/>
<testcase classname="tests.kernel.test_a" name="test_fast" time="0.2"/>
<testcase classname="tests.kernel.test_b" name="test_mid[x]" time="12.0"/>
</testsuite></testsuites>
"""


def test_counts_take_errors_as_failures(tmp_path: Path) -> None:
    xml = tmp_path / "kernel.xml"
    xml.write_text(REPORT)
    assert junit_report.counts(xml) == (7, 3, 3, 1)


def test_the_slowest_come_first_across_files_named_by_suite(tmp_path: Path) -> None:
    kernel, unit = tmp_path / "kernel.xml", tmp_path / "unit.xml"
    kernel.write_text(REPORT)
    unit.write_text(REPORT.replace("tests.kernel", "tests.unit").replace("301.5", "40"))
    assert junit_report.slowest([kernel, unit], 3) == [
        (301.5, "kernel", "tests.kernel.test_a::test_slow"),
        (40.0, "unit", "tests.unit.test_a::test_slow"),
        (12.0, "kernel", "tests.kernel.test_b::test_mid[x]"),
    ]


def test_a_killed_run_names_the_test_it_was_running(tmp_path: Path) -> None:
    progress = tmp_path / "progress"
    started = time.time() - 42
    progress.write_text(
        "collected 3\n"
        f"start {started - 5:.1f} tests/kernel/test_a.py::test_fast\n"
        "end tests/kernel/test_a.py::test_fast\n"
        f"start {started:.1f} tests/kernel/test_a.py::test_slow\n"
    )
    line = junit_report.progress(progress)
    assert line.startswith("1 of 3 tests had ended; running then, for 4")
    assert line.endswith(" s: tests/kernel/test_a.py::test_slow")


def test_a_run_between_tests_says_none_was_running(tmp_path: Path) -> None:
    progress = tmp_path / "progress"
    progress.write_text("collected 2\nstart 1.0 t::a\nend t::a\n")
    assert junit_report.progress(progress) == "1 of 2 tests had ended; none was running"


def test_two_workers_tests_running_at_once_and_the_failures_so_far_are_all_said(
    tmp_path: Path,
) -> None:
    progress = tmp_path / "progress"
    now = time.time()
    progress.write_text(
        "collected 4\n"
        f"start {now - 90:.1f} t::service\n"
        f"start {now - 60:.1f} t::a\n"
        "end t::a\n"
        "failed t::a (call): assert 1 == 2\n"
        f"start {now - 30:.1f} t::b\n"
    )
    line = junit_report.progress(progress)
    assert line.startswith("1 of 4 tests had ended; 1 failed: t::a (call): assert 1 == 2;")
    assert "running then, for 9" in line and " s: t::service, for 3" in line
    assert line.endswith(" s: t::b")
