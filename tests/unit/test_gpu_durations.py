"""Expected GPU hold durations, patience and release times: placement's duration inputs."""

from __future__ import annotations

import pytest

from nodeagent.gpualloc.placement.durations import (
    HISTORY,
    declared_duration,
    expected_duration,
    patience,
    releases,
)


def test_a_deadline_bounds_the_declared_duration_and_work_at_its_cpus_may_end_sooner() -> None:
    assert declared_duration(3600.0, None, None) == 3600.0
    assert declared_duration(3600.0, 1800.0, 2.0) == 900.0  # 1800 CPU-s on 2 CPUs
    assert declared_duration(600.0, 1800.0, 2.0) == 600.0  # planned to end by its deadline
    assert declared_duration(-5.0, None, None) == 0.0  # past: due now
    assert declared_duration(None, 1800.0, 2.0) is None  # work alone says nothing of when


def test_without_a_declaration_the_median_of_the_class_s_recent_holds() -> None:
    assert expected_duration(42.0, [1.0, 2.0]) == 42.0
    assert expected_duration(None, [3.0, 1.0, 100.0]) == 3.0
    assert expected_duration(None, []) is None
    old = [1000.0] * 50 + [2.0] * HISTORY  # only the last HISTORY holds count
    assert expected_duration(None, old) == 2.0


@pytest.mark.parametrize(
    ("share", "expected", "held_back", "left"),
    [
        (1.0, 60.0, 0.0, 60.0),
        (1.0, 60.0, 45.0, 15.0),
        (1.0, 60.0, 90.0, 0.0),
        (0.0, 60.0, 0.0, 0.0),
        (1.0, None, 0.0, 0.0),
    ],
)
def test_patience_is_a_share_of_the_expected_duration_less_what_was_waited(
    share: float, expected: float | None, held_back: float, left: float
) -> None:
    assert patience(share, expected, held_back) == left


def test_a_gpu_is_back_when_its_last_holder_is_expected_to_end() -> None:
    back = releases(
        [
            (["GPU-a", "GPU-b"], 30.0),
            (["GPU-b"], 90.0),  # a shared second holder, ending later
            (["GPU-c"], None),  # unknown
            (["GPU-d"], 10.0),
            (["GPU-d"], -5.0),  # past its expected end: no longer predictable
        ]
    )
    assert back == {"GPU-a": 30.0, "GPU-b": 90.0}
