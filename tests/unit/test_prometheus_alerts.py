"""config/prometheus/nodeagent-alerts.yaml: valid rules (promtool check rules) on series
the collector exports, and each alert fires for the agent it is about, and only for it,
over the scrapes of three agents (fleet.py: node-b stalls and fails, node-c goes down)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import fleet
import pytest
import yaml
from promseries import JOB, PROMTOOL, alert_annotations, at, promtool_test

from nodeagent.metrics.families import FAMILIES

RULES = Path(__file__).resolve().parents[2] / "config" / "prometheus" / "nodeagent-alerts.yaml"
WEIGHT = {"attribute": "cpu.weight"}
CASES: list[tuple[str, int, list[dict[str, str]]]] = [
    # (alert, at scrape, the labels of each alert firing then, beyond job and severity)
    ("NodeagentDown", fleet.DOWN + 6, []),  # pending: down for 1.5 of its 5 minutes
    ("NodeagentDown", fleet.STEPS - 1, [{"instance": fleet.C}]),
    ("NodeagentTickStale", fleet.STALL + 4, []),  # 90 s since its last tick
    ("NodeagentTickStale", fleet.STEPS - 1, [{"instance": fleet.B}]),
    ("NodeagentCgroupWritesFailing", fleet.FAIL + 30, [{"instance": fleet.B, **WEIGHT}]),
    ("NodeagentCgroupWritesFailing", fleet.STEPS - 1, []),  # none in the last 10 minutes
    ("NodeagentDeadlineMissed", fleet.MISS - 1, []),
    ("NodeagentDeadlineMissed", fleet.STEPS - 1, [{"instance": fleet.B}]),
    ("NodeagentGpuViolation", fleet.STEPS - 1, [{"instance": fleet.B, "kind": "unassigned"}]),
    ("NodeagentConfigReloadFailed", fleet.RELOAD - 1, []),
    ("NodeagentConfigReloadFailed", fleet.STEPS - 1, [{"instance": fleet.B}]),
    ("NodeagentPeerDown", fleet.PEER + 4, []),  # pending: down for 1 of its 5 minutes
    ("NodeagentPeerDown", fleet.STEPS - 1,
     [{"instance": fleet.A, "peer": "containerd", "address": fleet.CONTAINERD}]),
]  # fmt: skip


@pytest.fixture(scope="module")
def rules() -> dict[str, dict[str, Any]]:
    (group,) = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r for r in group["rules"]}


def test_promtool_checks_the_rules(rules: dict[str, dict[str, Any]]) -> None:
    check = subprocess.run(
        [str(PROMTOOL), "check", "rules", str(RULES)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    exported = {name for f in FAMILIES for name in f.series()} | {"up"}
    for name, rule in rules.items():
        asked = set(re.findall(r"\b(?:nodeagent_\w+|up)\b(?=\s*[{\[)]|\s*$|\s)", rule["expr"]))
        assert asked and asked <= exported, (name, asked - exported)
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert {"summary", "description"} <= set(rule["annotations"]), name


def test_each_alert_fires_for_its_agent_only(
    rules: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    assert {alert for alert, _, firing in CASES if firing} == set(rules), "an alert untested"
    tests = []
    for alert, step, firing in CASES:
        expected = []
        for extra in firing:
            labels = {"job": JOB, "severity": rules[alert]["labels"]["severity"], **extra}
            rendered = alert_annotations(rules[alert], {**labels, "alertname": alert})
            expected.append({"exp_labels": labels, "exp_annotations": rendered})
        tests.append({"alertname": alert, "eval_time": at(step), "exp_alerts": expected})
    series = fleet.fleet_series(tmp_path)
    promtool_test(tmp_path, series, {"alert_rule_test": tests}, rule_files=[RULES])
