"""What ./scripts/test prints about a pytest run from the files the run leaves behind.

    junit_report.py counts XML              "TESTS PASSED FAILED SKIPPED" (errors count as failed)
    junit_report.py slowest N XML...        the N slowest tests of these JUnit files, slowest first
    junit_report.py progress FILE           where a run that left no JUnit file had got to

A JUnit file is written at the end of a pytest run: a run killed before its end (the VM's
timeout) leaves none. The progress file (tests/kernel/conftest.py writes it as the run goes, to
$NODEAGENT_KERNEL_PROGRESS) still says how far it got and which test was running then.
"""

from __future__ import annotations

import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def _suites(path: Path) -> list[ET.Element]:
    root = ET.parse(path).getroot()  # noqa: S314 (our own pytest's report)
    return [root] if root.tag == "testsuite" else root.findall("testsuite")


def counts(path: Path) -> tuple[int, int, int, int]:
    """Tests, passed, failed (failures and errors), skipped."""
    suites = _suites(path)

    def total(key: str) -> int:
        return sum(int(s.get(key, 0)) for s in suites)

    n, failed, skipped = total("tests"), total("failures") + total("errors"), total("skipped")
    return n, n - failed - skipped, failed, skipped


def slowest(paths: list[Path], n: int) -> list[tuple[float, str, str]]:
    """(seconds, suite, test id) of the n slowest tests; the time is setup, call and teardown."""
    rows = []
    for path in paths:
        suite = path.stem
        for s in _suites(path):
            for case in s.iter("testcase"):
                test = f"{case.get('classname') or '(pytest)'}::{case.get('name') or '(internal)'}"
                rows.append((float(case.get("time", 0)), suite, test))
    rows.sort(key=lambda row: -row[0])
    return rows[:n]


def progress(path: Path) -> str:
    """One line: how many tests ended of how many collected, which failed, and the ones running
    at the end (two at once with two workers)."""
    collected, running, ended, failed = "?", {}, 0, []
    for line in path.read_text(errors="replace").splitlines():
        word, _, rest = line.partition(" ")
        if word == "collected":
            collected = rest
        elif word == "start":
            stamp, _, nodeid = rest.partition(" ")
            running[nodeid] = float(stamp)
        elif word == "end":
            ended += 1
            running.pop(rest, None)
        elif word == "failed":
            failed.append(rest)
    where = f"{ended} of {collected} tests had ended"
    if failed:
        where += f"; {len(failed)} failed: " + "; ".join(failed)
    if not running:
        return f"{where}; none was running"
    now = time.time()
    return f"{where}; running then, " + ", ".join(
        f"for {now - since:.0f} s: {nodeid}" for nodeid, since in running.items()
    )


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "counts":
        print(*counts(Path(argv[1])))
    elif len(argv) >= 3 and argv[0] == "slowest":
        existing = [Path(p) for p in argv[2:] if Path(p).is_file()]
        rows = slowest(existing, int(argv[1]))
        total = sum(seconds for seconds, _, _ in slowest(existing, sys.maxsize))
        files = ", ".join(map(str, existing))
        print(f"the {len(rows)} slowest tests ({files}; {total:.0f} s in all):")
        for seconds, suite, test in rows:
            print(f"  {seconds:8.1f} s  {suite:<7} {test}")
    elif len(argv) == 2 and argv[0] == "progress":
        print(progress(Path(argv[1])))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
