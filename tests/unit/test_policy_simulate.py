"""The offline simulation the deadline benchmark compares against."""

from __future__ import annotations

import pytest
from benchref.simulate import SimJob, simulate, water_fill
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.policyfile.model import PolicySpec

SPEC = PolicySpec.model_validate({"version": 1, "tenants": {"a": {"shares": 1}}})
# one job needs 1.6 of 2 CPUs with two threads; two small ones need little, far later
SET = [SimJob("big", 48, 30, 2), SimJob("small-1", 8, 60, 1), SimJob("small-2", 8, 60, 1)]


def test_equal_weights_miss_where_the_deadline_policy_meets_every_deadline() -> None:
    default = {o.name: o for o in simulate(SET, SPEC, 2, policies=None)}
    assert default["big"].missed
    assert default["big"].finish == pytest.approx(32.0, abs=0.1)  # 2/3 of 2 CPUs, then all
    planned = simulate(SET, SPEC, 2)
    assert not any(o.missed for o in planned)


def test_an_impossible_job_is_predicted_to_miss_and_the_others_still_meet() -> None:
    jobs = [*SET, SimJob("impossible", 50, 20, 2)]  # 2.5 cores for 20 s on 2 CPUs
    out = {o.name: o for o in simulate(jobs, SPEC, 2)}
    assert out["impossible"].missed
    assert out["impossible"].tardiness > 0
    met = {n: (o.finish, o.deadline) for n, o in out.items() if n != "impossible"}
    assert not any(out[n].missed for n in met), met
    # the kernel's default shares the CPUs with the impossible job, and big misses with it
    default = {o.name: o for o in simulate(jobs, SPEC, 2, policies=None)}
    assert default["big"].missed


@given(
    st.dictionaries(st.sampled_from("abcdef"), st.floats(1, 10_000), min_size=1),
    st.floats(0.5, 16),
)
def test_water_fill_uses_what_it_can_and_never_exceeds_a_cap(
    weights: dict[str, float], cpus: float
) -> None:
    caps = {n: float(1 + ord(n) % 3) for n in weights}
    got = water_fill(weights, caps, cpus)
    assert all(got[n] <= caps[n] + 1e-9 for n in got)
    assert sum(got.values()) == pytest.approx(min(cpus, sum(caps.values())))
    uncapped = [n for n in got if got[n] < caps[n] - 1e-9]
    for m in uncapped:  # those below their cap are in proportion to weight
        for n in uncapped:
            assert got[m] / weights[m] == pytest.approx(got[n] / weights[n], rel=1e-6)
