"""config/grafana/nodeagent.json: importable as it is, and every query asks for series the
collector exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent.metrics.families import FAMILIES

DASHBOARD = Path(__file__).resolve().parents[2] / "config" / "grafana" / "nodeagent.json"
DS = "${DS_PROMETHEUS}"
PROMTOOL = Path(sys.executable).with_name("promtool")
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*", "$tenant": ".*"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", [])]
    variables = [v["query"]["query"] for v in dashboard["templating"]["list"]]
    return exprs + variables


def test_importable_with_a_prometheus_input(dashboard: dict[str, Any]) -> None:
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    (source,) = dashboard["__inputs"]
    assert source["name"] == "DS_PROMETHEUS"
    assert (source["type"], source["pluginId"]) == ("datasource", "prometheus")
    assert dashboard["uid"] and dashboard["title"]
    for p in panels(dashboard["panels"]):
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": DS}, p["title"]
            assert p["targets"], p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == DS
    for v in dashboard["templating"]["list"]:
        assert v["datasource"]["uid"] == DS


def test_panel_ids_are_unique_and_the_grid_does_not_overlap(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
    assert all(isinstance(i, int) for i in ids)
    taken: set[tuple[int, int]] = set()
    for p in panels(dashboard["panels"]):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells
    refs = [[t["refId"] for t in p.get("targets", [])] for p in panels(dashboard["panels"])]
    assert all(len(r) == len(set(r)) for r in refs)


def test_every_query_asks_for_exported_series(dashboard: dict[str, Any]) -> None:
    exported = {name for f in FAMILIES for name in f.series()}
    asked = {m for q in queries(dashboard) for m in re.findall(r"\bnodeagent_\w+", q)}
    assert asked - exported == set()
    shown = {
        "nodeagent_tenant_target_share_ratio",
        "nodeagent_tenant_achieved_share_ratio",
        "nodeagent_workload_cpu_throttled_ratio",
        "nodeagent_workload_cpu_psi_some_avg10_ratio",
        "nodeagent_workload_memory_psi_some_avg10_ratio",
        "nodeagent_tick_duration_seconds_bucket",
        "nodeagent_ticks_total",
        "nodeagent_skipped_cgroups",
        "nodeagent_cgroup_writes_total",
        "nodeagent_deadline_slack_seconds",
        "nodeagent_deadline_misses_total",
        "nodeagent_protection_cap_cores",
    }
    assert shown <= asked


def test_every_query_is_valid_promql(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """promtool parses each query as a recording rule, Grafana's variables filled in."""
    if not PROMTOOL.exists():
        pytest.skip(f"no {PROMTOOL}: ./scripts/test installs it")
    rules = []
    for i, query in enumerate(queries(dashboard)):
        expr = query
        if expr.startswith("label_values("):  # Grafana's: its first argument is PromQL
            expr = expr.removeprefix("label_values(").rsplit(",", 1)[0]
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"dashboard:query{i}", "expr": expr})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    check = subprocess.run(
        [str(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr
