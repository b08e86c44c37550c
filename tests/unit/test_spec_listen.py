"""agent.metrics.listen: HOST:PORT or [IPV6]:PORT, refused at load time with FILE:LINE:COL."""

from __future__ import annotations

import pytest

from nodeagent.policyfile.listen import parse_listen
from nodeagent.policyfile.load import check_text
from nodeagent.policyfile.yamlfile import PolicyError

HEAD = "version: 1\ntenants: {a: {shares: 1}}\nagent:\n  metrics:\n    listen: "


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("127.0.0.1:9464", "127.0.0.1", 9464),
        ("0.0.0.0:9464", "0.0.0.0", 9464),
        ("[::1]:9464", "::1", 9464),
        ("[::]:1", "::", 1),
        ("[fe80::1%eth0]:9464", "fe80::1%eth0", 9464),
        ("localhost:65535", "localhost", 65535),
        ("node-7.example.org:9464", "node-7.example.org", 9464),
    ],
)
def test_good_addresses(text: str, host: str, port: int) -> None:
    assert parse_listen(text) == (host, port)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("9464", "expected HOST:PORT such as 127.0.0.1:9464 or [::1]:9464, got '9464'"),
        ("::1:9464", "an IPv6 address goes in brackets, such as 127.0.0.1:9464 or [::1]:9464"),
        (":9464", "the host is empty in ':9464': use 0.0.0.0:PORT for every IPv4 address"),
        ("127.0.0.256:9464", "'127.0.0.256' is not an IPv4 address, in '127.0.0.256:9464'"),
        ("under_score:9464", "'under_score' is not an IP address or a host name"),
        ("-lead.example:9464", "'-lead.example' is not an IP address or a host name"),
        ("[::1]9464", "expected [IPV6]:PORT such as 127.0.0.1:9464 or [::1]:9464"),
        ("[1.2.3.4]:9464", "'1.2.3.4' is not an IPv6 address"),
        ("127.0.0.1:0", "the port must be a number from 1 to 65535, got '0'"),
        ("127.0.0.1:65536", "the port must be a number from 1 to 65535, got '65536'"),
        ("127.0.0.1:http", "the port must be a number from 1 to 65535, got 'http'"),
        ("127.0.0.1:", "the port must be a number from 1 to 65535, got ''"),
        ("127.0.0.1:+80", "the port must be a number from 1 to 65535, got '+80'"),
    ],
)
def test_bad_addresses(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_listen(text)
    assert str(info.value).startswith(message)


def test_the_loader_names_the_file_line_and_column() -> None:
    with pytest.raises(PolicyError) as info:
        check_text(HEAD + '"[::1]:99999"\n', "p.yaml")
    assert [str(p) for p in info.value.problems] == [
        "p.yaml:5:13: agent.metrics.listen: the port must be a number from 1 to 65535,"
        " got '99999' in '[::1]:99999'"
    ]
    with pytest.raises(PolicyError) as info:
        check_text(HEAD + "9464\n", "p.yaml")
    assert [str(p) for p in info.value.problems] == [
        "p.yaml:5:13: agent.metrics.listen: must be a string, got 9464"
    ]


def test_off_by_default_and_kept_when_set() -> None:
    assert check_text(HEAD + "null\n", "p.yaml").spec.agent.metrics.listen is None
    spec = check_text(HEAD + '"[::1]:9464"\n', "p.yaml").spec
    assert spec.agent.metrics.listen == "[::1]:9464"


def test_a_unix_socket_with_its_group_and_a_token_file() -> None:
    text = HEAD + "unix:/run/nodeagent-metrics/metrics.sock\n"
    text += "    socket_group: prometheus\n    bearer_token_file: /etc/nodeagent/metrics.token\n"
    metrics = check_text(text, "p.yaml").spec.agent.metrics
    assert metrics.listen == "unix:/run/nodeagent-metrics/metrics.sock"
    assert metrics.socket_group == "prometheus"
    assert metrics.bearer_token_file == "/etc/nodeagent/metrics.token"


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        (
            "unix:run/m.sock\n",
            "p.yaml:5:13: agent.metrics.listen: must be an absolute path without '.', '..' or"
            " empty parts, got 'run/m.sock'",
        ),
        (
            "unix:/proc/m.sock\n",
            "p.yaml:5:13: agent.metrics.listen: must not be under /proc, where files are"
            " devices or kernel interfaces, got '/proc/m.sock'",
        ),
        (
            f'"unix:/run/{"a" * 110}"\n',
            "p.yaml:5:13: agent.metrics.listen: a socket path is at most 107 bytes (the"
            " kernel's limit), got 115 bytes",
        ),
        (
            "127.0.0.1:9464\n    socket_group: prometheus\n",
            "p.yaml:5:5: agent.metrics: socket_group is for a Unix socket: set listen: unix:PATH",
        ),
        (
            "127.0.0.1:9464\n    bearer_token_file: token\n",
            "p.yaml:6:24: agent.metrics.bearer_token_file: must be an absolute path without"
            " '.', '..' or empty parts, got 'token'",
        ),
    ],
)
def test_bad_unix_sockets_groups_and_token_files(tail: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        check_text(HEAD + tail, "p.yaml")
    assert [str(p) for p in info.value.problems] == [message]
