"""systemd/nodeagent.service.d/metrics.conf, the drop-in that lets the metrics endpoint
work under the shipped unit: the address families the endpoint opens (AF_NETLINK among
them, for the uids of local TCP peers), the same settings as docs/metrics.md shows, and
the docs saying where it is shipped and how it is installed."""

from __future__ import annotations

import configparser
import re
import socket
from pathlib import Path

import pytest

from nodeagent.api.peer import LoopbackPeers
from nodeagent.cli.units import FILES, OPTIONAL

REPO = Path(__file__).resolve().parents[2]
DROPIN = REPO / "systemd" / "nodeagent.service.d" / "metrics.conf"
DOCS = REPO / "docs" / "metrics.md"


def service(text: str) -> dict[str, str]:
    """The [Service] settings of a unit file's text (comments dropped)."""
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return dict(parser["Service"])


def families() -> set[str]:
    return set(service(DROPIN.read_text())["RestrictAddressFamilies"].split())


def test_the_dropin_allows_every_family_the_endpoint_opens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TCP over IPv4 and IPv6, and AF_NETLINK for sock_diag: without it LoopbackPeers
    cannot open its socket, and every start logs metrics.peer_uids_unknown."""
    assert {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"} <= families()
    opened: list[int] = []
    real = socket.socket

    def recording(family: int = -1, *args: object, **kwargs: object) -> socket.socket:
        opened.append(family)
        return real(family, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "socket", recording)
    peers = LoopbackPeers.open()
    assert peers is not None, "no AF_NETLINK socket here either"
    peers.close()
    names = {socket.AddressFamily(f).name for f in opened}
    assert names and names <= families(), names


def test_the_docs_show_the_dropins_settings() -> None:
    """The ini block of docs/metrics.md is the drop-in, with the reader's own allow line."""
    text = DOCS.read_text()
    (block,) = re.findall(r"(?ms)^```ini\n(\[Service\]\nPrivateNetwork=no\n.*?)^```", text)
    assert service(block) == service(DROPIN.read_text())


def test_the_docs_say_where_it_is_shipped_and_installed() -> None:
    install = (REPO / "debian" / "nodeagent.install").read_text()
    (shipped,) = [
        line.split()[1]
        for line in install.splitlines()
        if line.startswith(str(DROPIN.relative_to(REPO)))
    ]
    packaged = "/" + shipped.rstrip("/") + "/" + DROPIN.name
    relative = "nodeagent.service.d/metrics.conf"
    assert relative in FILES and relative in OPTIONAL  # `nodeagent unit --install --metrics`
    text = re.sub(r"\s+", " ", DOCS.read_text())
    for said in (
        f"`{packaged}`",
        "`/etc/systemd/system/nodeagent.service.d/metrics.conf`",
        "`nodeagent unit --install --metrics`",
        "`AF_NETLINK`",
        "`metrics.peer_uids_unknown`",
    ):
        assert said in text, said
    service_md = re.sub(r"\s+", " ", (REPO / "docs" / "service.md").read_text())
    assert f"`{packaged}`" in service_md
