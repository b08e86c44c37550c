"""Who is on the other end of a Unix socket, as the kernel recorded it at connect() time.

SO_PEERCRED and SO_PEERGROUPS are captured when the client connects, so neither a later
setuid in the client nor its pid being reused can change the answer. That is why the groups
come from SO_PEERGROUPS only, never from /proc/<pid>/status (which by then may describe
another process).

CPython's `socket.getsockopt` refuses buffers over 1024 bytes (256 groups), and a peer may
have up to NGROUPS_MAX (65536) groups. So SO_PEERGROUPS is read through libc's getsockopt
with ctypes: on ERANGE the kernel writes back the size it needs, and the second call gets
them all. Every kernel with the cgroup v2 cpu controller (4.15+) has SO_PEERGROUPS (4.13+).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
from dataclasses import dataclass

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# Not exported by Python's socket module; 59 on every Linux architecture nodeagent targets.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_GID_SIZE = ctypes.sizeof(ctypes.c_uint32)
_FIRST_GUESS = 64  # groups; a second call fetches any more

_libc = ctypes.CDLL(None, use_errno=True)
_getsockopt = _libc.getsockopt
_getsockopt.argtypes = [
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint32),
]
_getsockopt.restype = ctypes.c_int


@dataclass(frozen=True, slots=True)
class Peer:
    """The credentials of the process on the other end of a connection."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]


def peer_allowed(peer: Peer, own_uid: int, group_gid: int | None) -> bool:
    """The access decision: root, the daemon's own user, or a member of the socket's group."""
    if peer.uid in (0, own_uid):
        return True
    if group_gid is None:
        return False
    return peer.gid == group_gid or group_gid in peer.groups


def read_peer(conn: socket.socket) -> Peer:
    """SO_PEERCRED and SO_PEERGROUPS of a connected Unix socket; OSError when unreadable."""
    pid, uid, gid = _PEERCRED.unpack(
        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return Peer(pid=pid, uid=uid, gid=gid, groups=peer_groups(conn.fileno()))


def peer_groups(fd: int) -> frozenset[int]:
    """All supplementary groups of the peer of socket `fd`, however many."""
    size = ctypes.c_uint32(_FIRST_GUESS * _GID_SIZE)
    for _ in range(2):  # the group list is fixed at connect(), so the second size is right
        gids = (ctypes.c_uint32 * (size.value // _GID_SIZE))()
        if _getsockopt(fd, socket.SOL_SOCKET, _SO_PEERGROUPS, gids, ctypes.byref(size)) == 0:
            return frozenset(gids[: size.value // _GID_SIZE])
        err = ctypes.get_errno()
        if err != errno.ERANGE:
            break
    raise OSError(err, f"SO_PEERGROUPS: {os.strerror(err)}")


# --- TCP peers on this host ----------------------------------------------------------------

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_DIAG_REQ = struct.Struct("=BBBBI")  # family, protocol, ext, pad, states
_SOCKID = struct.Struct("!HH16s16s")  # sport, dport, src, dst (network order)
_SOCKID_TAIL = struct.Struct("=III")  # interface, cookie (INET_DIAG_NOCOOKIE)
_DIAG_MSG_UID = 4 + 48 + 12  # family..retrans, the sockid, expires, rqueue, wqueue
_NO_COOKIE = 0xFFFFFFFF


class LoopbackPeers:
    """Which uid holds the other end of an accepted TCP connection from this host.

    The kernel's socket table knows the owner of every socket; a sock_diag query for the
    exact four-tuple of the peer's socket returns it, as `ss -tpe` shows it. A peer on
    another host, or one already gone, has no entry here: None. Opening needs AF_NETLINK
    (a sandbox may refuse it: `open()` returns None, and every peer is then unknown)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._seq = 0

    @classmethod
    def open(cls) -> LoopbackPeers | None:
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
        except OSError:
            return None
        return cls(sock)

    def uid(self, conn: socket.socket) -> int | None:
        """The uid owning the peer's socket, or None when the kernel does not say."""
        try:
            ours, theirs = conn.getsockname(), conn.getpeername()
        except OSError:
            return None
        family, ours_ip, theirs_ip = _as_sent(conn.family, ours[0], theirs[0])
        self._seq = self._seq % 0x7FFFFFFF + 1
        # The peer's socket: its source is their end, its destination ours.
        sockid = _SOCKID.pack(theirs[1], ours[1], theirs_ip, ours_ip)
        sockid += _SOCKID_TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
        request = _DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
        header = _NLMSG.pack(_NLMSG.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST,
                             self._seq, 0)  # fmt: skip
        try:
            self._sock.send(header + request)
            # the kernel answers within send(): the reply is queued before it returns
            while True:
                reply = self._sock.recv(8192, socket.MSG_DONTWAIT)
                _, kind, _, seq, _ = _NLMSG.unpack_from(reply)
                if seq == self._seq:
                    break
        except OSError:
            return None
        if kind != _SOCK_DIAG_BY_FAMILY or len(reply) < _NLMSG.size + _DIAG_MSG_UID + 4:
            return None  # NLMSG_ERROR: no such socket on this host
        return int(struct.unpack_from("=I", reply, _NLMSG.size + _DIAG_MSG_UID)[0])

    def close(self) -> None:
        self._sock.close()


def _as_sent(family: int, ours: str, theirs: str) -> tuple[int, bytes, bytes]:
    """The family and the 16-byte addresses of the peer's own socket: an IPv4 client of a
    dual-stack listener shows as ::ffff:a.b.c.d here, but its socket is AF_INET."""
    mapped = "::ffff:"
    if family == socket.AF_INET6 and theirs.startswith(mapped) and "." in theirs:
        family, ours, theirs = (
            socket.AF_INET,
            ours.removeprefix(mapped),
            theirs.removeprefix(mapped),
        )
    ours_ip = socket.inet_pton(family, ours.partition("%")[0]).ljust(16, b"\0")
    theirs_ip = socket.inet_pton(family, theirs.partition("%")[0]).ljust(16, b"\0")
    return family, ours_ip, theirs_ip
