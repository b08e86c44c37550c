"""Strict types in the policy (issue 5, items 4 and 10): booleans, floats and bytes are never
taken for numbers, whole numbers or strings, and every bound is stated and accepted."""

from __future__ import annotations

import math
import re

import pytest
from builders import plan_claimed, policy_input, snapshot, workload

from nodeagent.cgroupfs.values import Attribute, CpuWeight
from nodeagent.policy.base import Share
from nodeagent.policy.fairshare import FairShare
from nodeagent.policyfile.load import check_text
from nodeagent.policyfile.model import HALF_LIFE_MAX, SHARES_MAX, SHARES_MIN, PolicySpec
from nodeagent.policyfile.units import MAX_SIZE, parse_size
from nodeagent.policyfile.yamlfile import PolicyError

HEAD = "version: 1\ntenants:\n  research: {shares: 2}\n  prod: {shares: 1}\n"
RULE = "rules:\n  - {name: r, match: {}, tenant: prod}\n"
BINARY = "!!binary cHJvZA=="  # b"prod"


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        check_text(text, "p.yaml")
    return [p.message for p in info.value.problems]


# Item 4: shares are bounded so that the fair-share arithmetic is always defined


def test_a_tiny_share_beside_a_huge_one_is_refused_with_the_range() -> None:
    text = "version: 1\ntenants:\n  big: {shares: 1000000}\n  tiny: {shares: 1e-320}\n"
    assert problems(text) == [
        "tenants.tiny.shares: must be greater than or equal to 0.001 and less than or equal to"
        " 1000000, got '1e-320'"  # YAML 1.1 reads 1e-320 as a string; it is taken as a number
    ]


@pytest.mark.parametrize("shares", ["0.0009", "0", "-1", "1000000.5", "1e7", "9" * 400])
def test_shares_out_of_range(shares: str) -> None:
    [message] = problems(f"version: 1\ntenants:\n  a: {{shares: {shares}}}\n")
    assert message.startswith(
        "tenants.a.shares: must be greater than or equal to 0.001 and less than or equal to"
        " 1000000, got "
    )


EXTREMES = (
    f"version: 1\ntenants:\n  big: {{shares: {SHARES_MAX:g}}}\n  tiny: {{shares: {SHARES_MIN:g}}}\n"
    "rules:\n"
    "  - {name: big, match: {path: nodeagent.slice/big-*}, tenant: big}\n"
    "  - {name: tiny, match: {path: nodeagent.slice/tiny-*}, tenant: tiny}\n"
)


@pytest.mark.parametrize(
    "usage",
    [{}, {"big": 1e9}, {"tiny": 1e9}, {"big": 1e9, "tiny": 1e-3}, {"big": 5e8, "tiny": 5e8}],
    ids=["none", "big-all", "tiny-all", "tiny-a-little", "half-each"],
)
def test_the_extreme_shares_are_accepted_and_keep_fair_share_defined(
    usage: dict[str, float],
) -> None:
    """At the bounds, whatever the usage history, fair share's parts are defined: finite,
    summing to 1, and in the ratio s*F : s*F of Slurm's factor F = 2^(-u/s), computed here
    in log space (where the floats would underflow, the smaller part is the least one above 0)."""
    spec = check_text(EXTREMES, "p.yaml").spec
    assert pytest.approx(1e9) == SHARES_MAX / SHARES_MIN
    assert (spec.tenants["big"].shares, spec.tenants["tiny"].shares) == (SHARES_MAX, SHARES_MIN)
    snap = snapshot([workload("nodeagent.slice/big-1"), workload("nodeagent.slice/tiny-1")])
    parts = {
        o.path.removeprefix("nodeagent.slice/").removesuffix("-1"): o.fraction
        for o in FairShare().decide(policy_input(snap, spec, usage))
        if isinstance(o, Share)
    }
    assert set(parts) == {"big", "tiny"}
    assert all(math.isfinite(f) and 0 < f <= 1 for f in parts.values()), parts
    assert sum(parts.values()) == pytest.approx(1.0, rel=1e-12), parts
    total_shares, total_usage = SHARES_MAX + SHARES_MIN, sum(usage.values())
    s = {"big": SHARES_MAX / total_shares, "tiny": SHARES_MIN / total_shares}
    u = {t: usage.get(t, 0.0) / total_usage if total_usage else 0.0 for t in s}
    log2_ratio = math.log2(s["big"] / s["tiny"]) - u["big"] / s["big"] + u["tiny"] / s["tiny"]
    if abs(log2_ratio) < 1000:
        assert math.log2(parts["big"] / parts["tiny"]) == pytest.approx(log2_ratio, rel=1e-9)
    else:
        assert min(parts.values()) == 5e-324, parts
    weights = [
        t.value.value
        for cg in plan_claimed(snap, spec, usage).cgroups
        if (t := cg.targets.get(Attribute.CPU_WEIGHT)) is not None
        and isinstance(t.value, CpuWeight)
    ]
    assert len(weights) == 2 and all(1 <= w <= 10_000 for w in weights), weights


