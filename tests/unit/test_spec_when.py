"""Deadlines as operators write them, and CPU amounts as cores or a share of the node."""

from __future__ import annotations

import datetime as dt

import pytest

from nodeagent.policyfile.when import parse_cpu_amount, parse_instant

NOW = 1_800_000_000.0
SIX_PM = dt.datetime(2026, 12, 1, 18, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("2026-12-01T18:00:00Z", dt.datetime(2026, 12, 1, 18, tzinfo=dt.UTC).timestamp()),
        ("2026-12-01T19:00:00+01:00", dt.datetime(2026, 12, 1, 18, tzinfo=dt.UTC).timestamp()),
        (
            dt.datetime(2026, 12, 1, 18, tzinfo=dt.UTC),
            dt.datetime(2026, 12, 1, 18, tzinfo=dt.UTC).timestamp(),
        ),
    ],
)
def test_absolute_times(text: object, seconds: float) -> None:
    assert parse_instant(text) == seconds


@pytest.mark.parametrize(("text", "after"), [("+90s", 90), ("+2h", 7200), ("+ 1.5m", 90)])
def test_relative_times_on_the_command_line(text: str, after: float) -> None:
    assert parse_instant(text, now=NOW) == NOW + after


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("+90s", "only allowed on the command line"),
        ("2026-12-01T18:00:00", "has no UTC offset"),
        ("2026-12-01", "expected a time of day too"),
        (dt.date(2026, 12, 1), "expected a time of day too"),
        ("tomorrow", "expected an ISO 8601 time"),
        (True, "not a boolean"),
        (17, "expected a time"),
    ],
)
def test_bad_times(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_instant(value)


def test_naive_times_are_local_on_the_command_line() -> None:
    local = dt.datetime(2026, 12, 1, 18).astimezone().timestamp()
    assert parse_instant("2026-12-01T18:00:00", now=NOW, naive_is_local=True) == local


@pytest.mark.parametrize(
    ("value", "amount"),
    [(1.5, (1.5, False)), ("2", (2.0, False)), ("20%", (0.2, True)), ("12.5 %", (0.125, True))],
)
def test_cpu_amounts(value: object, amount: tuple[float, bool]) -> None:
    assert parse_cpu_amount(value) == amount


@pytest.mark.parametrize("value", ["101%", "-1", "x", True, float("nan"), "1e9"])
def test_bad_cpu_amounts(value: object) -> None:
    with pytest.raises(ValueError, match=r"expected cores|share of the node"):
        parse_cpu_amount(value)
