"""report.find (what `nodeagent explain ARG` resolves) and the CLI's table formatting."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import (
    CID,
    CID2,
    POD_UID,
    docker,
    job,
    k8s_container,
    plan_claimed,
    service,
    snapshot,
    spec,
    workload,
)

from nodeagent import tables
from nodeagent.api import answers
from nodeagent.cgroupfs.values import Attribute, CpuWeight, Frozen, MemoryLimit
from nodeagent.cli.inspection import allocations_table, explain_text
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.meta import ContainerMeta, PodMeta
from nodeagent.ownership import WriteMode
from nodeagent.policy.base import Assignment
from nodeagent.policy.plan import CgroupPlan, Plan
from nodeagent.policyfile.model import WorkloadClass
from nodeagent.report import TickRecord, allocations, describe, explain, find, identities
from nodeagent.snapshot import CgroupSample, WorkloadState

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
        # the path with short ids, as the tables show it (issue 13, item 24)
        (f"system.slice/docker-{CID[:12]}.scope", [docker(CID).path]),
        (f"docker-{CID[:12]}.scope", [docker(CID).path]),
        (f"kubepods/burstable/pod{POD_UID[:8]}/{CID2[:12]}", [k8s_container(CID2).path]),
        (f"pod{POD_UID[:8]}/{CID2[:12]}", [k8s_container(CID2).path]),
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


def test_a_table_cuts_the_columns_it_may_to_fit_a_width() -> None:
    rows = [("a/long/path/to/the/leaf-1", "x", "a reason that is long"), ("b", "y", None)]
    cut: list[tuple[int, tables.Keep]] = [(2, "head"), (0, "tail")]
    assert tables.table(("CGROUP", "K", "REASON"), rows, width=36, cut=cut).splitlines() == [
        "CGROUP               K  REASON",
        "\u2026path/to/the/leaf-1  x  a reason th\u2026",
        "b                    y  -",
    ]
    # never narrower than MIN_CUT or the header: a table that cannot fit stays wider
    narrow = tables.table(("CGROUP", "K", "REASON"), rows, width=10, cut=cut).splitlines()
    assert narrow[1] == "\u2026/the/leaf-1  x  a reason th\u2026"
    # without a width, or with room, nothing is cut
    whole = tables.table(("CGROUP", "K", "REASON"), rows)
    assert tables.table(("CGROUP", "K", "REASON"), rows, width=200, cut=cut) == whole
    assert "a reason that is long" in whole


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        (docker(CID).path, f"system.slice/docker-{CID[:12]}.scope"),
        (k8s_container(CID2).path, f"kubepods/burstable/pod{POD_UID[:8]}/{CID2[:12]}"),
        (
            f"kubepods.slice/kubepods-pod{POD_UID.replace('-', '_')}.slice/crio-{CID}.scope",
            f"kubepods.slice/kubepods-pod{POD_UID[:8]}.slice/crio-{CID[:12]}.scope",
        ),
        ("nodeagent.slice/job-deadbeef", "nodeagent.slice/job-deadbeef"),
        ("x/" + "a" * 65, "x/" + "a" * 65),  # not an id: 65 hex digits
    ],
)
def test_short_ids(path: str, shown: str) -> None:
    assert tables.short_ids(path) == shown


def test_an_unset_memory_target_shows_the_kernels_value_alone() -> None:
    assert tables.change(tables.size("max"), tables.size(None)) == "max"
    assert tables.change(tables.size(str(4 << 30)), tables.size(str(3 << 30))) == "4Gi->3Gi"


# --- explain and allocations on parent levels, sizes and sensed figures (issue 13, item 17) -


def level(path: str, runtime: Runtime, owner: Owner, weight: int = 100) -> WorkloadState:
    identity = WorkloadIdentity(path, Kind.GROUP, runtime, owner, path.rsplit("/", 1)[-1])
    sample = CgroupSample(settings={Attribute.CPU_WEIGHT: CpuWeight(weight)})
    return WorkloadState(identity, sample)


def ticked(busy: bool = True, deadline: bool = False) -> TickRecord:
    """One planned tick: a pod's container (tenant a, memory_max 4Gi) under the kubelet's
    read-only levels, and a job (tenant b) under nodeagent.slice, with a deadline if asked;
    levels sensed too."""
    container = WorkloadState(
        k8s_container(),
        CgroupSample(
            populated=True,
            memory_current=4096,
            memory_anon=100,
            memory_events={"low": 0, "high": 3, "oom": 0},
            settings={
                Attribute.CPU_WEIGHT: CpuWeight(100),
                Attribute.MEMORY_MAX: MemoryLimit(None),
                Attribute.FREEZE: Frozen(False),
            },
        ),
        cpu_rate=1.0 if busy else 0.0,
    )
    job_b = replace(
        workload("nodeagent.slice/job-b", 1.0 if busy else 0.0),
        sample=CgroupSample(populated=True, cpu_usage_us=600_000_000),  # 10 CPU-min done
    )
    snap = replace(
        snapshot([container, job_b]),
        levels=(
            level("kubepods", Runtime.KUBELET, Owner.CGROUPFS),
            level("kubepods/burstable", Runtime.KUBELET, Owner.CGROUPFS),
            level(f"kubepods/burstable/pod{POD_UID}", Runtime.KUBELET, Owner.CGROUPFS),
            level("nodeagent.slice", Runtime.NODEAGENT, Owner.NODEAGENT),
        ),
    )
    policy = spec(
        {"a": 2, "b": 1},
        [
            {"name": "pod", "match": {"kind": "container"}, "tenant": "a",
             "limits": {"memory_max": "4Gi"}},
            {"name": "jobs", "match": {"path": "nodeagent.slice/*"}, "tenant": "b",
             **({"deadline": "2030-01-01T00:00:00Z", "work": "1h"} if deadline else {})},
        ],
    )  # fmt: skip
    plan = plan_claimed(snap, policy, {})
    return TickRecord(snap, plan, (), 0.01, True)


def explained(record: TickRecord, path: str) -> list[str]:
    identity = next(i for i in identities(record) if i.path == path)
    return explain_text(explain(record, identity)).splitlines()


def test_explain_on_a_parent_level_says_what_it_is_never_none() -> None:
    """It printed `rule None  tenant None  class None`."""
    for path in ("kubepods", "nodeagent.slice"):
        lines = explained(ticked(), path)
        assert "None" not in "\n".join(lines)
        tenant = "a" if path == "kubepods" else "b"
        assert lines[1] == (
            f"  parent level of 1 claimed workload (tenants: {tenant}); no rule claims it:"
            " only its cpu.weight is planned, so that tenant shares hold across parents"
            " (fair_share.hierarchy)"
        )
        trace = lines[lines.index("trace:") + 1 :]
        assert trace and trace[0].startswith("  cpu-weights: target ")


def test_a_read_only_level_shows_the_kernels_value_and_the_plans_apart() -> None:
    """A read-only level in a dry run showed `?->154`, which reads as "will write 154": the
    kernel's value was never looked up for levels, and NEW is never written there."""
    record = ticked()
    weight = next(x for x in explained(record, "kubepods") if x.startswith("  cpu.weight "))
    assert weight.split()[1:4] == ["100", "(plan:", "154)"]
    rows = {r["cgroup"]: r for r in allocations(record)["allocations"]}
    assert rows["kubepods"]["values"]["cpu.weight"]["current"] == "100"
    table = allocations_table(allocations(record)).splitlines()
    assert next(line for line in table if line.startswith("kubepods (read-only) ")).split()[
        4:7
    ] == ["100", "(plan:", "154)"]
    # a level the agent writes shows OLD->NEW as any workload does (dry run: nothing written)
    assert next(line for line in table if line.startswith("nodeagent.slice ")).split()[3] == (
        "100->46"
    )


