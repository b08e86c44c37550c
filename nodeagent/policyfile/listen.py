"""Addresses the daemon listens on over TCP: HOST:PORT, or [IPV6]:PORT (or a Unix socket,
unix:PATH, whose path the policy model checks as it checks every socket path).

Checked when the policy is loaded, so that a typo is a FILE:LINE:COL error rather than
a failure to bind minutes later; the host is resolved only when the daemon binds. Raises
only ValueError, which pydantic turns into a located validation error.
"""

from __future__ import annotations

import ipaddress
import re

_PORT = re.compile(r"\d{1,5}")
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
_LOOKS_NUMERIC = re.compile(r"[\d.]+")
EXAMPLE = "such as 127.0.0.1:9464 or [::1]:9464"
UNIX = "unix:"
DEFAULT_SOCKET = "/run/nodeagent/nodeagent.sock"
"""The API's Unix socket (`agent.socket`), where the daemon listens and the CLI calls."""


def unix_path(text: str) -> str | None:
    """The socket path of 'unix:PATH'; None for a TCP address."""
    return text.removeprefix(UNIX) if text.startswith(UNIX) else None


def parse_listen(text: str) -> tuple[str, int]:
    """(host, port) from 'HOST:PORT' or '[IPV6]:PORT'; the host without its brackets."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"expected [IPV6]:PORT {EXAMPLE}, got {text!r}")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address, in {text!r}") from None
        return host, _port(port, text)
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError(f"expected HOST:PORT {EXAMPLE}, got {text!r}")
    if ":" in host:
        raise ValueError(f"an IPv6 address goes in brackets, {EXAMPLE}, got {text!r}")
    if not host:
        raise ValueError(
            f"the host is empty in {text!r}: use 0.0.0.0:PORT for every IPv4 address,"
            " [::]:PORT for every address, or 127.0.0.1:PORT for this host alone"
        )
    if _LOOKS_NUMERIC.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv4 address, in {text!r}") from None
    elif not _HOSTNAME.fullmatch(host):
        raise ValueError(f"{host!r} is not an IP address or a host name, in {text!r}")
    return host, _port(port, text)


def _port(port: str, text: str) -> int:
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise ValueError(f"the port must be a number from 1 to 65535, got {port!r} in {text!r}")
    return int(port)
