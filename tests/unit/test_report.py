"""report.find (what `nodeagent explain ARG` resolves) and the CLI's table formatting."""

from __future__ import annotations

import pytest
from builders import CID, CID2, docker, job, k8s_container, service

from nodeagent import tables
from nodeagent.policy.plan import CgroupPlan, Plan
from nodeagent.report import find

ROOT = "/sys/fs/cgroup"
OTHER_CID = CID[:8] + "f" * 56  # shares its first 8 hex digits with CID

WORKLOADS = [
    docker(CID),
    docker(OTHER_CID),
    k8s_container(CID2),
    service("cron.service"),
    job("nodeagent.slice/job-1"),
    job("nodeagent.slice/research/job-1"),  # a same-named job elsewhere
]
PLAN = Plan(
    seq=1,
    wall_time=0.0,
    cgroups=tuple(CgroupPlan(w, None, {}, ()) for w in WORKLOADS),
    tenant_usage={},
)


def found(query: str, root: str = ROOT) -> list[str]:
    return [i.path for i in find([cg.identity for cg in PLAN.cgroups], query, root)]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        # relative path, exact
        (f"system.slice/docker-{CID}.scope", [docker(CID).path]),
        ("system.slice/cron.service", ["system.slice/cron.service"]),
        ("nodeagent.slice/job-1", ["nodeagent.slice/job-1"]),  # exact beats the name match
        ("/system.slice/cron.service/", ["system.slice/cron.service"]),
        ("  system.slice/cron.service\n", ["system.slice/cron.service"]),
        # absolute path under the root
        (f"{ROOT}/system.slice/cron.service", ["system.slice/cron.service"]),
        (f"{ROOT}/{k8s_container(CID2).path}", [k8s_container(CID2).path]),
        (f"{ROOT}/nodeagent.slice/job-1/", ["nodeagent.slice/job-1"]),
        # a workload's name
        ("cron.service", ["system.slice/cron.service"]),
        (CID2[:12], [k8s_container(CID2).path]),
        # container-id prefix
        (CID, [docker(CID).path]),
        (CID[:20], [docker(CID).path]),
        (CID[:8], [docker(CID).path, docker(OTHER_CID).path]),  # ambiguous: both
        (CID2[:4], [k8s_container(CID2).path]),
        # the last components of a path
        (f"docker-{CID}.scope", [docker(CID).path]),
        ("research/job-1", ["nodeagent.slice/research/job-1"]),
        # a bare name shared by two workloads
        ("job-1", ["nodeagent.slice/job-1", "nodeagent.slice/research/job-1"]),
        # nothing
        ("nope.service", []),
        ("ffff", []),
        ("/var/lib/system.slice/cron.service", []),
        ("ron.service", []),
    ],
)
def test_find(query: str, expected: list[str]) -> None:
    assert found(query) == expected


def test_find_with_a_root_given_with_a_trailing_slash() -> None:
    assert found(f"{ROOT}/system.slice/cron.service", ROOT + "/") == ["system.slice/cron.service"]


def test_find_with_another_root() -> None:
    assert found("/tmp/cg/system.slice/cron.service", "/tmp/cg") == ["system.slice/cron.service"]
    assert found(f"{ROOT}/system.slice/cron.service", "/tmp/cg") == []


# --- tables ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", ""),
        ("max", "max"),
        ("0", "0"),
        ("1023", "1023"),
        ("1024", "1Ki"),
        ("1536", "1.5Ki"),
        (str(512 << 20), "512Mi"),
        (str(4 << 30), "4Gi"),
        (str(3 << 30), "3Gi"),
        (str(1536 << 20), "1.5Gi"),
        (str((4 << 30) - 4096), "4.0Gi"),
        (str(2 << 40), "2Ti"),
        (str(2048 << 40), "2048Ti"),
        ("999424", "976Ki"),
        ("1000000", "976.6Ki"),
    ],
)
def test_size(value: str | None, expected: str | None) -> None:
    assert tables.size(value) == expected


@pytest.mark.parametrize(
    ("current", "target", "expected"),
    [
        ("333", "333", "333"),
        ("100", "333", "100->333"),
        (None, "333", "?->333"),
        ("max 100000", None, "max 100000"),
        (None, None, "-"),
        ("", None, "-"),
    ],
)
def test_change(current: str | None, target: str | None, expected: str) -> None:
    assert tables.change(current, target) == expected


@pytest.mark.parametrize(
    ("rate", "expected"), [(None, "-"), (0.0, "0.00"), (1.5, "1.50"), (0.004, "0.00")]
)
def test_cores(rate: float | None, expected: str) -> None:
    assert tables.cores(rate) == expected


def test_table_aligns_columns_and_shows_none_as_dash() -> None:
    text = tables.table(
        ("CGROUP", "TENANT", "CPU"),
        [("system.slice/cron.service", None, 1.5), ("a", "research", None)],
    )
    assert text == (
        "CGROUP                     TENANT    CPU\n"
        "system.slice/cron.service  -         1.5\n"
        "a                          research  -"
    )


def test_table_without_rows_is_the_header() -> None:
    assert tables.table(("A", "B"), []) == "A  B"


def test_an_unset_memory_target_shows_the_kernels_value_alone() -> None:
    assert tables.change(tables.size("max"), tables.size(None)) == "max"
    assert tables.change(tables.size(str(4 << 30)), tables.size(str(3 << 30))) == "4Gi->3Gi"
