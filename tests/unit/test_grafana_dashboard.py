"""config/grafana/nodeagent.json: importable as it is, every query asks for series the
collector exports; the fleet row counts nodes up, down and gone, the worst tick age, peers
down and refused reloads; the top-10 panels show at most ten series whatever the fleet's
size; and every per-node panel shows each agent it is asked for on its own. The queries
run through promtool over the scrapes of four agents (fleet.py: one stalled, one down, one
dropped out of the targets), and over the same agent copied to 100 nodes."""

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
FLEET_ROWS = ("Fleet", "Top 10: the worst nodes and workloads now")
"""The rows over every node of the job; the rows after them show the nodes `instance` picks."""
TOP = re.compile(r"sort(_desc)?\((top|bottom)k\(10, ")
SELECTOR = re.compile(r"\b(?:nodeagent_\w+|up)\b(\{[^}]*\})?")


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


def rows(dashboard: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The panels under each row, by the row's title."""
    out: dict[str, list[dict[str, Any]]] = {}
    title = ""
    for p in panels(dashboard["panels"]):
        if p["type"] == "row":
            title = p["title"]
            out[title] = []
        else:
            out[title].append(p)
    return out


def fleet_targets(dashboard: dict[str, Any], row: str) -> list[tuple[str, dict[str, Any]]]:
    return [(p["title"], t) for p in rows(dashboard)[row] for t in p["targets"]]


def node_targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) of the per-node rows."""
    return [
        (p["title"], t)
        for row, ps in rows(dashboard).items()
        if row not in FLEET_ROWS
        for p in ps
        for t in p["targets"]
    ]


def queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for _, t in targets(dashboard)]
    variables = [
        v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"
    ]
    return exprs + variables


def filled(expr: str, instance: str = ".*") -> str:
    """A query as Grafana sends it, every variable at All but the node, `instance`."""
    for variable, value in {**GRAFANA_VARIABLES, "$instance": instance}.items():
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
    node's (two nodes run the same cgroup names). The fleet row's counts are of nodes, and
    name none."""
    assert list(rows(dashboard))[: len(FLEET_ROWS)] == list(FLEET_ROWS)
    for title, t in fleet_targets(dashboard, FLEET_ROWS[1]) + node_targets(dashboard):
        assert "{{instance}}" in t.get("legendFormat", ""), title
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "instance", "tenant"} <= names
    (up,) = [t["expr"] for _, t in targets(dashboard) if t["expr"].startswith("up{")]
    assert 'job=~"$job"' in up


