"""Scrapes as promtool's input series, and promtool's tests run over them.

Shared by the simulated fleet (fleet.py: in-process collectors) and the two real daemons
(test_dashboard_two_daemons.py): a scrape's exposition text parsed back and labelled with
job and instance, as Prometheus labels what it scrapes, each scrape at a step of SCRAPE
seconds on promtool's clock (which starts at 0); a series gone from a scrape gets a
staleness marker, as Prometheus writes one.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

PROMTOOL = Path(sys.executable).with_name("promtool")
JOB = "nodeagent"
"""The scrape job's name: the shipped alert rules ask for up{job="nodeagent"}."""
SCRAPE = 15
"""Seconds between scrapes on promtool's clock (Prometheus's default scrape_interval)."""

Series = dict[str, list[float | None]]
"""Each series (in promtool's notation) and its value at each scrape, None where it had none."""


def at(step: int) -> str:
    """A scrape's time, as promtool's eval_time takes it."""
    return f"{step * SCRAPE}s"


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample of an exposition text, as Prometheus reads it."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, dict(s.labels), s.value


def put(
    series: Series, steps: int, step: int, name: str, labels: Mapping[str, str], v: float
) -> None:
    """One sample of a scrape at `step` (of `steps`)."""
    series.setdefault(notation(name, labels), [None] * steps)[step] = v


def notation(name: str, labels: Mapping[str, str]) -> str:
    inner = ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def values(points: list[float | None]) -> str:
    """promtool's series values: a sample, `stale` where one went, `_` where none is."""
    out, last = [], None
    for v in points:
        if v is None:
            out.append("stale" if last is not None else "_")
        elif math.isnan(v):
            out.append("NaN")
        elif math.isinf(v):
            out.append("Inf" if v > 0 else "-Inf")
        else:
            out.append(repr(v))
        last = v
    return " ".join(out)


def input_series(series: Series) -> list[dict[str, str]]:
    """`series` as promtool's input_series."""
    return [{"series": name, "values": values(points)} for name, points in sorted(series.items())]


def alert_annotations(rule: Mapping[str, Any], labels: Mapping[str, str]) -> dict[str, str]:
    """An alert rule's annotations as Prometheus renders them (the shipped ones only use
    $labels), for an alert with `labels`."""
    return {
        k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m[1]], v)
        for k, v in rule["annotations"].items()
    }


def promtool_test(
    tmp: Path,
    series: list[dict[str, str]],
    test: Mapping[str, Any],
    rule_files: Sequence[Path] = (),
) -> str:
    """Run one promtool test group over `series` (input_series'); its output, on success."""
    assert PROMTOOL.exists(), f"no {PROMTOOL}: ./scripts/test installs it"
    group = {"name": "scrapes", "interval": f"{SCRAPE}s", "input_series": series}
    spec = {
        "rule_files": [str(p) for p in rule_files],
        "evaluation_interval": f"{SCRAPE}s",
        "tests": [{**group, **test}],
    }
    path = tmp / "test.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False, width=1 << 20))
    run = subprocess.run(
        [str(PROMTOOL), "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout
