"""jobs.access: who may use which tenant and class (issue 12, item 6). The rule is pure;
the policy's entries are checked by `validate` with FILE:LINE:COL errors."""

from __future__ import annotations

import pytest

from nodeagent.access import Caller, refusal
from nodeagent.policyfile.load import check_text
from nodeagent.policyfile.model import PolicySpec, WorkloadClass
from nodeagent.policyfile.yamlfile import PolicyError

HEAD = "version: 1\ntenants:\n  research: {shares: 2}\n  prod: {shares: 1}\n"
POLICY = check_text(
    HEAD
    + """\
jobs:
  default_tenant: research
  default_class: batch
  access:
    - users: [alice, 1002]
      tenants: [prod]
      classes: [inference, training]
    - groups: [gpu-admins, 4242]
      tenants: ["*"]
      classes: ["*"]
""",
    "p.yaml",
).spec
INF, T, B = WorkloadClass.INFERENCE, WorkloadClass.TRAINING, WorkloadClass.BATCH


def who(
    uid: int,
    user: str | None = None,
    gids: frozenset[int] = frozenset(),
    groups: frozenset[str] = frozenset(),
) -> Caller:
    return Caller(uid, user, gids, groups)


@pytest.mark.parametrize(
    ("caller", "tenant", "cls", "allowed"),
    [
        (who(0), "prod", INF, True),  # root: everything
        (who(1000, "bob"), "research", B, True),  # the defaults: everyone
        (who(1000, "bob"), "research", INF, False),
        (who(1000, "bob"), "prod", B, False),
        (who(1001, "alice"), "prod", INF, True),  # by user name
        (who(1002), "prod", T, True),  # by uid
        (who(1001, "alice"), "prod", B, False),  # the pair is granted, not each alone
        (who(1001, "alice"), "research", INF, False),
        (who(1003, gids=frozenset({4242})), "prod", INF, True),  # by gid
        (who(1003, groups=frozenset({"gpu-admins"})), "research", INF, True),  # by group name
        (who(1003, groups=frozenset({"gpu-users"})), "research", INF, False),
    ],
)
def test_who_may_use_what(caller: Caller, tenant: str, cls: WorkloadClass, allowed: bool) -> None:
    why = refusal(POLICY, caller, tenant, cls)
    assert (why is None) is allowed
    if why is not None:
        assert why.startswith(f"uid {caller.uid}") and "\n" not in why


def test_without_entries_non_root_gets_the_defaults_only() -> None:
    bare = PolicySpec.model_validate(
        {
            "version": 1,
            "tenants": {"a": {"shares": 1}, "b": {"shares": 1}},
            "jobs": {"default_tenant": "a"},
        }
    )
    assert refusal(bare, who(1000), "a", B) is None
    assert refusal(bare, who(1000), "b", B) is not None
    assert refusal(bare, who(1000), "a", T) is not None


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        check_text(text, "p.yaml")
    return [str(p) for p in info.value.problems]


def test_bad_entries_are_reported_where_they_are() -> None:
    text = (
        HEAD
        + """\
jobs:
  access:
    - users: [alice]
      tenants: [prd]
      classes: [inference]
    - tenants: ["*"]
      classes: [batch]
"""
    )
    assert problems(text) == [
        "p.yaml:8:17: jobs.access[0].tenants[0]: unknown tenant 'prd'; did you mean 'prod'?",
        "p.yaml:10:7: jobs.access[1]: an entry needs users or groups: whom it lets in",
    ]
    text = (
        HEAD
        + """\
jobs:
  max_per_user: 0
  access:
    - users: [-1]
      tenants: []
      classes: [urgent]
gpu:
  max_waiting_per_user: 1.5
"""
    )
    assert problems(text) == [
        "p.yaml:6:17: jobs.max_per_user: must be greater than or equal to 1, got 0",
        "p.yaml:8:15: jobs.access[0].users[0]: must be a name or a numeric id from 0 to"
        " 4294967294, got -1",
        "p.yaml:9:16: jobs.access[0].tenants: must list at least one name, or '*'",
        "p.yaml:10:17: jobs.access[0].classes[0]: must be a class (inference, training, batch,"
        " besteffort) or '*', got 'urgent'",
        "p.yaml:12:25: gpu.max_waiting_per_user: must be a whole number, got 1.5",
    ]
