"""Which cgroup the agent itself is in, read from /proc/self/cgroup: one line when it cannot be
read (a proc root without it: before, `nodeagent run` died with a traceback); and the
controllers it enables down to its managed root."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.cgroupfs.subtree import own_cgroup
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import open_agent
from nodeagent.errors import NodeagentError
from nodeagent.policyfile.model import PolicySpec


def test_the_v2_entry_is_the_agents_cgroup(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text("0::/system.slice/nodeagent.service\n")
    assert own_cgroup(str(tmp_path)) == "system.slice/nodeagent.service"


def test_a_proc_root_without_it_is_one_line_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(NodeagentError) as e:
        own_cgroup(str(tmp_path))
    assert str(e.value) == f"cannot read {tmp_path}/self/cgroup: No such file or directory"


def test_a_v1_only_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text("12:cpu,cpuacct:/user.slice\n")
    with pytest.raises(NodeagentError, match="has no cgroup v2 entry"):
        own_cgroup(str(tmp_path))


class KernelLikeTree(CgroupTree):
    """A plain directory as the cgroup root whose mkdir makes the files the kernel makes:
    a child is offered (cgroup.controllers) what its parent's cgroup.subtree_control
    enabled. A write replaces a file (files_replace_their_value): what the agent wrote
    last there is what it enabled."""

    def mkdir(self, path: str) -> bool:
        made = super().mkdir(path)
        if made:
            parent = Path(self.path_of(path)).parent
            offered = (parent / "cgroup.subtree_control").read_text().replace("+", "")
            for name, text in {"cgroup.controllers": offered, "cgroup.subtree_control": "",
                               "cgroup.procs": ""}.items():  # fmt: skip
                Path(self.path_of(path), name).write_text(text)
        return made


def prepared(
    tmp_path: Path, offered: str, managed_root: str = "jobs.slice/nodeagent.slice"
) -> Path:
    """The cgroup tree after the agent prepared its managed root, the host's root offering
    `offered`."""
    root = tmp_path / "cgroup"
    root.mkdir(exist_ok=True)
    for name, text in {"cgroup.controllers": offered, "cgroup.subtree_control": "",
                       "cgroup.procs": ""}.items():  # fmt: skip
        (root / name).write_text(text)
    policy = {"version": 1, "tenants": {"a": {"shares": 1}},
              "agent": {"managed_root": managed_root,
                        "state_file": str(tmp_path / "state.json")}}  # fmt: skip
    open_agent(PolicySpec.model_validate(policy), KernelLikeTree(str(root))).prepare()
    return root


@pytest.mark.usefixtures("files_replace_their_value")
def test_pids_is_enabled_down_to_the_managed_root_where_the_host_offers_it(
    tmp_path: Path,
) -> None:
    """Issue 34 item 4: a job's pids.max needs the pids controller in the managed root,
    whose children the jobs are; before, only cpu and memory were enabled there."""
    root = prepared(tmp_path, "cpuset cpu io memory pids\n")
    for level in (root, root / "jobs.slice", root / "jobs.slice" / "nodeagent.slice"):
        assert (level / "cgroup.subtree_control").read_text() == "+cpu +memory +pids", level


@pytest.mark.usefixtures("files_replace_their_value")
def test_a_host_without_pids_still_gets_its_managed_root(tmp_path: Path) -> None:
    root = prepared(tmp_path, "cpu memory\n")
    managed = root / "jobs.slice" / "nodeagent.slice"
    assert (managed / "cgroup.subtree_control").read_text() == "+cpu +memory"


PACKAGED = "system.slice/nodeagent-workloads.service/workloads"


def systemd_made(level: Path) -> None:
    """A cgroup systemd made, offered cpu, memory and pids."""
    level.mkdir(parents=True)
    for name, text in {"cgroup.controllers": "cpu memory pids", "cgroup.subtree_control": "",
                       "cgroup.procs": ""}.items():  # fmt: skip
        (level / name).write_text(text)


@pytest.mark.usefixtures("files_replace_their_value")
def test_a_managed_root_in_a_unit_that_is_not_running_is_one_line_and_makes_nothing(
    tmp_path: Path,
) -> None:
    """Issue 36 item 2: the packaged managed root, with nodeagent-workloads.service not
    running (an agent run from a shell): the agent made the unit's cgroup itself, a
    look-alike systemd knew nothing of."""
    systemd_made(tmp_path / "cgroup" / "system.slice")
    with pytest.raises(NodeagentError) as e:
        prepared(tmp_path, "cpu memory pids\n", PACKAGED)
    unit_cgroup = tmp_path / "cgroup" / "system.slice" / "nodeagent-workloads.service"
    assert str(e.value) == (
        f"agent.managed_root {PACKAGED} is inside {unit_cgroup}, the cgroup of the systemd"
        " unit nodeagent-workloads.service, which is not running: systemctl start"
        " nodeagent-workloads.service; or, for an agent run by hand, set"
        " agent.managed_root to a cgroup of its own such as nodeagent.slice"
    )
    assert not unit_cgroup.exists()


@pytest.mark.usefixtures("files_replace_their_value")
def test_a_managed_root_in_a_running_unit_is_made_below_it(tmp_path: Path) -> None:
    unit = tmp_path / "cgroup" / "system.slice" / "nodeagent-workloads.service"
    systemd_made(unit.parent)
    systemd_made(unit)
    prepared(tmp_path, "cpu memory pids\n", PACKAGED)
    assert (unit / "workloads" / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
