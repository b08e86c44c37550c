"""M/M/c queues: the exact Erlang C waiting figures, and the fewest servers for a mean wait.

Capacity questions ("how many replicas keep the mean wait under 10 ms?") are answered with
the exact Erlang C formula. The shortcut W_q = L / (M (cM - L)), found in articles on
scheduling, is M/M/1's formula with one M scaled by c: it drops the probability of waiting
and overstates the wait for every c > 1 (0.4 s instead of 0.089 s for L=10, M=5, c=3).

Erlang C is computed from the Erlang B recursion, B(0) = 1, B(k) = aB(k-1) / (k + aB(k-1)),
and C = cB / (c - a(1 - B)): every step stays in [0, 1], so there are no factorials or powers
to overflow, and a search over c extends the recursion one step per server tried. Pure: no
I/O, no clock. Rates are in any one unit of time (the CLI uses seconds); times come out in
the same unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nodeagent.errors import NodeagentError

MAX_SERVERS = 1_000_000
"""The most servers computed: the recursion costs one step per server."""


class QueueingError(NodeagentError, ValueError):
    """Input that no M/M/c queue has: a rate, server count or target out of range."""


class UnstableQueue(QueueingError):
    """Utilisation at or above 1: the queue grows without bound."""

    def __init__(self, message: str, servers_needed: int) -> None:
        super().__init__(message)
        self.servers_needed = servers_needed


@dataclass(frozen=True)
class MMc:
    """The steady state of one M/M/c queue (times in the rates' unit of time)."""

    arrival_rate: float  # L
    service_rate: float  # M, per server
    servers: int  # c
    offered_load: float  # a = L/M, in Erlangs: the mean number of busy servers
    utilisation: float  # rho = a/c
    p_wait: float  # Erlang C: the probability that an arrival waits at all
    mean_wait: float  # W_q = P_wait / (cM - L)
    mean_response: float  # W = W_q + 1/M
    mean_queue_length: float  # L_q = L W_q (Little's law)

    def wait_exceeds(self, t: float) -> float:
        """P(W_q > t) = P_wait exp(-(cM - L) t): the share of arrivals waiting longer than t."""
        if not (math.isfinite(t) and t >= 0):
            raise QueueingError(f"wait time must be a finite number >= 0, got {t!r}")
        return self.p_wait * math.exp(-self.service_rate * (self.servers - self.offered_load) * t)


def erlang_b(servers: int, load: float) -> float:
    """Erlang B, the blocking probability of `servers` servers offered `load` Erlangs."""
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


def erlang_c(servers: int, load: float) -> float:
    """Erlang C, the probability of waiting; needs load < servers."""
    return _c_from_b(servers, load, erlang_b(servers, load))


def _c_from_b(servers: int, load: float, b: float) -> float:
    return servers * b / (servers - load * (1.0 - b))


def mmc(arrival_rate: float, service_rate: float, servers: int) -> MMc:
    """The figures of an M/M/c queue; UnstableQueue when utilisation >= 1."""
    load = _offered_load(arrival_rate, service_rate)
    if not 1 <= servers <= MAX_SERVERS:
        raise QueueingError(f"servers must be between 1 and {MAX_SERVERS}, got {servers}")
    if load >= servers:
        needed = math.floor(load) + 1
        raise UnstableQueue(
            f"unstable: utilisation {load / servers:.4g} >= 1 with {servers} servers "
            f"(offered load {load:.4g} Erlangs); stability needs at least {needed} servers",
            needed,
        )
    return _figures(arrival_rate, service_rate, servers, erlang_c(servers, load))


def servers_for_wait(arrival_rate: float, service_rate: float, target_wait: float) -> MMc:
    """The queue with the fewest servers whose mean wait W_q is at most `target_wait`.

    W_q falls as servers are added, and c >= (L + 1/S)/M is always enough (W_q <= 1/(cM - L)),
    so the search upward from the fewest stable servers ends.
    """
    load = _offered_load(arrival_rate, service_rate)
    if not (math.isfinite(target_wait) and target_wait > 0):
        raise QueueingError(f"target wait must be a positive finite number, got {target_wait!r}")
    servers = math.floor(load) + 1
    if servers > MAX_SERVERS:
        raise QueueingError(
            f"offered load {load:.4g} Erlangs needs more than {MAX_SERVERS} servers"
        )
    b = erlang_b(servers, load)
    while True:
        figures = _figures(arrival_rate, service_rate, servers, _c_from_b(servers, load, b))
        if figures.mean_wait <= target_wait:
            return figures
        if servers == MAX_SERVERS:
            raise QueueingError(
                f"a mean wait of {target_wait:.4g} needs more than {MAX_SERVERS} servers"
            )
        servers += 1
        b = load * b / (servers + load * b)


def _offered_load(arrival_rate: float, service_rate: float) -> float:
    for name, rate in (("arrival rate", arrival_rate), ("service rate", service_rate)):
        if not (math.isfinite(rate) and rate > 0):
            raise QueueingError(f"{name} must be a positive finite number, got {rate!r}")
    load = arrival_rate / service_rate
    if not math.isfinite(load):
        raise QueueingError(
            f"offered load (arrival rate / service rate) overflows: {arrival_rate!r} / "
            f"{service_rate!r}"
        )
    return load


def _figures(arrival_rate: float, service_rate: float, servers: int, p_wait: float) -> MMc:
    load = arrival_rate / service_rate
    # M(c - a) rather than cM - L: c - a > 0 was checked on these floats; only underflow zeroes it
    spare = service_rate * (servers - load)  # the rate at which the queue drains
    mean_wait = p_wait / spare if spare > 0 else math.inf
    figures = MMc(
        arrival_rate=arrival_rate,
        service_rate=service_rate,
        servers=servers,
        offered_load=load,
        utilisation=load / servers,
        p_wait=p_wait,
        mean_wait=mean_wait,
        mean_response=mean_wait + 1.0 / service_rate,
        mean_queue_length=arrival_rate * mean_wait,
    )
    if not math.isfinite(figures.mean_response + figures.mean_queue_length):
        raise QueueingError(
            f"the figures overflow a float with rates {arrival_rate!r} and {service_rate!r}"
        )
    return figures
