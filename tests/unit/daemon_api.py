"""A daemon on a plain directory tree, called through its routes as several users.

The cgroup root is a plain directory (a stand-in: no kernel here), whose mkdir also makes
the interface files a job's start writes, and whose cgroup.events says whether cgroup.procs
holds a process, as the kernel's does (so the loop's reaper sees a job end); /proc for the
jobs' pid checks is a plain tree of status files; the GPUs are a simulated node (a
labelled fake, written per test); the callers are Peer records as SO_PEERCRED would give
them. Each call goes through the same route handler the API server runs, so an error is
the Refused (and status) the client would get, and anything else would have been a 500.
"""

from __future__ import annotations

import functools
import json
import os
import textwrap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.api.peer import Peer
from nodeagent.api.server import Request
from nodeagent.api.wire import encode
from nodeagent.cgroupfs.tree import CgroupDir, CgroupTree
from nodeagent.daemon import Agent, open_agent
from nodeagent.errors import Refused
from nodeagent.gpualloc.service import process_uids
from nodeagent.policyfile.model import PolicySpec

ROOT = Peer(pid=3000, uid=0, gid=0, groups=frozenset())
ALICE = Peer(pid=4000, uid=1000, gid=1000, groups=frozenset({1000}))
BOB = Peer(pid=5000, uid=1001, gid=1001, groups=frozenset({1001}))
CID = "4f1c2a9be7d3" + "0123456789abcdef" * 3 + "0123"
FILES = {
    "cgroup.procs": "",
    "cgroup.events": "populated 0\nfrozen 0\n",  # a new cgroup is empty
    "cpu.weight": "100",
    "cpu.max": "max 100000",
    "memory.current": "0",
    "memory.high": "max",
    "memory.max": "max",
    "pids.max": "max",  # the agent enables pids down to the managed root where offered
}

GPUS = """\
gpus:
  - {index: 0, uuid: GPU-00000000-0000-0000-0000-000000000000, name: Sim, memory: 80Gi,
     numa_node: 0, cpus: 0-3, pci_bus_id: '00000000:17:00.0'}
  - {index: 1, uuid: GPU-11111111-1111-1111-1111-111111111111, name: Sim, memory: 80Gi,
     numa_node: 0, cpus: 0-3, pci_bus_id: '00000000:65:00.0'}
links:
  - {gpus: [0, 1], pcie: NODE, nvlinks: 12}
"""


def set_populated(cgroup: Path) -> None:
    """cgroup.events' populated as the kernel keeps it: 1 while cgroup.procs holds a pid."""
    events = cgroup / "cgroup.events"
    if events.exists():
        populated = int(bool((cgroup / "cgroup.procs").read_text().split()))
        lines = [
            f"populated {populated}" if line.startswith("populated ") else line
            for line in events.read_text().splitlines()
        ]
        events.write_text("\n".join(lines) + "\n")


class FilesDir(CgroupDir):
    """A cgroup of FilesTree: a pid written to cgroup.procs populates it."""

    def write(self, name: str, value: str) -> None:
        super().write(name, value)
        if name == "cgroup.procs":
            set_populated(Path(f"/proc/self/fd/{self.fd}").resolve())


class FilesTree(CgroupTree):
    """A plain directory as the cgroup root: a new cgroup gets the files a job's start
    writes, as the kernel would make them."""

    def mkdir(self, path: str) -> bool:
        made = super().mkdir(path)
        if made:
            for name, text in FILES.items():
                Path(self.root, path, name).write_text(text)
        return made

    @contextmanager
    def open(self, path: str) -> Iterator[CgroupDir]:
        fd = self.open_fd(path)
        try:
            yield FilesDir(path, fd)
        finally:
            os.close(fd)


class AlwaysAlive:
    """A stand-in for a pidfd: the fake /proc's processes never end."""

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


