"""Every `scripts/bench NAME` honours --json: one JSON object on stdout, the table elsewhere
(issue 5, item 15: `bench tick --json` printed the table)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
BENCHMARKS = sorted(SCRIPTS.glob("bench_*.py"))
TOY = """
import sys
sys.path.insert(0, {scripts!r})
from benchkit import Bench
with Bench("toy", "A toy benchmark.") as bench:
    bench.say("rows  2")
    bench.figures["rows"] = 2
    bench.progress("half way")
"""


def toy(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = TOY.format(scripts=str(SCRIPTS))
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, check=True
    )


def test_with_json_stdout_is_one_object_with_the_figures(tmp_path: Path) -> None:
    done = toy("--json", "--out", str(tmp_path), cwd=tmp_path)
    figures = json.loads(done.stdout)  # the whole of stdout, nothing else
    assert figures["benchmark"] == "toy" and figures["rows"] == 2
    assert "rows  2" in done.stderr and "half way" in done.stderr
    assert json.loads((tmp_path / "toy.json").read_text()) == figures
    assert "rows  2" in (tmp_path / "toy.txt").read_text()


def test_without_json_stdout_is_the_table(tmp_path: Path) -> None:
    done = toy(cwd=tmp_path)
    assert "rows  2" in done.stdout and "{" not in done.stdout


@pytest.mark.parametrize("script", BENCHMARKS, ids=[s.stem for s in BENCHMARKS])
def test_every_benchmark_takes_json(script: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script), "--help"],
        capture_output=True,
        text=True,
        cwd=SCRIPTS,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--json" in done.stdout, f"{script.name} --help does not offer --json"
