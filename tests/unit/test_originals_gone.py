"""What the agent recorded of a cgroup's values before it changed them (for `nodeagent
release`) goes when the cgroup goes: a removed container, or a removed pod with its
containers, is forgotten at the next tick, in memory and in the state file. Before, only a
cgroup the sensor found vanished mid-read was forgotten; one removed between two ticks (as
inotify reports nearly all removals) stayed until the next restart, so that on a node with
churn the record and the state file saved every tick grew without end (`bench churn`: RSS
+24% in 10 minutes; a fixture churn of 2,550 cgroups kept 4,080 records).

The agent runs its real tick over a fixture tree laid out as the kubelet's cgroupfs driver
lays out pods, with a rule capping each container's CPU.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from builders import CID, CID2, POD, one_tenant, pod_tree

from nodeagent import state
from nodeagent.cgroupfs.values import Attribute
from nodeagent.daemon import Agent, open_agent
from nodeagent.originals import Originals
from nodeagent.ownership import WriteMode

POD2 = "kubepods/burstable/pod0c5d8e2a-7b3f-4a1e-9d6c-5f4e3d2c1b0a"
CONTAINERS = [f"{POD}/{CID}", f"{POD}/{CID2}"]
OTHER = f"{POD2}/{'ab' * 32}"


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    tree = pod_tree(tmp_path / "cgroup", POD, POD2, *CONTAINERS, OTHER)
    rule = {"name": "cap", "match": {"kind": "container"}, "tenant": "a", "limits": {"cpu_max": 1}}
    a = open_agent(one_tenant(tmp_path, [rule]), tree)
    a.rec.registry.resync()
    return a


def recorded(a: Agent) -> set[str]:
    return {p for p, attribute, _ in a.rec.originals.items() if attribute is Attribute.CPU_MAX}


def saved(tmp_path: Path) -> set[str]:
    loaded = state.load(str(tmp_path / "state.json"))
    assert loaded is not None
    return set(loaded.originals)


def test_a_container_removed_between_ticks_is_forgotten(agent: Agent, tmp_path: Path) -> None:
    agent.tick()
    assert recorded(agent) == {*CONTAINERS, OTHER}
    shutil.rmtree(Path(agent.rec.tree.root, CONTAINERS[1]))  # the runtime removed it
    agent.rec.registry.resync()  # as inotify's event or the periodic rescan tells the loop
    agent.tick()
    assert recorded(agent) == {CONTAINERS[0], OTHER}
    agent.rec.saver.save()
    assert CONTAINERS[1] not in saved(tmp_path)


def test_a_removed_pod_takes_its_containers_with_it(agent: Agent, tmp_path: Path) -> None:
    agent.tick()
    shutil.rmtree(Path(agent.rec.tree.root, POD))
    agent.rec.registry._deleted(POD)  # the one event inotify gives for the pod's directory
    agent.tick()
    assert recorded(agent) == {OTHER}


def test_a_workload_a_scan_misses_but_that_is_still_there_keeps_its_record(
    agent: Agent,
) -> None:
    """A scan can leave out a cgroup that still exists (a budget reached, a directory it
    could not read): what the agent changed there must still be handed back."""
    agent.tick()
    agent.rec.registry.gone.append(OTHER)
    agent.tick()
    assert OTHER in recorded(agent)


def test_forget_below_takes_the_path_and_what_is_below_it_only() -> None:
    o = Originals()
    for path in ["a", "a/b", "a/b/c", "ab", "x/a"]:
        o.note(path, Attribute.CPU_MAX, "max 100000", "50000 100000", WriteMode.DIRECT)
    o.forget_below(["a/b", "nothing/here"])
    assert [p for p, _, _ in o.items()] == ["a", "ab", "x/a"]
    o.forget_below([])
    assert len(o) == 3


def test_what_systemd_holds_for_a_service_outlives_its_cgroup() -> None:
    """A service's restart removes its cgroup and makes it again, and systemd sets the
    properties nodeagent gave the unit on the new one: forgetting their originals would
    leave `release` nothing to hand back. A scope (a container of the systemd driver) or a
    slice ends with its cgroup: forgotten."""
    o = Originals()
    service, scope = "system.slice/web.service", "system.slice/docker-1234.scope"
    for path in (service, scope):
        o.note(path, Attribute.CPU_MAX, "max 100000", "50000 100000", WriteMode.SYSTEMD)
    o.note(service, Attribute.MEMORY_MAX, "max", "1073741824", WriteMode.DIRECT)
    o.forget_below(["system.slice/web.service", scope])
    assert [(p, a) for p, a, _ in o.items()] == [(service, Attribute.CPU_MAX)]
