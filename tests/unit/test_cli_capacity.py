"""`nodeagent capacity`: help, the table and --json, and one-line errors with their exit codes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_cli import nodeagent

from nodeagent.cli import main
from nodeagent.queueing import mmc

EXAMPLE = ["capacity", "--arrival-rate", "300", "--service-rate", "40"]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_help_teaches(runner: CliRunner) -> None:
    result = runner.invoke(main, ["capacity", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for words in (
        "--arrival-rate L",
        "--service-rate M",
        "--servers C",
        "--target-wait S",
        "--json",
        "Erlang C",
        "40 requests/s per replica and 300 requests/s arrive",
        "--target-wait 10ms",
        "prints 9 replicas",
        "1 when the queue is unstable",
        "2 for bad input",
    ):
        assert words in text, words
    assert "capacity" in runner.invoke(main, ["--help"]).output


def test_json_with_servers(runner: CliRunner) -> None:
    """Versioned, with a kind, and every figure's unit in its key (issue 13, item 23: the
    keys said `_s` for some figures and nothing for others)."""
    result = runner.invoke(main, [*EXAMPLE, "--servers", "9", "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    q = mmc(300.0, 40.0, 9)
    assert got == {
        "apiVersion": "nodeagent/v1",
        "kind": "CapacityPlan",
        "model": "M/M/c",
        "arrival_rate_per_second": 300.0,
        "service_rate_per_second": 40.0,
        "servers": 9,
        "target_wait_seconds": None,
        "offered_load_erlangs": 7.5,
        "utilisation_fraction": q.utilisation,
        "p_wait_fraction": q.p_wait,
        "mean_wait_seconds": q.mean_wait,
        "mean_response_seconds": q.mean_response,
        "mean_queue_length_requests": q.mean_queue_length,
        "p_wait_exceeds_target_fraction": None,
    }


def test_json_with_a_target_wait(runner: CliRunner) -> None:
    result = runner.invoke(main, [*EXAMPLE, "--target-wait", "10ms", "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert (got["servers"], got["target_wait_seconds"]) == (9, 0.01)
    assert got["mean_wait_seconds"] == pytest.approx(0.008486, rel=1e-3)
    assert got["p_wait_exceeds_target_fraction"] == pytest.approx(
        mmc(300.0, 40.0, 9).wait_exceeds(0.01)
    )


def test_table(runner: CliRunner) -> None:
    result = runner.invoke(main, [*EXAMPLE, "--target-wait", "0.01"])
    assert result.exit_code == 0, result.output
    rows = {line.split("  ")[0]: line.split() for line in result.stdout.splitlines()}
    assert rows["servers (c)"][2:] == ["9", "fewest", "with", "mean", "wait", "<=", "0.01", "s"]
    assert rows["utilisation (a/c)"][-1] == "83.3%"
    assert rows["P(wait) (Erlang C)"][3] == "0.5091"
    assert rows["mean wait (W_q)"][3:] == ["0.008486", "s"]
    assert rows["P(wait > 0.01 s)"][4] == "0.2794"


@pytest.mark.parametrize(
    "args",
    [
        [],  # neither --servers nor --target-wait
        ["--servers", "9", "--target-wait", "10ms"],
        ["--servers", "0"],
        ["--target-wait", "0"],
        ["--target-wait", "soon"],
    ],
)
def test_usage_errors_exit_2(runner: CliRunner, args: list[str]) -> None:
    result = runner.invoke(main, [*EXAMPLE, *args])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            [*EXAMPLE, "--servers", "7"],
            1,
            "nodeagent: error: unstable: utilisation 1.071 >= 1 with 7 servers (offered load "
            "7.5 Erlangs); stability needs at least 8 servers",
        ),
        (
            ["capacity", "--arrival-rate", "-3", "--service-rate", "40", "--servers", "3"],
            2,
            "nodeagent capacity: error: arrival rate must be a positive finite number, got -3.0 "
            "(see 'nodeagent capacity --help')",
        ),
        (
            [*EXAMPLE, "--servers", "9", "--target-wait", "1"],
            2,
            "nodeagent capacity: error: give exactly one of --servers C and --target-wait S "
            "(see 'nodeagent capacity --help')",
        ),
        (
            ["capacity", "--service-rate", "40", "--servers", "3"],
            2,
            "nodeagent capacity: error: Missing option '--arrival-rate'. "
            "(see 'nodeagent capacity --help')",
        ),
        (
            [*EXAMPLE, "--target-wait", "nan"],
            2,
            "nodeagent capacity: error: Invalid value for '--target-wait': expected a duration "
            "such as 500ms, 30s, 5m or 1h, got 'nan' (see 'nodeagent capacity --help')",
        ),
    ],
)
def test_console_script_errors_are_one_line(args: list[str], code: int, message: str) -> None:
    proc = nodeagent(*args)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == message + "\n"
