"""What the server and the client agree on: deadlines on socket I/O, the query and body codecs.

Both ends bound a whole exchange by a deadline, not each read: a socket timeout alone
restarts with every byte, so a peer that drips one byte a second would hold the other end
for ever. Query strings are percent-encoded UTF-8 with surrogateescape, the same mapping
`os.fsdecode` uses, so a cgroup whose name is not valid UTF-8 can still be asked for by name.
"""

from __future__ import annotations

import io
import json
import socket
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote_to_bytes

from pydantic import BaseModel

MAX_BODY = 64 * 1024
"""The largest request body (bytes) a POST or DELETE may carry."""


class Deadline:
    """A moment by which an exchange must be over."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; TimeoutError once none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the {self.seconds:g}s deadline passed")
        return left


class DeadlineIO(io.RawIOBase):
    """A connected socket as a raw stream whose every read and write ends by `deadline`."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        super().__init__()
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.sock.settimeout(self.deadline.left())
        return self.sock.recv_into(buffer)

    def write(self, data: Any) -> int:
        # sendall's timeout covers the whole call (Python >= 3.5), not each send.
        self.sock.settimeout(self.deadline.left())
        self.sock.sendall(data)
        return len(data)


def encode(obj: object) -> bytes:
    """The wire format of every body: compact, sorted, ASCII-only JSON; a model (an answer in
    nodeagent.api.answers) as its fields by their wire names (its aliases).

    ASCII-only keeps strings that came from non-UTF-8 names (lone surrogates) encodable.
    """
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(by_alias=True)
    return json.dumps(obj, indent=None, sort_keys=True, default=str).encode()


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not allowed")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key!r} given more than once")
        obj[key] = value
    return obj


def decode_object(raw: bytes) -> dict[str, Any]:
    """A request body: strict UTF-8 JSON whose top level is an object; ValueError otherwise."""
    try:
        obj = json.loads(
            raw.decode("utf-8"), parse_constant=_no_constants, object_pairs_hook=_no_duplicates
        )
    except UnicodeDecodeError as exc:
        raise ValueError(f"bad JSON body: not UTF-8 (byte {exc.start})") from None
    except RecursionError:
        raise ValueError("bad JSON body: nested too deeply") from None
    except ValueError as exc:  # also the integer-digit limit and the hooks above
        raise ValueError(f"bad JSON body: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"the body must be a JSON object, not {type(obj).__name__}")
    return obj


def _unquote(raw: bytes) -> str:
    return unquote_to_bytes(raw.replace(b"+", b" ")).decode("utf-8", "surrogateescape")


def decode_path(raw: bytes) -> str:
    """The path of a request target, percent-decoded."""
    return unquote_to_bytes(raw).decode("utf-8", "surrogateescape")


def decode_query(raw: bytes) -> dict[str, str]:
    """`a=1&b=x+y` as a mapping; a parameter given twice is a ValueError."""
    params: dict[str, str] = {}
    for field in raw.split(b"&"):
        if not field:
            continue
        key, _, value = field.partition(b"=")
        name = _unquote(key)
        if name in params:
            raise ValueError(f"query parameter {name!r} given more than once")
        params[name] = _unquote(value)
    return params


def _quote(text: str) -> str:
    return quote(text.encode("utf-8", "surrogateescape"), safe="")


def encode_query(params: Mapping[str, str]) -> str:
    return "&".join(f"{_quote(k)}={_quote(v)}" for k, v in params.items())
