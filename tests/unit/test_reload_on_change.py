"""agent.reload_on_change: a policy file replaced as the kubelet updates a mounted ConfigMap
(an atomic swap of the `..data` symlink) is reloaded by the running loop, as on SIGHUP.

The ConfigMap volume's layout is made here as the kubelet's AtomicWriter makes it
(pkg/volume/util/atomic_writer.go): a timestamped directory with the files, `..data`
pointing at it, and each key a symlink through `..data`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import structlog

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import Agent, open_agent
from nodeagent.policyfile.filewatch import FileWatch
from nodeagent.policyfile.load import load_policy

POLICY = """\
version: 1
agent:
  interval: 0.05
  reload_on_change: {reload}
  state_file: {state}
tenants:
{tenants}
"""


def write_configmap(volume: Path, generation: int, text: str) -> None:
    """One kubelet update: a new data directory, then `..data` swapped to it by rename."""
    data = volume / f"..2026_12_01_00_00_0{generation}.000000001"
    data.mkdir()
    (data / "policy.yaml").write_text(text)
    link = volume / "..data_tmp"
    link.symlink_to(data.name)
    os.rename(link, volume / "..data")
    key = volume / "policy.yaml"
    if not key.is_symlink():
        key.symlink_to("..data/policy.yaml")


def policy(tmp_path: Path, tenants: list[str], reload: bool = True) -> str:
    return POLICY.format(
        reload=str(reload).lower(),
        state=tmp_path / "state.json",
        tenants="".join(f"  {t}: {{shares: 1}}\n" for t in tenants),
    )


@contextlib.contextmanager
def running_agent(tmp_path: Path, first: str) -> Iterator[tuple[Agent, Path]]:
    """The loop running in a thread on a ConfigMap volume whose first policy is `first`;
    the agent and the volume, the loop stopped after."""
    volume = tmp_path / "config"
    volume.mkdir()
    write_configmap(volume, 1, first)
    (tmp_path / "cgroup").mkdir()
    path = str(volume / "policy.yaml")
    agent = open_agent(load_policy(path), CgroupTree(str(tmp_path / "cgroup")), dry_run=True,
                  config_path=path)  # fmt: skip
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        yield agent, volume
    finally:
        agent.stop.set()
        thread.join(10)


def wait_for(check: object, seconds: float = 20.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if callable(check) and check():
            return True
        time.sleep(0.02)
    return False


def test_a_configmap_update_is_reloaded_by_the_loop(tmp_path: Path) -> None:
    with running_agent(tmp_path, policy(tmp_path, ["research"])) as (agent, volume):
        assert wait_for(lambda: agent.rec.last is not None)
        with structlog.testing.capture_logs() as logs:
            write_configmap(volume, 2, policy(tmp_path, ["research", "prod"]))
            assert wait_for(lambda: set(agent.rec.spec.tenants) == {"research", "prod"})
        assert [e["file"] for e in logs if e["event"] == "policy.reloaded"] == [
            str(volume / "policy.yaml")
        ]


def test_a_bad_update_keeps_the_last_good_policy_and_the_next_good_one_applies(
    tmp_path: Path,
) -> None:
    with running_agent(tmp_path, policy(tmp_path, ["research"])) as (agent, volume):
        assert wait_for(lambda: agent.rec.last is not None)
        with structlog.testing.capture_logs() as logs:
            write_configmap(volume, 2, "version: 1\ntenants: {research: {shares: -1}}\n")
            assert wait_for(lambda: any(e["event"] == "policy.invalid" for e in logs))
        assert set(agent.rec.spec.tenants) == {"research"}
        assert agent.last_reload[0] is False
        write_configmap(volume, 3, policy(tmp_path, ["research", "prod"]))
        assert wait_for(lambda: set(agent.rec.spec.tenants) == {"research", "prod"})


def test_without_the_setting_a_changed_file_waits_for_sighup(tmp_path: Path) -> None:
    with running_agent(tmp_path, policy(tmp_path, ["research"], reload=False)) as (agent, volume):
        first = agent.rec.last
        write_configmap(volume, 2, policy(tmp_path, ["research", "prod"], reload=False))
        # ticks go on (a new record each), the policy stays until it is asked for
        assert wait_for(lambda: agent.rec.last is not None and agent.rec.last is not first)
        seq = agent.rec.last.snapshot.seq if agent.rec.last else 0
        assert wait_for(
            lambda: agent.rec.last is not None and agent.rec.last.snapshot.seq >= seq + 3
        )
        assert set(agent.rec.spec.tenants) == {"research"}
        agent.reload_requested.set()
        assert wait_for(lambda: set(agent.rec.spec.tenants) == {"research", "prod"})


def test_the_watch_reports_each_change_once_and_a_missing_file_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("a")
    watch = FileWatch(str(path))
    assert not watch.changed()
    replacement = tmp_path / "new"
    replacement.write_text("b")
    os.rename(replacement, path)  # a new inode, as `install` or an editor's save makes
    assert watch.changed()
    assert not watch.changed()
    path.unlink()
    assert not watch.changed()  # gone: nothing to load
    path.write_text("c")
    assert watch.changed()
