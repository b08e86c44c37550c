"""Proves the real-kernel harness works: a cgroup2 root with cpu and memory, and cgroups we make.

Keep these tests: if they fail, no other kernel test result means anything.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def test_cgroup2_root_offers_cpu_and_memory() -> None:
    assert os.environ.get("NODEAGENT_REAL_KERNEL") == "1", "not started through scripts/lib.sh"
    controllers = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
    assert "cpu" in controllers
    assert "memory" in controllers


def test_create_and_remove_a_child_cgroup() -> None:
    base = CGROUP_ROOT / f"nodeagent-test-env-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    child = base / "child"
    base.mkdir()
    try:
        child.mkdir()
        # the kernel populates a new cgroup's interface files itself
        assert (child / "cgroup.procs").read_text() == ""
        assert (child / "cgroup.controllers").exists()
        child.rmdir()
        assert not child.exists()
    finally:
        for cgroup in (child, base):
            if cgroup.exists():
                cgroup.rmdir()
    assert not base.exists()


def test_sandbox_holds_a_limited_process_and_cleans_it_up(cgroup_sandbox: Path) -> None:
    leaf = cgroup_sandbox / "leaf"
    leaf.mkdir()
    assert {"cpu", "memory"} <= set((leaf / "cgroup.controllers").read_text().split())
    (leaf / "memory.max").write_text(str(64 * 1024 * 1024))
    (leaf / "cpu.max").write_text("50000 100000")
    assert (leaf / "memory.max").read_text().strip() == str(64 * 1024 * 1024)
    assert (leaf / "cpu.max").read_text().split() == ["50000", "100000"]

    # left running on purpose: the fixture's teardown must kill it and remove the tree
    sleeper = subprocess.Popen(["sleep", "600"])
    (leaf / "cgroup.procs").write_text(str(sleeper.pid))
    assert str(sleeper.pid) in (leaf / "cgroup.procs").read_text().split()
    membership = (Path("/proc") / str(sleeper.pid) / "cgroup").read_text().strip()
    assert membership == f"0::/{cgroup_sandbox.name}/leaf"


def test_the_loopback_interface_carries_tcp() -> None:
    """The metrics tests listen on 127.0.0.1: on a minimal Debian virtme-ng left `lo` down
    (no iproute2), and they failed for that alone; scripts/lib.sh brings it up."""
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname(), timeout=10) as client,
    ):
        peer, _ = server.accept()
        with peer:
            client.sendall(b"ping")
            assert peer.recv(4) == b"ping"
