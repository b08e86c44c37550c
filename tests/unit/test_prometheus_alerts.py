"""config/prometheus/nodeagent-alerts.yaml: valid rules (promtool check rules --lint=all)
on series the collector exports, each with a runbook (a section of docs/metrics.md), and
each alert fires for the agent it is about, and only for it, over the scrapes of four
agents (fleet.py: node-b stalls and fails, node-c goes down, node-d drops out of the
targets); NodeagentAbsent over targets that all drop out."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import fleet
import pytest
import yaml
from promseries import (
    JOB,
    PROMTOOL,
    Series,
    alert_annotations,
    at,
    input_series,
    promtool_test,
    put,
)
from test_docs_links import anchors

from nodeagent.metrics.families import FAMILIES

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "config" / "prometheus" / "nodeagent-alerts.yaml"
RUNBOOKS = REPO / "docs" / "metrics.md"
WEIGHT = {"attribute": "cpu.weight"}
CASES: list[tuple[str, int, list[dict[str, str]]]] = [
    # (alert, at scrape, the labels of each alert firing then, beyond job and severity)
    ("NodeagentDown", fleet.DOWN + 6, []),  # pending: down for 1.5 of its 5 minutes
    ("NodeagentDown", fleet.STEPS - 1, [{"instance": fleet.C}]),  # not node-d: no `up`
    ("NodeagentMissing", fleet.GONE + 10, []),  # pending: gone for 2.5 of its 5 minutes
    ("NodeagentMissing", fleet.STEPS - 1, [{"instance": fleet.D}]),  # not node-c: down
    ("NodeagentAbsent", fleet.STEPS - 1, []),  # the other three are targets
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


ABSENT_STEPS, ABSENT_GONE = 30, (4, 8)
"""Two targets scraped for 30 scrapes, each dropping out of the targets at its step."""
ABSENT_CASES: list[tuple[str, int, list[dict[str, str]]]] = [
    ("NodeagentMissing", ABSENT_GONE[0] + 3, []),  # pending: node-a gone for 45 s
    ("NodeagentAbsent", ABSENT_GONE[1] + 19, []),  # pending: no target for 4.75 minutes
    ("NodeagentAbsent", ABSENT_STEPS - 1, [{}]),
    ("NodeagentMissing", ABSENT_STEPS - 1, []),  # every target gone: NodeagentAbsent alone
]  # fmt: skip


@pytest.fixture(scope="module")
def rules() -> dict[str, dict[str, Any]]:
    (group,) = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r for r in group["rules"]}


def test_promtool_checks_the_rules(rules: dict[str, dict[str, Any]]) -> None:
    check = subprocess.run(
        [str(PROMTOOL), "check", "rules", "--lint=all", "--lint-fatal", str(RULES)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules)} rules found" in check.stdout, check.stdout
    exported = {name for f in FAMILIES for name in f.series()} | {"up"}
    for name, rule in rules.items():
        asked = set(re.findall(r"\b(?:nodeagent_\w+|up)\b(?=\s*[{\[)]|\s*$|\s)", rule["expr"]))
        assert asked and asked <= exported, (name, asked - exported)
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"]), name


def test_every_alert_has_a_runbook_in_the_docs(rules: dict[str, dict[str, Any]]) -> None:
    """runbook_url is docs/metrics.md#<the alert's name in lower case>, relative to the
    source tree's root as README.md's links are: a heading of that page (GitHub's slug),
    whose section says what the alert means, what to check and what to do."""
    text = RUNBOOKS.read_text()
    assert set(re.findall(r"(?m)^### (Nodeagent\w+)$", text)) == set(rules), "a runbook per alert"
    for name, rule in rules.items():
        url = rule["annotations"]["runbook_url"]
        assert url == f"docs/metrics.md#{name.lower()}", name
        assert url.partition("#")[2] in anchors(RUNBOOKS), name
        section = text.split(f"\n### {name}\n", 1)[1].split("\n#", 1)[0]
        for part in ("**Means.**", "**Check.**", "**Do.**"):
            assert part in section, (name, part)


def _expected(
    rules: dict[str, dict[str, Any]], cases: list[tuple[str, int, list[dict[str, str]]]]
) -> list[dict[str, Any]]:
    """promtool's alert_rule_test for `cases`: each alert's labels and its annotations as
    Prometheus renders them (runbook_url among them), for each alert firing at its step."""
    tests = []
    for alert, step, firing in cases:
        expected = []
        for extra in firing:
            labels = {"job": JOB, "severity": rules[alert]["labels"]["severity"], **extra}
            rendered = alert_annotations(rules[alert], {**labels, "alertname": alert})
            assert rendered["runbook_url"], alert
            expected.append({"exp_labels": labels, "exp_annotations": rendered})
        tests.append({"alertname": alert, "eval_time": at(step), "exp_alerts": expected})
    return tests


def test_each_alert_fires_for_its_agent_only(
    rules: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    fire = {alert for alert, _, firing in CASES + ABSENT_CASES if firing}
    assert fire == set(rules), "an alert untested"
    series = fleet.fleet_series(tmp_path)
    promtool_test(tmp_path, series, {"alert_rule_test": _expected(rules, CASES)}, [RULES])


def test_absent_fires_once_when_every_target_is_gone(
    rules: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Two targets drop out of discovery one after the other: NodeagentMissing is pending
    for the first while the second is a target, and once both are gone NodeagentAbsent
    fires, alone (not one NodeagentMissing per node besides)."""
    series: Series = {}
    for node, gone in zip(("node-a:9400", "node-b:9400"), ABSENT_GONE, strict=True):
        for step in range(gone):
            put(series, ABSENT_STEPS, step, "up", {"job": JOB, "instance": node}, 1)
    tests = _expected(rules, ABSENT_CASES)
    promtool_test(tmp_path, input_series(series), {"alert_rule_test": tests}, [RULES])