# Item 10: booleans, floats, strings and bytes where numbers or strings belong


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("version: true\ntenants: {a: {shares: 1}}\n", "version: must be 1, got true"),
        ("version: 1.0\ntenants: {a: {shares: 1}}\n", "version: must be 1, got 1.0"),
        ("version: '1'\ntenants: {a: {shares: 1}}\n", "version: must be 1, got '1'"),
        (
            "version: 1\ntenants: {a: {shares: true}}\n",
            "tenants.a.shares: must be a number, got true",
        ),
        (
            "version: 1\ntenants: {a: {shares: two}}\n",
            "tenants.a.shares: must be a number, got 'two'",
        ),
        (
            "version: 1\ntenants: {a: {shares: !!binary MQ==}}\n",
            "tenants.a.shares: must be a number, got b'1'",
        ),
        (
            HEAD + "fair_share: {weight_per_workload: true}\n",
            "fair_share.weight_per_workload: must be a whole number, got true",
        ),
        (
            HEAD + "fair_share: {weight_per_workload: 100.0}\n",
            "fair_share.weight_per_workload: must be a whole number, got 100.0",
        ),
        (
            HEAD + "fair_share: {deadband: false}\n",
            "fair_share.deadband: must be a number, got false",
        ),
        (
            HEAD + "fair_share: {active_threshold: true}\n",
            "fair_share.active_threshold: must be a number, got true",
        ),
        (
            HEAD
            + "rules:\n  - {name: r, match: {}, tenant: prod, limits: {cpu_period_us: true}}\n",
            "rules[0].limits.cpu_period_us: must be a whole number, got true",
        ),
        (
            HEAD + "fair_share: {half_life: 8.6e+24}\n",
            "fair_share.half_life: must be less than or equal to 31536000, got 8.6e+24",
        ),
        (
            HEAD + "fair_share: {half_life: 366d}\n",
            "fair_share.half_life: must be less than or equal to 31536000, got 31622400.0",
        ),
        (
            HEAD + "fair_share: {half_life: true}\n",
            "expected a duration such as 30s, not a boolean",
        ),
        (HEAD + "agent: {interval: true}\n", "expected a duration such as 30s, not a boolean"),
    ],
)
def test_loose_types_are_refused(text: str, message: str) -> None:
    [found] = problems(text)
    assert found.endswith(message)


@pytest.mark.parametrize(("text", "shares"), [("1e6", 1e6), ("2.5E-3", 0.0025), ("'2'", 2.0)])
def test_a_number_spelled_as_a_yaml_string_is_read_as_the_number(text: str, shares: float) -> None:
    spec = check_text(f"version: 1\ntenants: {{a: {{shares: {text}}}}}\n", "p.yaml").spec
    assert spec.tenants["a"].shares == shares


def test_a_half_life_of_a_year_is_accepted() -> None:
    spec = check_text(HEAD + "fair_share: {half_life: 365d}\n", "p.yaml").spec
    assert spec.fair_share.half_life == HALF_LIFE_MAX


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (HEAD + f"rules:\n  - {{name: {BINARY}, match: {{}}, tenant: prod}}\n", "rules[0].name"),
        (HEAD + f"rules:\n  - {{name: r, match: {{}}, tenant: {BINARY}}}\n", "rules[0].tenant"),
        (HEAD + f"agent: {{managed_root: {BINARY}}}\n", "agent.managed_root"),
        (HEAD + f"agent: {{state_file: {BINARY}}}\n", "agent.state_file"),
        (HEAD + f"agent: {{socket: {BINARY}}}\n", "agent.socket"),
        (HEAD + f"agent: {{socket_group: {BINARY}}}\n", "agent.socket_group"),
        (
            HEAD + f"rules:\n  - {{name: r, match: {{path: {BINARY}}}, tenant: prod}}\n",
            "rules[0].match.path",
        ),
        (
            HEAD + f"rules:\n  - {{name: r, match: {{name: {BINARY}}}, tenant: prod}}\n",
            "rules[0].match.name",
        ),
        (
            HEAD + f"rules:\n  - {{name: r, match: {{pod_uid: {BINARY}}}, tenant: prod}}\n",
            "rules[0].match.pod_uid",
        ),
        (
            HEAD + f"rules:\n  - {{name: r, match: {{container_id: {BINARY}}}, tenant: prod}}\n",
            "rules[0].match.container_id",
        ),
        (
            HEAD + "rules:\n  - {name: r, match: {runtime: !!binary cHJvZA==}, tenant: prod}\n",
            "rules[0].match.runtime",
        ),
        (
            HEAD + "rules:\n  - {name: r, match: {qos: !!binary cHJvZA==}, tenant: prod}\n",
            "rules[0].match.qos",
        ),
        (
            HEAD + f"rules:\n  - {{name: r, match: {{}}, tenant: prod, class: {BINARY}}}\n",
            "rules[0].class",
        ),
    ],
)
def test_binary_is_not_a_string(text: str, where: str) -> None:
    assert problems(text) == [f"{where}: must be a string, got b'prod'"]


def test_a_binary_tenant_name_is_refused() -> None:
    text = f"version: 1\ntenants:\n  {BINARY}: {{shares: 1}}\n  a: {{shares: 1}}\n"
    assert problems(text) == ["key 'cHJvZA==' in tenants must be a string, not binary"]


def test_the_stated_maximum_size_is_accepted() -> None:
    with pytest.raises(ValueError, match="too large") as info:
        parse_size(MAX_SIZE + 1)
    stated = int(re.search(r"at most (\d+) bytes", str(info.value)).group(1))  # type: ignore[union-attr]
    assert parse_size(stated) == stated == MAX_SIZE
    text = (
        HEAD
        + f"rules:\n  - {{name: r, match: {{}}, tenant: prod, limits: {{memory_max: {stated}}}}}\n"
    )
    assert check_text(text, "p.yaml").spec.rules[0].limits.memory_max == MAX_SIZE
    assert parse_size("8191Pi") < MAX_SIZE


def test_python_callers_get_the_same_strictness() -> None:
    """Tests and tools build specs with model_validate: they get the same rules."""
    with pytest.raises(ValueError, match="version"):
        PolicySpec.model_validate({"version": True, "tenants": {"a": {"shares": 1}}})
    with pytest.raises(ValueError, match="shares"):
        PolicySpec.model_validate({"version": 1, "tenants": {"a": {"shares": True}}})