@dataclass
class Daemon:
    agent: Agent
    root: Path
    proc: Path
    _next_pid: int = 0

    def call(
        self,
        peer: Peer,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        query: Mapping[str, str] | None = None,
    ) -> Any:
        """The route's answer as the client decodes it (the wire's JSON)."""
        handler = self.agent.routes()[path][method]
        answer = handler(Request(method, path, dict(query or {}), peer, dict(body or {})))
        return json.loads(encode(answer))

    def refused(self, peer: Peer, method: str, path: str, body: Any = None, **kw: Any) -> Refused:
        """The Refused a call must end in (a 4xx, never anything else)."""
        try:
            got = self.call(peer, method, path, body, **kw)
        except Refused as e:
            return e
        raise AssertionError(f"{method} {path} {body} as uid {peer.uid} was accepted: {got}")

    def child(self, peer: Peer) -> int:
        """A pid that /proc says is a child of the calling process, of its uid."""
        self._next_pid += 1
        pid = peer.pid + self._next_pid
        (self.proc / str(pid)).mkdir(parents=True)
        (self.proc / str(pid) / "status").write_text(
            f"Name:\tsh\nPPid:\t{peer.pid}\nUid:\t{peer.uid}\t{peer.uid}\t{peer.uid}\t{peer.uid}\n"
        )
        return pid

    def run_in(self, peer: Peer, *cgroups: str) -> None:
        """A process of `peer`'s uid in each cgroup (made if need be): what says whose a
        container is, which a reservation binds to only if it is its uid's."""
        for cgroup in cgroups:
            os.makedirs(self.root / cgroup, exist_ok=True)
            procs = self.root / cgroup / "cgroup.procs"
            had = procs.read_text() if procs.exists() else ""
            procs.write_text(had + f"{self.child(peer)}\n")

    def ask(self, peer: Peer, name: str, count: int = 1, /, **body: Any) -> Any:
        return self.call(peer, "POST", "/v1/gpus/requests", {"name": name, "count": count, **body})

    def start(self, peer: Peer, name: str, **body: Any) -> Any:
        """Start a job as `peer` (with a GPU grant when gpu_request is given)."""
        return self.call(peer, "POST", "/v1/jobs", {"name": name, "pid": self.child(peer), **body})

    def exit(self, name: str) -> None:
        """The job's command has exited: its cgroup is empty (the stand-in: no procs left,
        cgroup.events' populated 0)."""
        cgroup = self.root / "nodeagent.slice" / name
        (cgroup / "cgroup.procs").write_text("")
        set_populated(cgroup)

    def holds(self) -> list[tuple[str, str]]:
        return sorted((str(h.owner), str(h.kind)) for h in self.agent.rec.gpus.ledger.holds())

    def jobs(self) -> list[str]:
        return sorted(j["name"] for j in self.call(ROOT, "GET", "/v1/jobs")["jobs"])


def daemon(tmp_path: Path, policy: Mapping[str, Any] | None = None, gpus: str = GPUS) -> Daemon:
    """A daemon with tenants research and prod (research the default), on a 2-GPU node."""
    root = tmp_path / "cgroup"
    (root / "nodeagent.slice").mkdir(parents=True)
    node = tmp_path / "gpus.yaml"
    node.write_text(textwrap.dedent(gpus))
    given = dict(policy or {})
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"state_file": str(tmp_path / "state.json"), **given.pop("agent", {})},
            "tenants": {"research": {"shares": 1}, "prod": {"shares": 1}},
            "jobs": {"default_tenant": "research", **given.pop("jobs", {})},
            "gpu": {"simulate": str(node), **given.pop("gpu", {})},
            **given,
        }
    )
    agent = open_agent(spec, FilesTree(str(root)))
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    agent.rec.jobs.proc_root = str(proc)
    agent.rec.gpus.uids = functools.partial(process_uids, agent.rec.tree.root, proc_root=str(proc))
    agent.rec.jobs.open_process = lambda pid: AlwaysAlive()
    agent.tick()  # reads the GPUs
    assert agent.rec.gpus.state is not None, "the simulated GPUs were read"
    return Daemon(agent, root, proc)


def restart(d: Daemon) -> Daemon:
    """The same daemon started again on its state file."""
    agent = open_agent(d.agent.rec.spec, FilesTree(str(d.root)))
    agent.rec.jobs.proc_root = str(d.proc)
    uids = functools.partial(process_uids, agent.rec.tree.root, proc_root=str(d.proc))
    agent.rec.gpus.uids = uids
    agent.rec.jobs.open_process = lambda pid: AlwaysAlive()
    agent.tick()
    return Daemon(agent, d.root, d.proc, d._next_pid)


def mkdirs(root: Path, *paths: str) -> None:
    for p in paths:
        os.makedirs(root / p, exist_ok=True)
