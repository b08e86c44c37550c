"""Whether each service the agent asks answers: the container runtimes' sockets, Slurm's
squeue, the system bus, the kubelet's PodResources and the API server's watch.

Each adapter says here how every exchange went (`ok`, `failed`); the loop copies the whole
into each tick's record (`now`), and the metrics and /v1/status show it from there: each
peer answering or not, since when, when it last answered, and what failed. A peer is
listed from its first exchange on, so that "not asked yet" and "answered" are never
confused; a runtime the node never had (its socket never there: docker on a node of
containerd's) is not listed, one that was there and went is listed as down.

The API server's watch runs on threads of its own: `ok` and `failed` take a lock, and `now`
returns frozen records.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Reach:
    """One peer as its last exchange left it; times are Unix times."""

    name: str
    """What it is: docker, podman, podman@1000, containerd, crio, slurm, systemd,
    pod-resources, api-server/pods..."""
    address: str
    """Where: a socket's path, a command, a bus address."""
    up: bool
    """Whether its last exchange succeeded."""
    since: float
    """When `up` last changed (its first exchange, if never)."""
    last_ok: float | None
    """Its last exchange that succeeded; None if none has."""
    error: str | None
    """While down: what failed, in one line."""


class Reachability:
    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self._lock = threading.Lock()
        self._peers: dict[str, Reach] = {}
        self._now: tuple[Reach, ...] | None = ()
        """`now`'s answer, kept until an exchange changes a peer (None: make it again)."""

    def ok(self, name: str, address: str) -> None:
        """An exchange with `name` succeeded."""
        now = self._wall()
        with self._lock:
            was = self._peers.get(name)
            if was is None or not was.up or was.address != address:
                self._peers[name] = Reach(name, address, True, now, now, None)
            else:
                self._peers[name] = replace(was, last_ok=now)
            self._now = None

    def failed(self, name: str, address: str, error: str) -> None:
        """An exchange with `name` failed with `error` (one line)."""
        now = self._wall()
        with self._lock:
            was = self._peers.get(name)
            if was is None:
                self._peers[name] = Reach(name, address, False, now, None, error)
            elif was.up or was.address != address:
                self._peers[name] = Reach(name, address, False, now, was.last_ok, error)
            elif was.error != error:
                self._peers[name] = replace(was, error=error)
            else:
                return
            self._now = None

    def known(self, name: str) -> bool:
        """Whether `name` was ever asked, whatever the answer."""
        with self._lock:
            return name in self._peers

    def now(self) -> tuple[Reach, ...]:
        """Every peer's state, by name."""
        with self._lock:
            if self._now is None:
                self._now = tuple(sorted(self._peers.values(), key=lambda r: r.name))
            return self._now
