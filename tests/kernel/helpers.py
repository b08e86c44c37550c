"""Helpers for real-kernel tests: make cgroups, run processes in them, build agents."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import Agent, open_agent, serve
from nodeagent.policyfile.model import PolicySpec

ROOT = "/sys/fs/cgroup"


def rel(path: str | Path) -> str:
    return os.path.relpath(path, ROOT)


def read(cgroup: str | Path, name: str) -> str:
    return Path(cgroup, name).read_text().strip()


def spawn(cgroup: str | Path, argv: list[str]) -> subprocess.Popen[bytes]:
    """Start argv already inside `cgroup`: a shell moves itself there, then execs argv."""
    enter = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
    p = subprocess.Popen(["sh", "-c", enter, str(cgroup), *argv])
    inside = wait_for(lambda: str(p.pid) in read(cgroup, "cgroup.procs").split(), timeout=30)
    assert inside, f"process {p.pid} did not enter {cgroup}"
    return p


def busy(cgroup: str | Path) -> subprocess.Popen[bytes]:
    return spawn(cgroup, ["sh", "-c", "while :; do :; done"])


def sleeper(cgroup: str | Path) -> subprocess.Popen[bytes]:
    return spawn(cgroup, ["sleep", "600"])


def hog_memory(cgroup: str | Path, mib: int) -> subprocess.Popen[bytes]:
    """A process that touches `mib` MiB of anonymous memory and holds it."""
    pages = mib << 8
    code = f"import time\nx = bytearray({pages} << 12)\nx[::4096] = b'1' * {pages}\ntime.sleep(600)"
    return spawn(cgroup, ["python3", "-c", code])


def usage_us(cgroup: str | Path) -> int:
    for line in read(cgroup, "cpu.stat").splitlines():
        key, value = line.split()
        if key == "usage_usec":
            return int(value)
    raise AssertionError(f"no usage_usec in {cgroup}/cpu.stat")


def spec(managed_root: str, tmp_path: Path, **sections: Any) -> PolicySpec:
    agent = {"managed_root": managed_root, "state_file": str(tmp_path / "state.json")}
    agent.update(sections.pop("agent", {}))
    return PolicySpec.model_validate({"version": 1, "agent": agent, **sections})


def agent(policy: PolicySpec) -> Agent:
    a = open_agent(policy, CgroupTree(ROOT))
    a.prepare()
    return a


def bind(source: str | Path, target: str | Path, mounts: list[Path]) -> None:
    """Bind-mount `source` over `target`, noted in `mounts` (the fixture unmounts it)."""
    subprocess.run(["mount", "--bind", str(source), str(target)], check=True)
    mounts.append(Path(target))


def mount_tmpfs(target: str | Path, mounts: list[Path]) -> None:
    """A fresh tmpfs over `target`: a directory where cgroupfs's rules do not hold."""
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(target)], check=True)
    mounts.append(Path(target))


class Daemon:
    """`nodeagent run --config POLICY` as an operator starts it, its output in `log`."""

    def __init__(self, policy: Path, log: Path, *options: str) -> None:
        self.log = log
        with log.open("wb") as out:
            argv = [sys.executable, "-m", "nodeagent", "run", "--config", str(policy), *options]
            self.proc = subprocess.Popen(argv, stderr=out, stdout=out)

    def stop(self) -> int:
        """SIGTERM, then its exit status; fails naming its log if it has not exited in 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            raise AssertionError(
                f"the daemon did not exit in 60 s after SIGTERM (killed; log: {self.log})"
            ) from None


def wait_for(check: Callable[[], bool], timeout: float, step: float = 0.02) -> bool:
    """Whether `check` came true within `timeout` seconds (the caller asserts, saying what)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(step)
    return check()


def wait_until(check: Callable[[], bool], timeout: float, what: str, step: float = 0.1) -> None:
    """Return once `check` is true; fail naming `what` and the ceiling when `timeout` passes."""
    if not wait_for(check, timeout, step):
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@contextlib.contextmanager
def running(policy: PolicySpec) -> Iterator[Agent]:
    """The agent's loop and API in this process, as `nodeagent run` serves them."""
    a = agent(policy)
    server = serve(a)
    loop = threading.Thread(target=a.run, daemon=True)
    loop.start()
    try:
        assert wait_for(lambda: a.rec.last is not None, timeout=60), "no first tick"
        yield a
    finally:
        a.stop.set()
        loop.join(timeout=30)
        server.close()
    assert not loop.is_alive(), "the agent's loop did not end in 30 s after stop"
