"""Decayed usage history: U' = U·2^(-Δt/half_life) + usage during Δt."""

from __future__ import annotations

import pytest
from builders import docker, policy_input, snapshot, spec, workload
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.policy import history

HOUR = 3600.0


@pytest.mark.parametrize(
    ("elapsed", "factor"),
    [(0.0, 1.0), (HOUR, 0.5), (2 * HOUR, 0.25), (HOUR / 2, 2**-0.5), (10 * HOUR, 2**-10)],
)
def test_decay(elapsed: float, factor: float) -> None:
    got = history.decay({"a": 8.0, "b": 100.0}, elapsed, HOUR)
    assert got == {"a": pytest.approx(8.0 * factor), "b": pytest.approx(100.0 * factor)}


def test_decay_halves_after_one_half_life() -> None:
    assert history.decay({"a": 10.0}, 60.0, 60.0) == {"a": 5.0}


def test_negative_elapsed_never_grows_usage() -> None:
    assert history.decay({"a": 10.0}, -HOUR, HOUR) == {"a": 10.0}


def test_decay_does_not_change_its_input() -> None:
    usage = {"a": 10.0}
    history.decay(usage, HOUR, HOUR)
    assert usage == {"a": 10.0}


@given(
    st.floats(min_value=0, max_value=1e12),
    st.floats(min_value=0, max_value=1e6),
    st.floats(min_value=0, max_value=1e6),
    st.floats(min_value=1, max_value=1e6),
)
def test_decay_composes(u: float, t1: float, t2: float, half_life: float) -> None:
    once = history.decay({"a": u}, t1 + t2, half_life)["a"]
    twice = history.decay(history.decay({"a": u}, t1, half_life), t2, half_life)["a"]
    assert once == pytest.approx(twice, rel=1e-9, abs=1e-300)
    assert 0 <= once <= u


WORKLOADS = [
    workload("nodeagent.slice/a-1", cpu_rate=1.5),
    workload("nodeagent.slice/a-2", cpu_rate=0.5),
    workload("nodeagent.slice/b-1", cpu_rate=0.25),
    workload("nodeagent.slice/b-2", cpu_rate=None),  # first tick: no rate yet
    workload(docker(), cpu_rate=4.0),  # no rule claims it
]


def test_tick_usage_is_rate_times_elapsed_per_tenant() -> None:
    given_ = policy_input(snapshot(WORKLOADS, elapsed=2.0), spec({"a": 1, "b": 1}))
    assert history.tick_usage(given_.snapshot, given_.assignments) == {"a": 4.0, "b": 0.5}


@pytest.mark.parametrize("elapsed", [None, 0.0])
def test_no_usage_on_the_first_snapshot(elapsed: float | None) -> None:
    given_ = policy_input(snapshot(WORKLOADS, elapsed=elapsed), spec({"a": 1, "b": 1}))
    assert history.tick_usage(given_.snapshot, given_.assignments) == {}


def test_advance_decays_then_adds_this_ticks_usage() -> None:
    given_ = policy_input(snapshot(WORKLOADS, elapsed=HOUR), spec({"a": 1, "b": 1, "c": 1}))
    got = history.advance({"a": 100.0, "c": 10.0}, given_.snapshot, given_.assignments, HOUR)
    assert got == {
        "a": pytest.approx(50.0 + 2.0 * HOUR),
        "b": pytest.approx(0.25 * HOUR),
        "c": pytest.approx(5.0),  # no workloads now: only decays
    }


def test_advance_on_the_first_snapshot_keeps_previous_usage() -> None:
    given_ = policy_input(snapshot(WORKLOADS, elapsed=None), spec({"a": 1, "b": 1}))
    assert history.advance({"a": 7.0}, given_.snapshot, given_.assignments, HOUR) == {"a": 7.0}


def test_advance_does_not_change_previous() -> None:
    previous = {"a": 100.0}
    given_ = policy_input(snapshot(WORKLOADS, elapsed=1.0), spec({"a": 1, "b": 1}))
    history.advance(previous, given_.snapshot, given_.assignments, HOUR)
    assert previous == {"a": 100.0}
