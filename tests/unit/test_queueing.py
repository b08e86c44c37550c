"""M/M/c figures: published values, M/M/1 as the one-server case, the article's error, and
properties (probabilities in range, fewer waits with more servers, the recursion agrees with
the textbook sums)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.queueing import (
    MAX_SERVERS,
    QueueingError,
    UnstableQueue,
    erlang_b,
    erlang_c,
    mmc,
    servers_for_wait,
)

# --- independent references -----------------------------------------------------------------


def erlang_b_textbook(c: int, a: Fraction) -> Fraction:
    """B = (a^c / c!) / sum_{k=0..c} a^k / k!, in exact rationals."""
    terms = [a**k / math.factorial(k) for k in range(c + 1)]
    return terms[-1] / sum(terms)


def erlang_c_textbook(c: int, a: Fraction) -> Fraction:
    """C = (a^c / c!) (c / (c - a)) / (sum_{k<c} a^k / k! + (a^c / c!) (c / (c - a)))."""
    top = a**c / math.factorial(c) * c / (c - a)
    return top / (sum(a**k / math.factorial(k) for k in range(c)) + top)


def erlang_c_log_space(c: int, a: float) -> float:
    """Erlang C from log-terms (lgamma, log-sum-exp): a second stable route for large c."""
    logs = [k * math.log(a) - math.lgamma(k + 1) for k in range(c)]
    log_top = c * math.log(a) - math.lgamma(c + 1) + math.log(c / (c - a))
    peak = max([*logs, log_top])
    rest = sum(math.exp(x - peak) for x in logs)
    top = math.exp(log_top - peak)
    return top / (rest + top)


def article_mean_wait(arrival_rate: float, service_rate: float, servers: int) -> float:
    """The article's M/M/c mean wait, W_q = L / (M (M c - L)), as printed in
    the article this project comes from, in its section on queueing models (排队论模型)."""
    return arrival_rate / (service_rate * (service_rate * servers - arrival_rate))


# --- published values -----------------------------------------------------------------------


def test_two_erlangs_on_three_servers() -> None:
    """Wolfram Language reference, ErlangC (reference.wolfram.com/language/ref/ErlangC.html),
    Basic Examples: ErlangC[3, 2], the probability of waiting with a = 2 Erlangs on c = 3
    servers, exactly 4/9 = 0.4444..."""
    assert erlang_c_textbook(3, Fraction(2)) == Fraction(4, 9)
    assert erlang_c(3, 2.0) == pytest.approx(4 / 9, rel=1e-15)
    q = mmc(10.0, 5.0, 3)  # the article's own example has the same a and c
    assert q.p_wait == pytest.approx(4 / 9, rel=1e-15)
    assert q.mean_wait == pytest.approx(4 / 45, rel=1e-15)  # 4/9 / (15 - 10)


def test_county_hospital_emergency_room() -> None:
    """Hillier & Lieberman, Introduction to Operations Research, ch. 17 (Queueing Theory),
    the County Hospital emergency room: patients arrive at L = 2 per hour, a doctor treats
    M = 3 per hour. Published steady-state results: one doctor, Wq = 2/3 h, W = 1 h,
    Lq = 4/3, P(Wq > 0) = 2/3, P(Wq > 1 h) = 0.245; two doctors, Wq = 1/24 h (2.5 min),
    W = 3/8 h, Lq = 1/12 (0.083), P(Wq > 0) = 1/6 (0.167)."""
    one = mmc(2.0, 3.0, 1)
    assert (one.p_wait, one.mean_wait, one.mean_response, one.mean_queue_length) == pytest.approx(
        (2 / 3, 2 / 3, 1.0, 4 / 3)
    )
    assert one.wait_exceeds(1.0) == pytest.approx(0.245, abs=5e-4)
    two = mmc(2.0, 3.0, 2)
    assert (two.p_wait, two.mean_wait, two.mean_response, two.mean_queue_length) == pytest.approx(
        (1 / 6, 1 / 24, 3 / 8, 1 / 12)
    )


def test_westbay_service_level_and_agents() -> None:
    """Westbay Engineers (makers of the Westbay Erlang calculators), erlang.com forum topic
    "CCXLService", reply by Tom Howard, 12 January 2021: 21 agents, 57 calls (per hour: the
    only reading with a stable queue) of 1110 s each, give a service level of 80.7% answered
    within 180 s; for 80% answered within 20 s, 23 agents are needed."""
    calls, handle = 57 / 3600, 1 / 1110
    q = mmc(calls, handle, 21)
    assert 1 - q.wait_exceeds(180) == pytest.approx(0.807, abs=5e-4)

    def meets_80_in_20(agents: int) -> bool:
        return mmc(calls, handle, agents).wait_exceeds(20) <= 0.2

    assert not meets_80_in_20(22)
    assert meets_80_in_20(23)


@pytest.mark.parametrize(("servers", "erlangs"), [(5, 1.361), (10, 4.461), (20, 12.031)])
def test_erlang_b_table_at_one_percent(servers: int, erlangs: float) -> None:
    """Erlang B tables (e.g. Iversen, Teletraffic Engineering and Network Planning, DTU /
    ITU-D, table of the Erlang B formula): at 1% blocking, 5 servers carry 1.361 Erlangs,
    10 carry 4.461 and 20 carry 12.031. The table rounds the load to 0.001 Erlang, which
    moves B by less than 2e-5."""
    assert erlang_b(servers, erlangs) == pytest.approx(0.01, abs=2e-5)


# --- the article's formula ------------------------------------------------------------------


def test_the_articles_formula_overstates_the_wait() -> None:
    """The article's example, L = 10/s, M = 5/s, c = 3: it prints W_q = 0.4 s. Erlang C gives
    P(wait) = 4/9 and W_q = 4/45 s = 0.089 s, 4.5 times less. Its formula is M/M/1's with one
    M scaled by c, so it agrees only at c = 1; sizing with it buys 3 times the replicas."""
    assert article_mean_wait(10, 5, 3) == pytest.approx(0.4)
    assert mmc(10.0, 5.0, 3).mean_wait == pytest.approx(4 / 45)
    assert article_mean_wait(10, 5, 3) / mmc(10.0, 5.0, 3).mean_wait == pytest.approx(4.5)
    assert article_mean_wait(3, 5, 1) == pytest.approx(mmc(3.0, 5.0, 1).mean_wait)
    # 300 requests/s, 40/s per replica, a 10 ms mean wait: 27 replicas by the article, 9 exactly
    article_replicas = next(c for c in range(8, 100) if article_mean_wait(300, 40, c) <= 0.01)
    assert (article_replicas, servers_for_wait(300.0, 40.0, 0.01).servers) == (27, 9)


# --- M/M/1, large c, the search -------------------------------------------------------------

rates = st.floats(min_value=1e-3, max_value=1e3)


@given(rates, st.floats(min_value=0.001, max_value=0.999))
def test_one_server_is_mm1(service: float, rho: float) -> None:
    q = mmc(rho * service, service, 1)
    assert q.p_wait == pytest.approx(q.utilisation, rel=1e-12)
    assert q.mean_wait == pytest.approx(q.utilisation / (service - q.arrival_rate), rel=1e-9)


@pytest.mark.parametrize(("servers", "erlangs"), [(1000, 950.0), (5000, 4900.0), (200, 10.0)])
def test_large_c_is_finite_and_agrees_with_log_space(servers: int, erlangs: float) -> None:
    # the textbook term a^c / c! overflows a float here
    with pytest.raises(OverflowError):
        _ = erlangs**servers / math.factorial(servers)
    assert erlang_c(servers, erlangs) == pytest.approx(
        erlang_c_log_space(servers, erlangs), rel=1e-9
    )


def test_search_for_the_fewest_servers() -> None:
    q = servers_for_wait(300.0, 40.0, 0.01)
    assert q.servers == 9
    assert q.mean_wait <= 0.01 < mmc(300.0, 40.0, 8).mean_wait
    # a generous target: the fewest stable servers already meet it
    assert servers_for_wait(300.0, 40.0, 3600.0).servers == 8


@given(
    st.floats(min_value=0.01, max_value=500.0),
    st.floats(min_value=1e-6, max_value=10.0),
)
def test_search_is_minimal(erlangs: float, target: float) -> None:
    service = 2.0
    q = servers_for_wait(erlangs * service, service, target)
    assert q.mean_wait <= target
    fewer = q.servers - 1
    if fewer > erlangs:  # one server fewer is stable, and waits too long
        assert mmc(erlangs * service, service, fewer).mean_wait > target
    else:  # one server fewer is unstable: these are the fewest stable servers
        assert q.servers == math.floor(erlangs) + 1
        if fewer:
            with pytest.raises(UnstableQueue):
                mmc(erlangs * service, service, fewer)


# --- properties -----------------------------------------------------------------------------


@given(st.floats(min_value=1e-6, max_value=2000.0), st.integers(min_value=0, max_value=40))
def test_p_wait_and_mean_wait_fall_as_servers_are_added(erlangs: float, extra: int) -> None:
    c = math.floor(erlangs) + 1 + extra
    now, more = mmc(erlangs, 1.0, c), mmc(erlangs, 1.0, c + 1)
    assert 0.0 <= more.p_wait <= now.p_wait <= 1.0
    assert more.mean_wait <= now.mean_wait
    assert 0.0 < now.utilisation < 1.0


@given(st.integers(min_value=0, max_value=30), st.floats(min_value=1e-3, max_value=60.0))
def test_recursion_agrees_with_the_factorial_formula(c: int, a: float) -> None:
    assert erlang_b(c, a) == pytest.approx(float(erlang_b_textbook(c, Fraction(a))), rel=1e-12)
    if c > a:
        assert erlang_c(c, a) == pytest.approx(float(erlang_c_textbook(c, Fraction(a))), rel=1e-9)


def test_wait_tail() -> None:
    q = mmc(10.0, 5.0, 3)
    assert q.wait_exceeds(0.0) == q.p_wait
    assert q.wait_exceeds(0.2) == pytest.approx(4 / 9 * math.exp(-1.0))
    with pytest.raises(QueueingError, match="wait time"):
        q.wait_exceeds(-1.0)


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arrival", "service", "servers", "message"),
    [
        (0.0, 1.0, 1, "arrival rate must be a positive finite number, got 0.0"),
        (-1.0, 1.0, 1, "arrival rate must be"),
        (math.nan, 1.0, 1, "arrival rate must be"),
        (math.inf, 1.0, 1, "arrival rate must be"),
        (1.0, 0.0, 1, "service rate must be a positive finite number, got 0.0"),
        (1.0, -math.inf, 1, "service rate must be"),
        (1e300, 1e-300, 1, "offered load .* overflows"),
        (1.0, 2.0, 0, "servers must be between 1 and 1000000, got 0"),
        (1.0, 2.0, MAX_SERVERS + 1, "servers must be between"),
    ],
)
def test_bad_input(arrival: float, service: float, servers: int, message: str) -> None:
    with pytest.raises(QueueingError, match=message) as e:
        mmc(arrival, service, servers)
    assert not isinstance(e.value, UnstableQueue)


@pytest.mark.parametrize("target", [0.0, -1.0, math.nan, math.inf])
def test_bad_target(target: float) -> None:
    with pytest.raises(QueueingError, match="target wait must be a positive finite number"):
        servers_for_wait(300.0, 40.0, target)


@pytest.mark.parametrize(
    ("arrival", "servers", "needed"),
    [(300.0, 7, 8), (300.0, 3, 8), (320.0, 8, 9)],  # 320/40 = 8: utilisation exactly 1
)
def test_unstable_says_how_many_servers_stability_needs(
    arrival: float, servers: int, needed: int
) -> None:
    with pytest.raises(UnstableQueue, match=f"stability needs at least {needed} servers") as e:
        mmc(arrival, 40.0, servers)
    assert e.value.servers_needed == needed
    assert "utilisation" in str(e.value)


def test_a_load_beyond_the_limit() -> None:
    with pytest.raises(QueueingError, match="needs more than 1000000 servers"):
        servers_for_wait(2e6, 1.0, 1.0)
