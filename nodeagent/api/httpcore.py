"""The HTTP core the API and the metrics servers are thin users of.

One selector thread per server does what both need and neither should do its own way:
accepting (a batch per wake-up; an accept() short of descriptors pauses listening, longer
each time, instead of spinning, so the reconcile loop keeps the descriptors it needs),
learning who is on the other end before any byte of the request (a `Caller`), admitting by
one per-peer fairness scheme (`Pool`), refusing with a status, and keeping a refused
connection until its client hangs up (closed earlier, a client still sending gets EPIPE
instead of its answer).

The peer a slot is counted against is the uid that holds the other end: from its peer
credentials over a Unix socket, from the kernel's socket table over TCP from this host
(`LoopbackPeers`). Root and the daemon's own user have no cap of their own, and the
reserved slots are theirs; nor has a TCP peer on another host, whose uid no one knows (an
address would be no better: behind a proxy or a NAT every scraper has the same one, and a
cap on it would turn their ninth scrape away instead of queueing it), which is for a
firewall to bound.

A user of the core says what it does with a caller (`admit`), whether it takes newcomers
in now (`room`; else they wait in the kernel's listen queue, costing nothing), what is due
when (`wakes`, `due`) and what to do with a connection it registered that is ready
(`ready`). The API serves each admitted connection on a thread of its own, for its routes
may block; the metrics serve theirs in the core's thread, without blocking.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import structlog

from nodeagent.api.peer import LoopbackPeers, Peer, peer_allowed, read_peer

log = structlog.get_logger("nodeagent.http")

_ACCEPT_BATCH = 64  # connections taken in per wake-up before anything else is looked at
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 2.0  # seconds, for an accept() short of resources
_REFUSAL_LOG_EVERY = 10.0  # seconds: one refused line per peer and status, then a count
LINGER = 2.0  # seconds a refused connection is kept open to take in what its client sends
_LINGER_MAX, _LINGER_PER_PEER = 32, 8  # refused connections kept so, in all and per peer
_DRAIN = 65536  # bytes read at a time from a connection whose request is not wanted


@dataclass(slots=True)
class Pool:
    """Connection slots counted by who holds them, so that one user's connections cannot
    crowd out another's, nor anyone's crowd out root's.

    A pool has `size` slots. `reserved` of them only uncapped callers (`Caller.uncapped`:
    root and the daemon's own user) may take; every other uid may hold at most `per_peer`
    at once, and together they hold at most `size - reserved`. Uncapped callers have no cap
    of their own. The caller holds the lock, if any: a pool is plain bookkeeping."""

    size: int
    reserved: int
    per_peer: int
    _held: Counter[int | None] = field(default_factory=Counter)
    _uncapped: int = 0
    _total: int = 0

    @property
    def full(self) -> bool:
        return self._total >= self.size

    def fits(self, uid: int | None, uncapped: bool) -> bool:
        """Whether `uid` may take a slot now."""
        if self.full:
            return False
        if uncapped:
            return True
        capped = self._total - self._uncapped
        return self._held[uid] < self.per_peer and capped < self.size - self.reserved

    def capped(self, uid: int | None, uncapped: bool) -> bool:
        """Whether `uid` holds all it may: room must come from its own slots."""
        return not uncapped and self._held[uid] >= self.per_peer

    def take(self, uid: int | None, uncapped: bool) -> None:
        self._total += 1
        if uncapped:
            self._uncapped += 1
        else:
            self._held[uid] += 1

    def give(self, uid: int | None, uncapped: bool) -> None:
        self._total -= 1
        if uncapped:
            self._uncapped -= 1
        else:
            self._held[uid] -= 1
            if not self._held[uid]:
                del self._held[uid]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is on the other end of an accepted connection, known before any byte of it."""

    uid: int | None
    """The uid holding the other end; None for a TCP peer on another host."""
    privileged: bool
    """Root or the daemon's own user."""
    peer: Peer | None = None
    """Its credentials, over a Unix socket."""
    allowed: bool = True
    """Over a Unix socket: root, the daemon's user, or a member of the socket's group."""

    @property
    def uncapped(self) -> bool:
        """Held to no per-peer cap: privileged, or a peer that cannot be told apart."""
        return self.privileged or self.uid is None


def response(
    status: int,
    body: bytes,
    content_type: str,
    headers: Iterable[tuple[str, str]] = (),
    *,
    version: str = "HTTP/1.1",
    head_only: bool = False,
) -> bytes:
    """A whole answer, after which the connection ends."""
    lines = [
        f"{version} {status} {HTTPStatus(status).phrase}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers),
    ]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + body


def drained(conn: socket.socket) -> bool:
    """Read and drop what a non-blocking connection's client has sent so far, so that
    closing it does not reset it before its client has read the answer; whether the client
    has hung up."""
    try:
        while True:
            if not conn.recv(_DRAIN):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def readable(sock: socket.socket) -> bool:
    """Whether a recv() would not block: data, an end or an error waits."""
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Lingering:
    """The selector's data for a refused connection kept until its client hangs up."""

    __slots__ = ("conn", "uid", "until")

    def __init__(self, conn: socket.socket, uid: int | None, until: float) -> None:
        self.conn, self.uid, self.until = conn, uid, until


class HttpCore:
    """One listener served from one selector thread; see the module's docstring.

    `serve(listener)` starts the thread; `stop()` ends it and closes what the core holds
    (the listener, the refused connections it kept); the user closes its own."""

    selector: selectors.BaseSelector
    """Made by `serve`; a user registers its connections here with data for `ready`."""
    _wake_r: socket.socket
    _wake_w: socket.socket

    def __init__(self, name: str, *, own_uid: int, group_gid: int | None = None) -> None:
        self.name = name
        """The servers' log events are `{name}.accept_failed`, `{name}.refused` and so on."""
        self.own_uid = own_uid
        self.group_gid = group_gid
        self.closing = False
        self._listener: socket.socket | None = None
        self._loopback: LoopbackPeers | None = None
        self._listening = False
        self._failures, self._paused_until = 0, 0.0
        self._lingering: dict[socket.socket, _Lingering] = {}
        self._refusals: dict[tuple[int | None, int], tuple[float, int]] = {}
        self._thread: threading.Thread | None = None

    # --- what a user says ----------------------------------------------------------------

    def admit(self, conn: socket.socket, caller: Caller) -> None:
        """Take `conn` in, make it wait, or refuse it."""
        raise NotImplementedError

    def room(self, now: float) -> bool:
        """Whether to accept newcomers now (else they wait in the kernel's listen queue)."""
        return True

    def wakes(self, now: float) -> Iterable[float]:
        """When something of the user's falls due (`due` is then called)."""
        return ()

    def due(self, now: float) -> None:
        """Called every turn, after the ready connections are read, before newcomers."""

    def ready(self, data: Any, events: int) -> None:
        """A connection the user registered with `data` is ready."""

    # --- what the core does --------------------------------------------------------------

    def serve(self, listener: socket.socket) -> None:
        """Serve `listener` (non-blocking) from a thread of the core's own."""
        listener.setblocking(False)
        self._listener = listener
        # made here, not in the thread, so that they cannot fail for want of descriptors later
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.selector.register(self._wake_r, selectors.EVENT_READ)
        if listener.family != socket.AF_UNIX:
            self._loopback = LoopbackPeers.open()
            if self._loopback is None:
                log.warning(
                    f"{self.name}.peer_uids_unknown",
                    why="no AF_NETLINK socket (sock_diag): local users share one connection cap",
                )
        self._thread = threading.Thread(target=self._loop, name=f"nodeagent-{self.name}")
        self._thread.daemon = True
        self._thread.start()

    @property
    def address(self) -> Any:
        """Where the listener listens (its getsockname())."""
        assert self._listener is not None
        return self._listener.getsockname()

    def wake(self) -> None:
        """Make the thread look again now (a slot came free, say)."""
        with contextlib.suppress(OSError):  # full: it is awake already
            self._wake_w.send(b"x")

    def stop(self) -> None:
        """End the thread; close the listener and the refused connections kept."""
        self.closing = True
        if self._thread is None:
            return
        self.wake()
        self._thread.join(timeout=5)
        for conn in list(self._lingering):  # the thread has ended: no one else has them
            self._stop_lingering(conn)
        self.selector.close()
        assert self._listener is not None
        self._listener.close()
        if self._loopback is not None:
            self._loopback.close()
        self._wake_r.close()
        self._wake_w.close()

    def refuse(
        self, conn: socket.socket, caller: Caller, status: int, answer: bytes, message: str
    ) -> None:
        """Send `answer` without reading the request and end our side; never blocks. The
        connection lingers until its client hangs up, within bounds: closed now, a client
        that has not sent its request yet gets EPIPE when it does, and one whose request we
        have not read gets a reset instead of the answer (af_unix)."""
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.send(answer)
            conn.shutdown(socket.SHUT_WR)
        self._log_refusal(caller, status, message)
        if drained(conn) or self.closing:
            conn.close()
            return
        # making room by closing the oldest of the same peer, else the oldest of all
        mine = [c for c, held in self._lingering.items() if held.uid == caller.uid]
        if len(mine) >= _LINGER_PER_PEER:
            self._stop_lingering(mine[0])
        elif len(self._lingering) >= _LINGER_MAX:
            self._stop_lingering(next(iter(self._lingering)))
        held = _Lingering(conn, caller.uid, time.monotonic() + LINGER)
        self._lingering[conn] = held
        self.selector.register(conn, selectors.EVENT_READ, held)

    def _loop(self) -> None:
        while not self.closing:
            try:
                self._turn()
            except Exception:  # a bug: log it, and keep the endpoint up
                log.exception(f"{self.name}.loop_failed")
                time.sleep(0.1)

    def _turn(self) -> None:
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
        self._listen(not self._paused_until and self.room(now))
        wakes = [*self.wakes(now), *(held.until for held in self._lingering.values())]
        if self._paused_until:
            wakes.append(self._paused_until)
        wait = max(0.0, min(min(wakes, default=now + 1.0) - now, 1.0))
        events = self.selector.select(wait)
        if self.closing:
            return
        accept = False
        for key, mask in events:
            if key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            elif key.fileobj is self._listener:
                accept = True
            elif isinstance(key.data, _Lingering):
                conn = key.data.conn
                if conn in self._lingering and drained(conn):
                    self._stop_lingering(conn)
            else:
                self.ready(key.data, mask)
        # what is due after what was read (a connection dropped at its deadline with its
        # last bytes unread would be reset, not closed), and before any newcomer
        now = time.monotonic()
        self.due(now)
        for conn, held in list(self._lingering.items()):
            if now >= held.until:
                self._stop_lingering(conn)
        if accept:
            self._accept_some()

    def _listen(self, listen: bool) -> None:
        """Take new connections in, or leave them in the kernel's listen queue."""
        assert self._listener is not None
        if listen and not self._listening:
            self.selector.register(self._listener, selectors.EVENT_READ)
        elif self._listening and not listen:
            self.selector.unregister(self._listener)
        self._listening = listen

    def _accept_some(self) -> None:
        assert self._listener is not None
        for _ in range(_ACCEPT_BATCH):
            if not self.room(time.monotonic()):
                return  # the rest wait in the listen queue
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # none left, a signal, or a client that gave up
            except OSError as exc:
                # EMFILE, ENFILE, ENOBUFS, ENOMEM: the listener stays readable, so retrying
                # at once would spin; stop listening a while, longer each time.
                if self._failures == 0:
                    log.error(
                        f"{self.name}.accept_failed", error=one_line(exc), action="backing off"
                    )
                self._failures += 1
                backoff = min(_BACKOFF_FIRST * 2 ** (self._failures - 1), _BACKOFF_MAX)
                self._paused_until = time.monotonic() + backoff
                self._listen(False)
                return
            if self._failures:
                log.info(f"{self.name}.accept_recovered", failures=self._failures)
                self._failures = 0
            conn.setblocking(False)
            caller = self._caller(conn)
            if caller is None:
                conn.close()
            else:
                self.admit(conn, caller)

    def _caller(self, conn: socket.socket) -> Caller | None:
        privileged = (0, self.own_uid)
        if conn.family == socket.AF_UNIX:
            try:
                peer = read_peer(conn)
            except OSError as exc:
                log.warning(f"{self.name}.peercred_failed", error=one_line(exc))
                return None
            allowed = peer_allowed(peer, self.own_uid, self.group_gid)
            return Caller(peer.uid, peer.uid in privileged, peer, allowed)
        uid = None if self._loopback is None else self._loopback.uid(conn)
        return Caller(uid, uid in privileged)  # None: a peer on another host

    def _stop_lingering(self, conn: socket.socket) -> None:
        del self._lingering[conn]
        with contextlib.suppress(KeyError, ValueError, OSError):  # closed with the selector
            self.selector.unregister(conn)
        conn.close()

    def _log_refusal(self, caller: Caller, status: int, message: str) -> None:
        """One refused line per peer and status every few seconds, with how many more."""
        now = time.monotonic()
        last, since = self._refusals.get((caller.uid, status), (-_REFUSAL_LOG_EVERY, 0))
        if now - last < _REFUSAL_LOG_EVERY:
            self._refusals[(caller.uid, status)] = (last, since + 1)
            return
        self._refusals[(caller.uid, status)] = (now, 0)
        peer = caller.peer
        log.warning(
            f"{self.name}.refused",
            uid=caller.uid,
            pid=None if peer is None else peer.pid,
            status=status,
            error=message,
            more=since,
        )
