"""Capacity planning: how long requests wait on c servers, or how many servers a wait needs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import click

from nodeagent.cli.common import json_option
from nodeagent.cli.output import document, echo_json
from nodeagent.tables import table

if TYPE_CHECKING:
    from nodeagent.queueing import MMc


def figures(q: MMc, target_wait: float | None) -> dict[str, Any]:
    """The figures, each with its unit in its key: rates per second, times in seconds,
    probabilities and utilisation as fractions (0..1)."""
    return {
        "model": "M/M/c",
        "arrival_rate_per_second": q.arrival_rate,
        "service_rate_per_second": q.service_rate,
        "servers": q.servers,
        "target_wait_seconds": target_wait,
        "offered_load_erlangs": q.offered_load,
        "utilisation_fraction": q.utilisation,
        "p_wait_fraction": q.p_wait,
        "mean_wait_seconds": q.mean_wait,
        "mean_response_seconds": q.mean_response,
        "mean_queue_length_requests": q.mean_queue_length,
        "p_wait_exceeds_target_fraction": None
        if target_wait is None
        else q.wait_exceeds(target_wait),
    }


def figures_table(f: dict[str, Any]) -> str:
    def g(x: float) -> str:  # 4 significant digits; large counts in full, not as 1.2e+05
        return f"{x:.0f}" if 1e4 <= abs(x) < 1e12 else f"{x:.4g}"

    # rounded down, so that a stable queue never shows as 100% busy
    busy = f"{math.floor(f['utilisation_fraction'] * 1000) / 10:.1f}%"

    target = f["target_wait_seconds"]
    servers_note = "" if target is None else f"fewest with mean wait <= {g(target)} s"
    rows = [
        ("arrival rate (L)", g(f["arrival_rate_per_second"]), "requests/s"),
        ("service rate (M)", g(f["service_rate_per_second"]), "requests/s per server"),
        ("servers (c)", f["servers"], servers_note),
        ("offered load (a = L/M)", g(f["offered_load_erlangs"]), "Erlangs (mean busy servers)"),
        ("utilisation (a/c)", busy, ""),
        ("P(wait) (Erlang C)", g(f["p_wait_fraction"]), "share of requests that queue"),
        ("mean wait (W_q)", g(f["mean_wait_seconds"]), "s"),
        ("mean response (W_q + 1/M)", g(f["mean_response_seconds"]), "s"),
        ("mean queue length (L_q)", g(f["mean_queue_length_requests"]), "requests"),
    ]
    if target is not None:
        rows.append(
            (
                f"P(wait > {g(target)} s)",
                g(f["p_wait_exceeds_target_fraction"]),
                "share waiting longer",
            )
        )
    return table(("M/M/c", "VALUE", "UNIT"), rows)


@click.command()
@click.option(
    "--arrival-rate",
    "arrival_rate",
    type=float,
    required=True,
    metavar="L",
    help="Requests arriving per second, for all servers together.",
)
@click.option(
    "--service-rate",
    "service_rate",
    type=float,
    required=True,
    metavar="M",
    help="Requests one busy server completes per second (1 / mean service time).",
)
@click.option("--servers", type=int, metavar="C", help="Servers (replicas): print their figures.")
@click.option(
    "--target-wait",
    metavar="S",
    help="Mean wait to meet, in seconds or with a unit (10ms): print the fewest servers.",
)
@json_option
def capacity(
    arrival_rate: float,
    service_rate: float,
    servers: int | None,
    target_wait: str | None,
    as_json: bool,
) -> None:
    """Size an M/M/c queue: how long requests wait, or how many servers a wait needs.

    Requests arrive at random (Poisson) at L per second; each of C identical
    servers takes a random (exponential) time averaging 1/M seconds per request;
    a request waits in one shared queue while all C are busy. The figures are
    exact: Erlang C gives the probability of waiting, and the mean wait is
    W_q = P(wait) / (C*M - L). Give exactly one of --servers and --target-wait.

    \b
    Example: a model server does 40 requests/s per replica and 300 requests/s
    arrive. How many replicas for a 10 ms mean wait?
      nodeagent capacity --arrival-rate 300 --service-rate 40 --target-wait 10ms
    prints 9 replicas (mean wait 8.5 ms, 83% busy). And 8 replicas?
      nodeagent capacity --arrival-rate 300 --service-rate 40 --servers 8

    \b
    Exit status: 0 with the figures; 1 when the queue is unstable (L >= C*M:
    the queue grows without end; the message says how many servers stability
    needs); 2 for bad input (a rate or target that is not a positive number,
    C < 1, both or neither of --servers and --target-wait).
    """
    from nodeagent.policyfile.units import parse_duration
    from nodeagent.queueing import QueueingError, UnstableQueue, mmc, servers_for_wait

    if (servers is None) == (target_wait is None):
        raise click.UsageError("give exactly one of --servers C and --target-wait S")
    target: float | None = None
    try:
        if servers is not None:
            q = mmc(arrival_rate, service_rate, servers)
        else:
            assert target_wait is not None
            try:
                target = parse_duration(target_wait)
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="'--target-wait'") from e
            q = servers_for_wait(arrival_rate, service_rate, target)
    except UnstableQueue:
        raise
    except QueueingError as e:
        raise click.UsageError(str(e)) from e
    result = figures(q, target)
    if as_json:
        echo_json(document("CapacityPlan", result))
    else:
        click.echo(figures_table(result))
