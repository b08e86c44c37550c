"""Which cgroup the agent itself is in, read from /proc/self/cgroup: one line when it cannot be
read (a proc root without it: before, `nodeagent run` died with a traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.cgroupfs.subtree import own_cgroup
from nodeagent.errors import NodeagentError


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