def test_explain_shows_memory_in_sizes_as_allocations_does() -> None:
    """explain showed `max->4294967296` where allocations showed `max->4Gi`."""
    lines = explained(ticked(), k8s_container().path)
    memory = next(line for line in lines if line.startswith("  memory.max "))
    assert memory.split()[1] == "max->4Gi"


def test_explain_shows_what_it_sensed_in_units_not_as_python() -> None:
    """memory events printed as a Python dict, `frozen` as False."""
    lines = explained(ticked(), k8s_container().path)
    start, end = lines.index("sensed this tick:"), lines.index("trace:")
    sensed = dict(line.split(None, 1) for line in lines[start + 1 : end])
    assert sensed["memory_events"] == "low=0 high=3 oom=0"
    assert sensed["frozen"] == "no"
    assert sensed["memory_current"] == "4Ki"
    assert sensed["memory_anon"] == "100 B"
    assert sensed["cpu_rate"] == "1.00 cores"
    assert not any(c in "\n".join(lines[start:end]) for c in "{}'")


def test_a_parent_level_with_nothing_to_set_is_not_called_an_idle_tenant() -> None:
    """Parent levels got "its tenant is idle and its rule has no limits": they have neither."""
    record = ticked(busy=False)
    rows = {r["cgroup"]: r for r in allocations(record)["allocations"]}
    assert rows["nodeagent.slice"]["reason"] == (
        "nothing to set: no claimed workload below this parent level is busy"
    )
    lines = explained(record, "nodeagent.slice")
    assert lines[lines.index("trace:") + 1 :] == [
        "  nothing to set: no claimed workload below this parent level is busy"
    ]


def test_explain_of_a_planned_cgroup_never_shows_an_empty_trace() -> None:
    """A parent level the plan weighted showed an empty `trace:`: when the policies gave no
    trace lines, each planned value is its own line."""
    record = ticked()
    cgroups = tuple(
        replace(c, trace=()) if c.path == "nodeagent.slice" else c for c in record.plan.cgroups
    )
    record = replace(record, plan=replace(record.plan, cgroups=cgroups))
    lines = explained(record, "nodeagent.slice")
    assert lines[lines.index("trace:") + 1 :] == [
        "  cpu-weights: cpu.weight 46: cpu weight for a target of 1.83 cores"
    ]


def test_a_workload_is_described_once_and_the_answer_names_every_key_of_it() -> None:
    """`describe` is the one description of a workload (the report's rows, the CLI's
    listing, the metrics' labels): the API's wire type names exactly its keys, so that a
    key added to one and not the other fails here, not in a reader."""
    meta = ContainerMeta("containerd", "web", "nginx:1", pod=PodMeta("default", "web-0", "u1"))
    identity = replace(WORKLOADS[0], meta=meta)
    assignment = Assignment("web", "prod", WorkloadClass.INFERENCE, matched=("rule web",))
    described = describe(identity, assignment, WriteMode.SYSTEMD)
    fields = {f.alias or name for name, f in answers.Workload.model_fields.items()}
    assert set(described) == fields
    answer = answers.Workload.model_validate(described)
    assert (answer.cgroup, answer.workload_class, answer.pod, answer.writable) == (
        identity.path,
        "inference",
        "web-0",
        True,
    )
    assert answer.model_extra == {}
