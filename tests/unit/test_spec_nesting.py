"""Rules that claim a cgroup and one below it (issue 13.12): validate warns from the rules
alone, `workloads` from what they claim on the tree, and the tenant split counts the
innermost claims only (test_policy_hierarchy.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from nodeagent.cli import main
from nodeagent.policy.base import Assignment
from nodeagent.policy.classify import nested_claims, outer_claims
from nodeagent.policyfile.load import check_text
from nodeagent.policyfile.model import WorkloadClass
from nodeagent.policyfile.yamlfile import Problem

REPO = Path(__file__).resolve().parents[2]
CID = "4f1c2a9be7d3" + "0123456789abcdef" * 3 + "0123"
CID2 = "9a8b7c6d5e4f" + "fedcba9876543210" * 3 + "3210"
POD = "kubepods/besteffort/pod3b1e5f2a-9c4d-4e7f-8a6b-0d2c1e9f7a35"

HEAD = """\
version: 1
tenants:
  research: {shares: 2}
agent:
  managed_root: %s
rules:
"""


def warnings(rules: str, managed_root: str = "nodeagent.slice") -> list[str]:
    """The nesting warnings (at a rule's match), not the others validate gives."""
    got: tuple[Problem, ...] = check_text(HEAD % managed_root + rules, "p.yaml").warnings
    return [str(p) for p in got if re.match(r"rules\[\d+\]\.match: ", p.message)]


def test_a_qos_rule_without_kind_claims_pods_and_their_containers() -> None:
    (line,) = warnings("  - {name: be, match: {qos: besteffort}, tenant: research}\n")
    assert line.startswith("p.yaml:7:23: warning: rules[0].match: can claim a pod (")
    assert "whose containers this rule claims" in line
    assert "kind: container" in line


def test_a_pod_rule_and_a_container_rule_together_nest() -> None:
    rules = (
        "  - {name: ctr, match: {runtime: containerd}, tenant: research}\n"
        "  - {name: pods, match: {kind: pod}, tenant: research}\n"
    )
    (line,) = warnings(rules)
    assert "rules[1].match: can claim a pod" in line
    assert "whose containers rule 'ctr' claims" in line


def test_a_rule_claiming_the_service_that_holds_the_managed_root_nests_over_its_jobs() -> None:
    rules = "  - {name: units, match: {runtime: systemd}, tenant: research}\n"
    (line,) = warnings(rules, "system.slice/nodeagent.service/workloads")
    assert "can claim system.slice/nodeagent.service, which holds the managed root" in line


@pytest.mark.parametrize(
    "rules",
    [
        "  - {name: be, match: {qos: besteffort, kind: container}, tenant: research}\n",
        "  - {name: be, match: {qos: besteffort, kind: pod}, tenant: research}\n"
        "  - {name: j, match: {path: nodeagent.slice/*}, tenant: research}\n",
        "  - {name: jobs, match: {path: nodeagent.slice/*}, tenant: research}\n",
    ],
)
def test_rules_that_cannot_nest_are_not_warned_about(rules: str) -> None:
    assert warnings(rules) == []


@pytest.mark.parametrize(
    "match", ["{labels: {app: web}}", "{image: 'nginx:*'}", "{container_name: web}"]
)
def test_a_rule_on_what_runtimes_say_cannot_claim_the_service_holding_the_managed_root(
    match: str,
) -> None:
    """No runtime describes a systemd unit: the shipped example's compose rule (labels only)
    under the packaged managed root was warned about as claiming the workloads unit."""
    rules = f"  - {{name: web, match: {match}, tenant: research}}\n"
    assert warnings(rules, "system.slice/nodeagent-workloads.service/workloads") == []


def test_a_catch_all_rule_nests() -> None:
    (line,) = warnings("  - {name: all, match: {}, tenant: research}\n")
    assert "rules[0].match: can claim a pod" in line


def test_validate_warns_on_the_old_example_and_passes_on_the_shipped_one(tmp_path: Path) -> None:
    old = tmp_path / "old.yaml"
    old.write_text((REPO / "config/policy.yaml").read_text().replace("      kind: container\n", ""))
    runner = CliRunner()
    result = runner.invoke(main, ["validate", str(old)])
    assert result.exit_code == 0, "a warning, not an error"
    assert result.stdout == f"{old}: ok (2 tenants, 9 rules; 1 warning)\n"
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{old}:")
    assert "warning: rules[3].match: can claim a pod" in line
    shipped = runner.invoke(main, ["validate", str(REPO / "config/policy.yaml")])
    assert (shipped.exit_code, shipped.stderr) == (0, "")


def test_workloads_warns_when_a_claimed_cgroup_has_a_claimed_parent(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    for path in (f"{POD}/{CID}", f"{POD}/{CID2}"):
        (root / path).mkdir(parents=True)
    policy = tmp_path / "p.yaml"
    policy.write_text(
        HEAD % "nodeagent.slice" + "  - {name: be, match: {qos: besteffort}, tenant: research}\n"
    )
    result = CliRunner().invoke(
        main, ["workloads", "--cgroup-root", str(root), "--config", str(policy)]
    )
    assert result.exit_code == 0
    (line,) = [w for w in result.stderr.splitlines() if w.startswith("warning: ")]
    assert line.startswith(f"warning: {POD} (rule be) has 2 claimed cgroup(s) below it")


def test_nested_and_outer_claims() -> None:
    a = Assignment("r", "t", WorkloadClass.BATCH)
    claimed = {p: a for p in ("a", "a/b", "a/b/c", "a/x/d", "ab/c", "e")}
    assert nested_claims(claimed) == {"a/b": "a", "a/b/c": "a/b", "a/x/d": "a"}
    assert outer_claims(claimed) == {"a", "a/b"}


def test_a_rule_naming_a_pod_is_tried_on_that_pod() -> None:
    uid = "0b6a1b3e-6f3c-4a57-9b8e-2d6a3f1e9c11"
    rules = (
        f"  - {{name: one, match: {{pod_uid: {uid}, kind: pod}}, tenant: research}}\n"
        f"  - {{name: ctr, match: {{pod_uid: {uid}, kind: container}}, tenant: research}}\n"
    )
    (line,) = warnings(rules)
    assert "rules[0].match: can claim a pod" in line and uid.replace("-", "_") in line
