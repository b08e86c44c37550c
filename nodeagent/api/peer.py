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
