"""The agent never tightens its own cgroup or one above it: no freeze, no cap, no lower
weight or protection, whatever a plan says (a rule that claims the agent's own container,
a policy that throttles its class). Frozen, the agent could never thaw itself; capped, it
could not keep the promise it makes to everything else. The executor, the one writer,
asks `SelfGuard.refuses` before every write that tightens: a guard by construction, not a
rule an operator must remember to write.

Where the agent's cgroup is: /proc/self/cgroup names it relative to the agent's cgroup
namespace root. With no namespace of its own (a systemd service) that is the tree's own
path, and the guarded cgroups are it and its ancestors. In a private cgroup namespace (a
Kubernetes pod: containerd's default on cgroup v2) it reads `/`, which says nothing about
where the container sits in the host's tree: there a cgroup is guarded when the agent's
own process is in it or below it, as its `cgroup.procs` files say (the kernel lists each
process by the number the reader's PID namespace gives it, so the agent finds its own).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from nodeagent.cgroupfs.subtree import own_cgroup
from nodeagent.cgroupfs.tree import CgroupTree, CgroupVanished
from nodeagent.errors import NodeagentError

MOST_SEARCHED = 512
"""Cgroups a search for the agent's process reads at most; past that the cgroup is
guarded: one tick's tightening of a tree that large is rare, and never worth a frozen
agent."""


class SelfGuard:
    """Which cgroups hold the agent (see the module's docstring); `begin` once per apply.

    `every`: read where the agent is at most once in that many seconds (of `clock`), so
    that a burst of newcomers, each its own apply on the fast path, costs one read of
    /proc/self/cgroup, not one each. The agent moves itself only at start, before its
    first apply; whoever else moves it is seen within `every`. 0: read at every `begin`."""

    def __init__(
        self,
        tree: CgroupTree,
        proc_root: str = "/proc",
        pid: int | None = None,
        *,
        every: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.tree, self.proc_root = tree, proc_root
        self.pid = os.getpid() if pid is None else pid
        self.every, self.clock = every, clock
        self._read_at: float | None = None
        """When `begin` last read where the agent is (on `clock`); None: never."""
        self._own: str | None = None
        """The agent's cgroup in the tree; None while only a search can tell."""
        self._namespaced = False
        self._found: str | None = None
        """Where a search last found the agent's process (namespaced): checked with one read
        at the next `begin` instead of searched again every tick."""

    def begin(self) -> None:
        """Read where the agent is now (it moves into a leaf of its own at start), unless
        that was read less than `every` seconds ago."""
        now = self.clock()
        if self._read_at is not None and now - self._read_at < self.every:
            return
        self._read_at = now
        try:
            own = own_cgroup(self.proc_root)
        except NodeagentError:
            own = ""
        self._namespaced = own == "" and not self._in("")
        if not self._namespaced:
            self._own = own
        elif self._found is not None and self._in(self._found):
            self._own = self._found
        else:  # "/" is the namespace's root, not the tree's: only a search can tell
            self._own = self._found = None

    def refuses(self, path: str) -> str | None:
        """Why `path` may not be tightened (the agent is in it or below it); None: it may."""
        if self._own is None:
            found, complete = self._search(path)
            if not complete:
                return (
                    f"more than {MOST_SEARCHED} cgroups below {path or '/'}: the agent's own"
                    " process may be among them, and its cgroups are never tightened"
                )
            if found is None:
                return None
            self._own = self._found = found
        if path in (self._own, "") or self._own.startswith(path + "/"):
            who = f"the agent's process {self.pid}" if self._namespaced else "the agent"
            return (
                f"{who} runs in {self._own or '/'}: its own cgroup and those above it are"
                " never tightened"
            )
        return None

    def _in(self, path: str) -> bool:
        """Whether the agent's process is in cgroup `path` itself."""
        try:
            with self.tree.open(path) as d:
                return str(self.pid) in d.read("cgroup.procs").split()
        except (CgroupVanished, NodeagentError, OSError):
            return False

    def _search(self, path: str) -> tuple[str | None, bool]:
        """The cgroup at or below `path` that holds the agent's process (None: none), and
        whether the search was complete (False past MOST_SEARCHED cgroups)."""
        todo, seen = [path], 0
        while todo:
            at = todo.pop()
            seen += 1
            if seen > MOST_SEARCHED:
                return None, False
            if self._in(at):
                return at, True
            try:
                with self.tree.open(at) as d:
                    todo.extend(f"{at}/{name}" if at else name for name in d.subdirs())
            except (CgroupVanished, NodeagentError, OSError):
                continue
        return None, True
