"""config/grafana/nodeagent.json: importable as it is, every query asks for series the
collector exports, and every panel shows each agent on its own: its queries run through
promtool over the scrapes of several agents (fleet.py), one of them stalled."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fleet
import pytest
import yaml
from promseries import JOB, PROMTOOL, SCRAPE, at, promtool_test

from nodeagent.metrics.families import FAMILIES

DASHBOARD = Path(__file__).resolve().parents[2] / "config" / "grafana" / "nodeagent.json"
DS = "${datasource}"
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": ".*", "$instance": ".*", "$tenant": ".*"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) for every query of every panel."""
    return [(p["title"], t) for p in panels(dashboard["panels"]) for t in p.get("targets", [])]


def queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for _, t in targets(dashboard)]
    variables = [
        v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"
    ]
    return exprs + variables


def filled(expr: str) -> str:
    """A query as Grafana sends it, every variable at All."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def test_importable_with_a_datasource_variable(dashboard: dict[str, Any]) -> None:
    """A datasource variable rather than an import-time input: the same file imports
    through the UI and through provisioning, and switches between Prometheus servers."""
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert "__inputs" not in dashboard
    (source,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert (source["name"], source["query"]) == ("datasource", "prometheus")
    assert dashboard["uid"] and dashboard["title"]
    for p in panels(dashboard["panels"]):
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": DS}, p["title"]
            assert p["targets"], p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == DS
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"]["uid"] == DS


def test_every_legend_names_the_agent(dashboard: dict[str, Any]) -> None:
    """Several nodes on one dashboard: a series without its instance reads as another
    node's (two nodes run the same cgroup names)."""
    for title, t in targets(dashboard):
        assert "{{instance}}" in t.get("legendFormat", ""), title
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "instance", "tenant"} <= names
    (up,) = [t["expr"] for _, t in targets(dashboard) if t["expr"].startswith("up{")]
    assert 'job=~"$job"' in up


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
    exported = {name for f in FAMILIES for name in f.series()} | {"up"}
    asked = {m for q in queries(dashboard) for m in re.findall(r"\b(?:nodeagent_\w+|up)\b", q)}
    assert asked - exported == set()
    shown = {
        "nodeagent_tenant_target_share_ratio",
        "nodeagent_tenant_achieved_share_ratio",
        "nodeagent_workload_cpu_throttled_periods_total",
        "nodeagent_workload_cpu_periods_total",
        "nodeagent_workload_cpu_pressure_some_seconds_total",
        "nodeagent_workload_memory_pressure_some_seconds_total",
        "nodeagent_workload_cpu_psi_some_avg10_ratio",
        "nodeagent_last_tick_timestamp_seconds",
        "nodeagent_config_last_reload_successful",
        "nodeagent_build_info",
        "nodeagent_gpu_violating_processes",
        "up",
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
    assert PROMTOOL.exists(), f"no {PROMTOOL}: ./scripts/test installs it"
    rules = []
    for i, query in enumerate(queries(dashboard)):
        expr = query
        if expr.startswith("label_values("):  # Grafana's: its first argument is PromQL
            expr = expr.removeprefix("label_values(").rsplit(",", 1)[0]
        rules.append({"record": f"dashboard:query{i}", "expr": filled(expr)})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    check = subprocess.run(
        [str(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.fixture(scope="module")
def fleet_series(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return fleet.fleet_series(tmp_path_factory.mktemp("fleet"))


def test_every_panel_shows_each_agent_on_its_own(
    dashboard: dict[str, Any], fleet_series: list[dict[str, str]], tmp_path: Path
) -> None:
    """Each panel's queries over the scrapes of three agents (node-b stalled, node-c down):
    every one answers for each agent that is up, by its instance, so that no agent is
    summed into, or hidden by, the others (node-c shows in the up panel, as down)."""
    up = [fleet.A, fleet.B]
    end = at(fleet.STEPS - 1)
    tests: list[dict[str, Any]] = []
    for _, t in targets(dashboard):
        tests.append(
            {
                "expr": f"group by (instance) ({filled(t['expr'])}) and on (instance) (up == 1)",
                "eval_time": end,
                "exp_samples": [{"labels": f'{{instance="{i}"}}', "value": 1} for i in up],
            }
        )
    (query,) = [t["expr"] for _, t in targets(dashboard) if t["expr"].startswith("up{")]
    updown = [(fleet.A, 1), (fleet.B, 1), (fleet.C, 0)]
    tests.append(
        {
            "expr": filled(query),
            "eval_time": end,
            "exp_samples": [
                {"labels": f'up{{instance="{i}", job="{JOB}"}}', "value": v} for i, v in updown
            ],
        }
    )
    promtool_test(tmp_path, fleet_series, {"promql_expr_test": tests})


def test_a_stalled_agent_shows_as_stale(
    dashboard: dict[str, Any], fleet_series: list[dict[str, str]], tmp_path: Path
) -> None:
    """node-b's loop stopped after its tick at STALL - 1 while its endpoint still answers;
    node-a ticked a moment ago. "Last tick" shows both, node-b's 615 s old: a max() over
    the nodes showed node-a's 0 alone."""
    (query,) = [t["expr"] for title, t in targets(dashboard) if title == "Last tick"]
    last_b = (fleet.STALL - 1) * SCRAPE
    expected = [(fleet.A, 0), (fleet.B, fleet.END - last_b)]
    assert expected[1][1] == 615
    test = {
        "expr": filled(query),
        "eval_time": at(fleet.STEPS - 1),
        "exp_samples": [
            {"labels": f'{{instance="{i}", job="{JOB}"}}', "value": v} for i, v in expected
        ],
    }
    promtool_test(tmp_path, fleet_series, {"promql_expr_test": [test]})
