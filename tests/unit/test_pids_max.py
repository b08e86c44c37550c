"""pids.max is a managed cap as memory.max is (issue 34 item 4): a rule's `limits.pids_max`
is planned, written, sensed, shown, recorded as an original, handed back and released; a
lower value binds against a higher one, and a unit systemd owns gets it as TasksMax.

The agent's real tick over a fixture tree laid out as the kubelet's cgroupfs driver lays out
pods (as tests/unit/test_hand_back.py). Names new to the change are reached through their
modules (`values.PidsMax`), so that each test fails on its own line on code without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from builders import CGROUP_FILES, CID, CID2, POD, one_tenant, pod_tree

from nodeagent.cgroupfs import unitprops, values
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute, is_looser
from nodeagent.daemon import Agent, open_agent
from nodeagent.errors import InvalidValue
from nodeagent.originals import Original
from nodeagent.ownership import WriteMode
from nodeagent.policy.base import binds
from nodeagent.policyfile.load import check_text
from nodeagent.policyfile.model import PolicySpec
from nodeagent.policyfile.yamlfile import PolicyError
from nodeagent.release import Releaser
from nodeagent.report import explain
from nodeagent.sense.cgroup_files import read_sample
from nodeagent.tables import SHOWN

CAPPED, OTHER = f"{POD}/{CID}", f"{POD}/{CID2}"
pytestmark = pytest.mark.usefixtures("files_replace_their_value")


def spec(tmp_path: Path, pids: int | None) -> PolicySpec:
    """A rule capping CAPPED at `pids` tasks (None: no rule)."""
    rules: list[dict[str, Any]] = (
        []
        if pids is None
        else [{"name": "cap", "match": {"path": CAPPED}, "tenant": "a",
               "limits": {"pids_max": pids}}]
    )  # fmt: skip
    return one_tenant(tmp_path, rules)


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    files = {**CGROUP_FILES, "pids.max": "max\n"}
    tree = pod_tree(tmp_path / "cgroup", POD, CAPPED, OTHER, files=files)
    a = open_agent(spec(tmp_path, 64), tree)
    a.rec.registry.resync()
    return a


def pids_max(a: Agent, path: str = CAPPED) -> str:
    return Path(a.rec.tree.root, path, "pids.max").read_text().strip()


def test_a_rules_pids_max_is_written_shown_recorded_and_handed_back(
    agent: Agent, tmp_path: Path
) -> None:
    record = agent.tick()
    assert pids_max(agent) == "64"
    assert Attribute("pids.max") in SHOWN, "a column of allocations, a line of explain"
    shown = explain(record, agent.rec.registry.workloads[CAPPED])["values"]["pids.max"]
    assert (shown["target"], shown["reason"]) == ("64", "rule cap: pids_max 64")
    assert [(p, a.value, o.was) for p, a, o in agent.rec.originals.items()] == [
        (CAPPED, "pids.max", "max")
    ], "an original, for release"
    agent.tick()
    assert pids_max(agent) == "64", "kept: the sensor reads what the plan holds"
    agent.rec.reloaded(spec(tmp_path, None))
    agent.tick()
    assert pids_max(agent) == "max", "no rule claims it any more: handed back"
    assert list(agent.rec.originals.items()) == []


def test_another_writers_pids_max_is_repaired(agent: Agent, tmp_path: Path) -> None:
    agent.tick()
    Path(agent.rec.tree.root, CAPPED, "pids.max").write_text("9999\n")
    agent.rec.reloaded(spec(tmp_path, 64))  # the next tick reads every file
    agent.tick()
    assert pids_max(agent) == "64"


def test_pids_max_values_are_the_kernels() -> None:
    pids = values.PidsMax
    assert (pids(16).render(), pids(None).render()) == ("16", "max")
    assert pids(0).render() == "0", "an operator's stop to a fork bomb still reads"
    with pytest.raises(InvalidValue, match=r"outside 0\.\.4194304"):
        pids((1 << 22) + 1)
    with pytest.raises(InvalidValue):
        pids(-1)
    assert is_looser(pids(None), pids(16)) and is_looser(pids(64), pids(16))
    assert not is_looser(pids(16), pids(64)) and not is_looser(pids(16), pids(16))


def test_the_lower_pids_max_binds_between_policies() -> None:
    attribute = Attribute("pids.max")
    assert binds(attribute, values.PidsMax(16), values.PidsMax(64)), "the earlier, lower"
    assert not binds(attribute, values.PidsMax(64), values.PidsMax(16))


def test_systemd_gets_it_as_tasks_max() -> None:
    attribute = Attribute("pids.max")
    assert unitprops.unit_properties(attribute, values.PidsMax(16)) == {"TasksMax": 16}
    assert unitprops.unit_properties(attribute, values.PidsMax(None)) == {
        "TasksMax": unitprops.UINT64_MAX
    }
    assert "TasksMax" in unitprops.RESOURCE_PROPERTIES
    assert unitprops.systemd_value(attribute, values.PidsMax(16)) == values.PidsMax(16)


def test_the_sensor_reads_pids_max_where_the_controller_is(tmp_path: Path) -> None:
    for name, text in {**CGROUP_FILES, "pids.max": "16\n"}.items():
        (tmp_path / name).write_text(text)
    tree = CgroupTree(str(tmp_path))
    with tree.open("") as d:
        assert read_sample(d, 4096).settings[Attribute("pids.max")] == values.PidsMax(16)
    (tmp_path / "pids.max").unlink()
    with tree.open("") as d:
        assert Attribute("pids.max") not in read_sample(d, 4096).settings, "no controller"


class Units:
    def __init__(self) -> None:
        self.set: list[tuple[str, dict[str, int]]] = []

    def unit_for_cgroup(self, cgroup: str) -> str:
        return cgroup.rsplit("/", 1)[-1]

    def set_unit_properties(self, unit: str, properties: Any, *, runtime: bool = True) -> None:
        self.set.append((unit, dict(properties)))

    def freeze_unit(self, unit: str, frozen: bool) -> None:
        raise AssertionError("no freeze here")


def test_release_hands_pids_max_back_through_systemd(tmp_path: Path) -> None:
    scope = tmp_path / "system.slice" / "docker-x.scope"
    scope.mkdir(parents=True)
    (scope / "pids.max").write_text("64\n")
    (scope / "cgroup.procs").write_text("")
    units = Units()
    releaser = Releaser(CgroupTree(str(tmp_path)), units, lambda *a: None)
    handed = releaser.one(
        "system.slice/docker-x.scope",
        Attribute("pids.max"),
        Original("max", "64", WriteMode.SYSTEMD),
    )
    assert handed.outcome == "released", handed
    assert units.set == [("docker-x.scope", {"TasksMax": unitprops.UINT64_MAX})]
    assert (scope / "pids.max").read_text() == "max"


HEAD = "version: 1\ntenants: {a: {shares: 1}}\nrules:\n"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "0 is outside 1..4194304: at least the one process a workload starts with,"
              " at most the kernel's PID_MAX_LIMIT"),
        ("4194305", "4194305 is outside 1..4194304"),
        ("many", "must be a whole number, got 'many'"),
        ("1.5", "must be a whole number, got 1.5"),
    ],
)  # fmt: skip
def test_a_rules_pids_max_is_checked_where_it_is_written(value: str, message: str) -> None:
    text = HEAD + f"  - {{name: r, match: {{}}, tenant: a, limits: {{pids_max: {value}}}}}\n"
    with pytest.raises(PolicyError) as info:
        check_text(text, "p.yaml")
    [problem] = [str(p) for p in info.value.problems]
    assert problem.startswith("p.yaml:4:56: rules[0].limits.pids_max: " + message), problem


def test_a_rules_pids_max_loads() -> None:
    text = HEAD + "  - {name: r, match: {}, tenant: a, limits: {pids_max: 512}}\n"
    assert check_text(text, "p.yaml").spec.rules[0].limits.pids_max == 512