def test_the_fleet_rows_ask_every_node_and_the_rest_the_chosen_ones(
    dashboard: dict[str, Any],
) -> None:
    """For 100 nodes: the node selector has no All (a per-node panel draws the nodes
    picked, the first by default, not every node times every cgroup); every selector of a
    per-node query asks for $instance, and none of the fleet rows' does; the top-10 panels
    are instant topk(10) or bottomk(10), sorted, so each draws ten bars at most."""
    (node,) = [v for v in dashboard["templating"]["list"] if v["name"] == "instance"]
    assert node["includeAll"] is False and node["multi"] is True
    for row in FLEET_ROWS:
        for title, t in fleet_targets(dashboard, row):
            for selector in SELECTOR.finditer(t["expr"]):
                assert 'job=~"$job"' in (selector[1] or ""), (title, selector[0])
            assert "$instance" not in t["expr"], title
    for title, t in fleet_targets(dashboard, FLEET_ROWS[1]):
        assert TOP.match(t["expr"]) and t["instant"] is True, title
    for title, t in node_targets(dashboard):
        for selector in SELECTOR.finditer(t["expr"]):
            assert 'instance=~"$instance"' in (selector[1] or ""), (title, selector[0])


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
    """Each per-node panel's queries over the scrapes of four agents (node-b stalled,
    node-c down, node-d gone): with every node picked, every one answers for each agent
    that is up, by its instance, so that no agent is summed into, or hidden by, the others
    (node-c shows in the up panel, as down); with node-a picked, for node-a alone."""
    up = [fleet.A, fleet.B]
    end = at(fleet.STEPS - 1)
    tests: list[dict[str, Any]] = []
    for _, t in node_targets(dashboard):
        for instance, shown in ((".*", up), (fleet.A, [fleet.A])):
            expr = filled(t["expr"], instance)
            tests.append(
                {
                    "expr": f"group by (instance) ({expr}) and on (instance) (up == 1)",
                    "eval_time": end,
                    "exp_samples": [{"labels": f'{{instance="{i}"}}', "value": 1} for i in shown],
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
    the nodes showed node-a's 0 alone. The fleet row's worst tick age is node-b's, and
    the oldest last tick of the top 10 lists node-b first."""
    (query,) = [t["expr"] for title, t in targets(dashboard) if title == "Last tick"]
    (oldest,) = [t["expr"] for t in targets_titled(dashboard, "Oldest last tick (10 nodes)")]
    last_b = (fleet.STALL - 1) * SCRAPE
    expected = [(fleet.A, 0), (fleet.B, fleet.END - last_b)]
    assert expected[1][1] == 615
    samples = [{"labels": f'{{instance="{i}", job="{JOB}"}}', "value": v} for i, v in expected]
    end = at(fleet.STEPS - 1)
    tests = [
        {"expr": filled(query), "eval_time": end, "exp_samples": samples},
        {"expr": filled(oldest), "eval_time": end, "exp_samples": samples},
    ]
    promtool_test(tmp_path, fleet_series, {"promql_expr_test": tests})


def targets_titled(dashboard: dict[str, Any], title: str) -> list[dict[str, Any]]:
    return [t for name, t in targets(dashboard) if name == title]


FLEET_AT: dict[int, dict[str, float]] = {
    # scrape: panel -> its value then; node-b's writes fail from FAIL, it stalls at STALL
    fleet.STALL - 1: {
        "Nodes up": 4, "Nodes down": 0, "Nodes gone (1d)": 0, "Worst tick age": 0,
        "Nodes with peers down": 0, "Reload failures": 0, "Nodes ticking late": 0,
        "Nodes failing writes (1h)": 1, "Versions": 4, "Policies in force": 4,
    },
    # node-b 615 s since its last tick, its reload refused; node-c down; node-d gone;
    # node-a's containerd down
    fleet.STEPS - 1: {
        "Nodes up": 2, "Nodes down": 1, "Nodes gone (1d)": 1, "Worst tick age": 615,
        "Nodes with peers down": 1, "Reload failures": 1, "Nodes ticking late": 1,
        "Nodes failing writes (1h)": 1, "Versions": 2, "Policies in force": 2,
    },
}  # fmt: skip


def test_the_fleet_row_counts_the_nodes(
    dashboard: dict[str, Any], fleet_series: list[dict[str, str]], tmp_path: Path
) -> None:
    """Each fleet panel is one figure for every node of the job (versions and policies,
    one per version and policy: their sum here), at a scrape where node-b's writes fail
    and at the last, where each of the four agents has gone wrong its own way."""
    fleet_row = fleet_targets(dashboard, FLEET_ROWS[0])
    assert {title for title, _ in fleet_row} == set(FLEET_AT[fleet.STEPS - 1])
    tests = [
        {
            "expr": f"sum({filled(t['expr'])})",
            "eval_time": at(step),
            "exp_samples": [{"labels": "{}", "value": values[title]}],
        }
        for step, values in FLEET_AT.items()
        for title, t in fleet_row
    ]
    promtool_test(tmp_path, fleet_series, {"promql_expr_test": tests})


NODES, KEPT = 100, 8
"""Nodes, and the scrapes of each kept (the last 2 minutes: a rate's window, 1m, holds
four), so that promtool reads 100 nodes' series in seconds."""


def copied(series: list[dict[str, str]], asked: set[str], nodes: int) -> list[dict[str, str]]:
    """node-a's scrapes of the series `asked` for, the last KEPT of them, as those of
    `nodes` nodes (node-000:9400, ...), each its own target."""
    mine = [
        {**s, "values": f"_x{fleet.STEPS - KEPT} " + " ".join(s["values"].split()[-KEPT:])}
        for s in series
        if f'instance="{fleet.A}"' in s["series"] and s["series"].split("{")[0] in asked
    ]
    return [
        {**s, "series": s["series"].replace(fleet.A, f"node-{n:03}:9400")}
        for n in range(nodes)
        for s in mine
    ]


def test_a_hundred_nodes(
    dashboard: dict[str, Any], fleet_series: list[dict[str, str]], tmp_path: Path
) -> None:
    """100 nodes: the fleet row counts 100 up, each top-10 panel answers ten series however
    many nodes and workloads there are, and a per-node panel with one node picked answers
    for that node alone."""
    asked = {m for q in queries(dashboard) for m in re.findall(r"\b(?:nodeagent_\w+|up)\b", q)}
    series = copied(fleet_series, asked, NODES)
    end = at(fleet.STEPS - 1)
    (up,) = targets_titled(dashboard, "Nodes up")
    tests: list[dict[str, Any]] = [
        {"expr": filled(up["expr"]), "eval_time": end, "exp_samples": [{"value": NODES}]}
    ]
    for title, t in fleet_targets(dashboard, FLEET_ROWS[1]):
        if title == "Failed writes, 1h (10 nodes)":
            continue  # node-a's writes never fail
        tests.append(
            {
                "expr": f"count({filled(t['expr'])})",
                "eval_time": end,
                "exp_samples": [{"labels": "{}", "value": 10}],
            }
        )
    picked = "node-042:9400"
    for _, t in node_targets(dashboard):
        expr = filled(t["expr"], picked)
        tests.append(
            {
                "expr": f"group by (instance) ({expr}) and on (instance) (up == 1)",
                "eval_time": end,
                "exp_samples": [{"labels": f'{{instance="{picked}"}}', "value": 1}],
            }
        )
    promtool_test(tmp_path, series, {"promql_expr_test": tests})
