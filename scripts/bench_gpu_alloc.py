"""Benchmark of GPU placement, run by `scripts/bench gpu-alloc` (pure Python, no cgroups).

Replays one seeded trace of arrivals and departures per shipped node (config/gpus/) with
three allocators: nodeagent's placement, go-gpuallocator's best effort, and first fit.
Jobs ask for 1, 2, 4 or 8 whole GPUs (never more than the node has) for mixed durations;
a share of the one-GPU jobs are small inference jobs that share a GPU by memory; on a
MIG node every job asks for one MIG instance of a profile the node has. The queue is
first come, first served with backfill: whenever GPUs free up, every waiting job is
tried in arrival order.

Durations: every job has a class, short (70%, a mean of 1) or long (a mean of 8), and the
allocators are told what the daemon would know (--durations): `class`, the median of the
last holds of the job's class in this replay (nothing before the first ends); `declared`,
its own estimate from a deadline and work, its true duration times a log-normal error
(--error, sigma; the same draws for every allocator); `exact`; or `none`. Placement gets
each request's expected duration, when each held GPU is expected back, and, for a job
that already waits, a patience of --patience times its expected duration less what it
has waited for a better set (nodeagent.gpualloc.placement.durations, as in the daemon); the
baselines ignore all three.

Per node and allocator it prints the share of jobs that waited; the share that waited
while enough GPU capacity was free in total (free memory summed over the GPUs nobody
holds alone, in GPUs: waits that fragmentation caused); the mean wait; the share of jobs
that waited for a better set at least once; the mean score of multi-GPU placements as a
fraction of the best possible for that size on an empty node, and the lowest; the share
of multi-GPU placements that span NUMA nodes; and the decision time. Then the decision
time on an empty node at 8 and 16 GPUs. It never asserts: the goals (score fraction >=
0.95 everywhere, never below best effort, never more waits than first fit: its share
waited, its share waited with enough free and its mean wait) are reported.

With --clairvoyant BEAM, also what an allocator that knew every job's duration could reach
on the same schedule (the start and end times of the replay with placement): each placement
chosen knowing the whole future, by a search over who holds which GPU that keeps the BEAM
best states after each event (0: all of them, exact). It reaches at least what placement
did when exact, and is a lower bound of that optimum when beamed; nodes over 8 GPUs are
skipped (too many states). It tells what an online allocator, which knows no durations,
loses to the order of departures.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchref.placement_baselines import best_effort, first_fit

from nodeagent.gpu.simulated import load_simulated
from nodeagent.gpualloc.placement import GpuRequest, Holdings, NodeGpus, Placement, Refusal, place
from nodeagent.gpualloc.placement import durations as gpu_durations

REPO = Path(__file__).resolve().parents[1]
NODES = REPO / "config" / "gpus"
Allocator = Callable[[GpuRequest, NodeGpus, Holdings], Placement | Refusal]
ALLOCATORS: dict[str, Allocator] = {
    "placement": place,
    "best-effort": best_effort,
    "first-fit": first_fit,
}
SIZES = {1: 0.4, 2: 0.3, 4: 0.2, 8: 0.1}
CLASSES = {"short": (0.7, 1.0), "long": (0.3, 8.0)}
"""Duration classes: share of jobs and mean duration (exponential)."""
DURATIONS = ("class", "declared", "exact", "none")
SHARED = 0.3
"""Share of one-GPU jobs that are shared inference jobs."""
SHARED_MEMORY = (0.05, 0.1, 0.2, 0.3, 0.4)
"""What a shared job asks, as a share of a GPU's memory."""
LOAD = 0.8
"""Default offered load: GPU-time asked per unit of time, over the node's GPUs."""
TIMING_REPEATS = 15
TIMED = ("dgx-h100-nvswitch", "hgx2-16x-v100-nvswitch")
"""The nodes whose empty-node decision time is measured: 8 and 16 GPUs, one NVSwitch
fabric each, where every set scores alike but for the PCIe path (the most ties)."""


@dataclass(frozen=True)
class Job:
    id: int
    arrival: float
    duration: float
    request: GpuRequest
    cls: str = "short"


def trace(node: NodeGpus, count: int, seed: int, load: float) -> list[Job]:
    """The same jobs for every allocator: sizes, shares, durations and arrival times."""
    rng = random.Random(seed)  # noqa: S311 (a reproducible trace, not a secret)
    whole = [d for d in node.devices if not d.mig_enabled]
    profiles = sorted({m.profile for d in node.devices for m in d.mig_devices})
    sizes = {k: p for k, p in SIZES.items() if k <= len(whole)}
    memory = min((d.memory_total or 0) for d in whole) if whole else 0
    jobs, demand = [], []
    for i in range(count):
        cls = "short" if rng.random() < CLASSES["short"][0] else "long"
        duration = rng.expovariate(1 / CLASSES[cls][1])
        if profiles:
            request = GpuRequest(mig_profile=rng.choice(profiles))
            gpus = 1.0 / max(len(d.mig_devices) for d in node.devices)
        else:
            k = rng.choices(list(sizes), weights=list(sizes.values()))[0]
            if k == 1 and rng.random() < SHARED:
                share = rng.choice(SHARED_MEMORY)
                request = GpuRequest(memory=int(memory * share), shared=True)
                gpus = share
            else:
                request = GpuRequest(count=k)
                gpus = k
        jobs.append(Job(i, 0.0, duration, request, cls))
        demand.append(gpus * duration)
    capacity = len(whole) or 1
    rate = load * capacity / statistics.fmean(demand)
    t = 0.0
    for i, job in enumerate(jobs):
        t += rng.expovariate(rate)
        jobs[i] = Job(job.id, t, job.duration, job.request, job.cls)
    return jobs


@dataclass
class State:
    exclusive: set[str] = field(default_factory=set)
    shared: dict[str, int] = field(default_factory=dict)

    def holdings(self) -> Holdings:
        return Holdings(frozenset(self.exclusive), dict(self.shared))

    def take(self, request: GpuRequest, p: Placement) -> None:
        for uuid in p.uuids:
            if request.shared:
                self.shared[uuid] = self.shared.get(uuid, 0) + (request.memory or 0)
            else:
                self.exclusive.add(uuid)

    def give_back(self, request: GpuRequest, p: Placement) -> None:
        for uuid in p.uuids:
            if request.shared:
                self.shared[uuid] -= request.memory or 0
                if not self.shared[uuid]:
                    del self.shared[uuid]
            else:
                self.exclusive.discard(uuid)


def enough_in_total(node: NodeGpus, state: State, request: GpuRequest) -> bool:
    """Whether the free capacity, summed over GPUs nobody holds alone, would fit the job."""
    if request.mig_profile is not None:
        return any(
            m.profile == request.mig_profile and m.uuid not in state.exclusive
            for d in node.devices
            for m in d.mig_devices
        )
    free = [
        (d.memory_total or 0) - state.shared.get(d.uuid, 0)
        for d in node.devices
        if d.healthy and not d.mig_enabled and d.uuid not in state.exclusive
    ]
    if request.shared:
        return sum(free) >= (request.memory or 0)
    total = max((d.memory_total or 1) for d in node.devices)
    return sum(free) / total >= request.count


@dataclass(frozen=True)
class Knowledge:
    """What placement is told about durations (the baselines are told nothing)."""

    durations: str = "class"
    patience: float = gpu_durations.PATIENCE
    declared: dict[int, float] = field(default_factory=dict)
    """Per job: its declared duration, for `declared`."""


def declarations(jobs: list[Job], seed: int, error: float) -> dict[int, float]:
    """Each job's own estimate: its duration times a log-normal error of sigma `error`."""
    rng = random.Random(f"declared {seed}")  # noqa: S311 (reproducible, not a secret)
    return {j.id: j.duration * rng.lognormvariate(0.0, error) for j in jobs}


class Informant:
    """What placement is told in a replay, as the daemon would tell it: each request's
    expected duration, when each held GPU is expected back, and for a job that already
    waits its patience left. Without Knowledge, nothing."""

    def __init__(self, knows: Knowledge | None) -> None:
        self.knows = knows
        self.history: dict[str, list[float]] = {c: [] for c in CLASSES}
        self.expected: dict[int, float | None] = {}
        self.started: dict[int, float] = {}
        self.held_back_since: dict[int, float] = {}

    def expectation(self, job: Job) -> float | None:
        knows = self.knows
        if knows is None or knows.durations == "none":
            return None
        if knows.durations == "exact":
            return job.duration
        if knows.durations == "declared":
            return knows.declared[job.id]
        return gpu_durations.expected_duration(None, self.history[job.cls])

    def asked(
        self, job: Job, now: float, waiting: bool, held: Holdings, running: dict[int, Placement]
    ) -> tuple[GpuRequest, Holdings]:
        if self.knows is None:
            return job.request, held
        e = self.expectation(job)
        back = gpu_durations.releases(
            (
                p.uuids,
                None if (d := self.expected[j]) is None else self.started[j] + d - now,
            )
            for j, p in running.items()
        )
        since = self.held_back_since.get(job.id, now)
        patience = gpu_durations.patience(self.knows.patience, e, now - since) if waiting else 0.0
        request = replace(job.request, expected_duration=e, patience=patience)
        return request, Holdings(held.exclusive, held.shared, back)

    def started_on(self, job: Job, request: GpuRequest, now: float) -> None:
        self.expected[job.id], self.started[job.id] = request.expected_duration, now

    def ended(self, job: Job) -> None:
        self.history[job.cls].append(job.duration)


def replay(
    node: NodeGpus,
    jobs: list[Job],
    allocate: Allocator,
    starts: dict[int, float] | None = None,
    knows: Knowledge | None = None,
) -> dict[str, Any]:
    for k in range(1, len(node.devices) + 1):
        node.best_possible(k)  # cached for every allocator's explanations: not a decision cost
    state = State()
    events: list[tuple[float, int, int]] = [(j.arrival, 1, j.id) for j in jobs]
    heapq.heapify(events)
    queue: list[Job] = []
    running: dict[int, Placement] = {}
    waited = frag_waited = 0
    fractions: list[float] = []
    crossing = multi = 0
    decide: list[float] = []
    waits: list[float] = []
    told = Informant(knows)

    def attempt(job: Job, now: float, waiting: bool) -> bool:
        request, held = told.asked(job, now, waiting, state.holdings(), running)
        start = time.perf_counter()
        result = allocate(request, node, held)
        decide.append(time.perf_counter() - start)
        if isinstance(result, Refusal):
            if result.better_in is not None:
                told.held_back_since.setdefault(job.id, now)
            return False
        nonlocal crossing, multi
        state.take(job.request, result)
        running[job.id] = result
        told.started_on(job, request, now)
        if starts is not None:
            starts[job.id] = now
        heapq.heappush(events, (now + job.duration, 0, job.id))
        waits.append(now - job.arrival)
        if job.request.count >= 2 and job.request.mig_profile is None:
            multi += 1
            fractions.append(result.fraction)
            crossing += len(result.numa_nodes) > 1
        return True

    while events:
        now, kind, job_id = heapq.heappop(events)
        job = jobs[job_id]
        if kind == 0:  # a departure frees GPUs: try every waiting job, in arrival order
            state.give_back(job.request, running.pop(job_id))
            told.ended(job)
            queue = [j for j in queue if not attempt(j, now, True)]
        elif not attempt(job, now, False):
            waited += 1
            frag_waited += enough_in_total(node, state, job.request)
            queue.append(job)
    assert not queue and not running, "the trace ends with every job run"
    return {
        "jobs": len(jobs),
        "held_at_end": len(state.exclusive) + len(state.shared),
        "waited": waited / len(jobs),
        "waited_with_enough_free": frag_waited / len(jobs),
        "mean_wait": statistics.fmean(waits),
        "waited_for_a_better_set": len(told.held_back_since) / len(jobs),
        "score_fraction_mean": statistics.fmean(fractions) if fractions else None,
        "score_fraction_min": min(fractions) if fractions else None,
        "multi_gpu_placements": multi,
        "cross_numa": crossing / multi if multi else None,
        "decide_ms_mean": 1000 * statistics.fmean(decide),
        "decide_ms_p99": 1000 * sorted(decide)[int(0.99 * (len(decide) - 1))],
    }


def clairvoyant(
    node: NodeGpus, jobs: list[Job], starts: dict[int, float], beam: int
) -> float | None:
    """The mean score fraction of multi-GPU jobs when every placement knows the future, on
    the schedule `starts`: the best over every assignment of GPUs to jobs that fits it (an
    exclusive job on GPUs nobody else holds, a shared job on one GPU with room), searched
    event by event over the states (who holds each GPU), keeping the `beam` best (0: all).
    None when the node has none, or when the beam dropped every state that fits."""
    n = len(node.devices)
    multi = [j for j in jobs if j.request.count >= 2 and j.request.mig_profile is None]
    if not multi or n > 8 or any(d.mig_enabled for d in node.devices):
        return None
    cap = [d.memory_total or 0 for d in node.devices]
    fraction = {
        c: sum(node.weights[a][b] for a, b in itertools.combinations(c, 2))
        / (node.best_possible(k) or 1)
        for k in {j.request.count for j in multi}
        for c in itertools.combinations(range(n), k)
    }
    events = sorted(
        [(starts[j.id], 1, j.id) for j in jobs]
        + [(starts[j.id] + j.duration, 0, j.id) for j in jobs]
    )
    Gpu = tuple[int, tuple[int, ...]]  # (exclusive holder or -1, shared holders)
    states: dict[tuple[Gpu, ...], float] = {tuple((-1, ()) for _ in range(n)): 0.0}
    for _, kind, jid in events:
        request = jobs[jid].request
        new: dict[tuple[Gpu, ...], float] = {}
        for st, value in states.items():
            if kind == 0:
                out = [
                    tuple((-1 if e == jid else e, tuple(x for x in sh if x != jid)) for e, sh in st)
                ]
                gains = [0.0]
            elif request.shared:
                need = request.memory or 0
                out = [
                    (*st[:g], (-1, (*sh, jid)), *st[g + 1 :])
                    for g, (e, sh) in enumerate(st)
                    if e == -1 and sum(jobs[x].request.memory or 0 for x in sh) + need <= cap[g]
                ]
                gains = [0.0] * len(out)
            else:
                free = [g for g, gpu in enumerate(st) if gpu == (-1, ())]
                sets = list(itertools.combinations(free, request.count))
                out = [
                    tuple((jid, ()) if g in c else gpu for g, gpu in enumerate(st)) for c in sets
                ]
                gains = [fraction.get(c, 0.0) for c in sets]
            for state, gain in zip(out, gains, strict=True):
                if new.get(state, -1.0) < value + gain:
                    new[state] = value + gain
        if not new:
            return None
        if beam and len(new) > beam:
            new = dict(sorted(new.items(), key=lambda kv: -kv[1])[:beam])
        states = new
    return max(states.values()) / len(multi)


def empty_node_times(node: NodeGpus) -> dict[str, dict[int, float]]:
    """Median decision time (ms) for k GPUs on the empty node, per allocator."""
    out: dict[str, dict[int, float]] = {}
    for name, allocate in ALLOCATORS.items():
        out[name] = {}
        for k in (1, 2, 4, 8):
            if k > len(node.devices):
                continue
            times = []
            for _ in range(TIMING_REPEATS if name != "best-effort" or k < 4 else 3):
                start = time.perf_counter()
                allocate(GpuRequest(count=k), node, Holdings())
                times.append(time.perf_counter() - start)
            out[name][k] = 1000 * statistics.median(times)
    return out


def shipped() -> list[tuple[str, NodeGpus]]:
    nodes = []
    for path in sorted(NODES.glob("*.yaml")):
        b = load_simulated(path)
        nodes.append((path.stem, NodeGpus(b.inventory(), b.topology())))
    return nodes


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="trace seed (default 1)")
    parser.add_argument("--jobs", type=int, default=400, help="jobs per node (default 400)")
    parser.add_argument("--load", type=float, default=LOAD, help=f"offered load (default {LOAD})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--durations",
        choices=DURATIONS,
        default="class",
        help="what placement knows of durations: its class's recent holds (default), a "
        "declared estimate, the exact duration, or nothing",
    )
    parser.add_argument(
        "--error",
        type=float,
        default=0.5,
        metavar="SIGMA",
        help="log-normal error of declared durations (default 0.5: off by 1.65x typically)",
    )
    parser.add_argument(
        "--patience",
        type=float,
        default=gpu_durations.PATIENCE,
        metavar="SHARE",
        help="share of its expected duration a waiting job may wait for a better set "
        f"(default {gpu_durations.PATIENCE}, as gpu.patience; 0: never)",
    )
    parser.add_argument(
        "--clairvoyant",
        type=int,
        metavar="BEAM",
        help="also the score fraction with every arrival and duration known, on "
        "placement's schedule (nodes of up to 8 GPUs; keeps the BEAM best states, 0: exact)",
    )
    args = parser.parse_args()
    nodes = shipped()
    results: dict[str, Any] = {}
    for name, node in nodes:
        jobs = trace(node, args.jobs, args.seed, args.load)
        knows = Knowledge(args.durations, args.patience, declarations(jobs, args.seed, args.error))
        starts: dict[int, float] = {}
        results[name] = {
            "gpus": len(node.devices),
            **{
                a: replay(
                    node,
                    jobs,
                    allocate,
                    starts if a == "placement" else None,
                    knows if a == "placement" else None,
                )
                for a, allocate in ALLOCATORS.items()
            },
        }
        if args.clairvoyant is not None:
            results[name]["clairvoyant_score_fraction"] = clairvoyant(
                node, jobs, starts, args.clairvoyant
            )
    by_name = dict(nodes)
    timing = {
        str(len(by_name[name].devices)): {"node": name, **empty_node_times(by_name[name])}
        for name in TIMED
    }
    report = {
        "seed": args.seed,
        "jobs_per_node": args.jobs,
        "load": args.load,
        "durations": args.durations,
        "declared_error": args.error if args.durations == "declared" else None,
        "patience": args.patience,
        "clairvoyant_beam": args.clairvoyant,
        "nodes": results,
        "empty_node_decide_ms": timing,
        "goals": goals(results),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print_tables(report)
    return 0


def goals(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, per node where a figure exists."""
    scored = {n: r for n, r in results.items() if r["placement"]["score_fraction_mean"] is not None}
    means = [r["placement"]["score_fraction_mean"] for r in scored.values()]
    lowest = [r["placement"]["score_fraction_min"] for r in scored.values()]

    def no_more_waits(r: dict[str, Any]) -> bool:
        ours, ff = r["placement"], r["first-fit"]
        return all(
            ours[key] <= ff[key] + 1e-12
            for key in ("waited", "waited_with_enough_free", "mean_wait")
        )

    return {
        "score_fraction_mean_at_least_0.95_everywhere": all(m >= 0.95 for m in means),
        "below_0.95": sorted(
            n for n, r in scored.items() if r["placement"]["score_fraction_mean"] < 0.95
        ),
        "lowest_mean_score_fraction": min(means) if means else None,
        "lowest_single_score_fraction": min(lowest) if lowest else None,
        "never_below_best_effort": all(
            r["placement"]["score_fraction_mean"] >= r["best-effort"]["score_fraction_mean"] - 1e-12
            for r in scored.values()
        ),
        "never_more_waits_than_first_fit": all(no_more_waits(r) for r in results.values()),
        "more_waits_than_first_fit": sorted(n for n, r in results.items() if not no_more_waits(r)),
    }


def print_tables(report: dict[str, Any]) -> None:
    results, timing, goals_ = report["nodes"], report["empty_node_decide_ms"], report["goals"]
    known = report["durations"] + (
        f" (sigma {report['declared_error']})" if report["declared_error"] is not None else ""
    )
    print(
        f"gpu-alloc: seed {report['seed']}, {report['jobs_per_node']} jobs per node at "
        f"{report['load']:.0%} offered load; k in 1/2/4/8, {SHARED:.0%} of one-GPU jobs shared "
        f"by memory; FIFO with backfill; placement knows durations: {known}, patience "
        f"{report['patience']}"
    )
    print(
        f"{'node':<34} {'allocator':<12} {'waited':>6} {'frag-wait':>9} {'wait':>6} "
        f"{'better':>6} {'score':>6} {'lowest':>6} {'x-NUMA':>6} {'decide ms mean/p99':>18}"
    )
    for name, r in results.items():
        for i, a in enumerate(ALLOCATORS):
            x = r[a]
            label = f"{name} ({r['gpus']})" if i == 0 else ""
            print(
                f"{label:<34} {a:<12} {x['waited']:>6.3f} {x['waited_with_enough_free']:>9.3f} "
                f"{x['mean_wait']:>6.2f} {x['waited_for_a_better_set']:>6.3f} "
                f"{fmt(x['score_fraction_mean']):>6} {fmt(x['score_fraction_min']):>6} "
                f"{fmt(x['cross_numa']):>6} "
                f"{x['decide_ms_mean']:>9.2f}/{x['decide_ms_p99']:<8.2f}"
            )
    if report["clairvoyant_beam"] is not None:
        beam = report["clairvoyant_beam"]
        print(
            "\nscore fraction with every arrival and duration known, on placement's schedule "
            f"({f'beam {beam}' if beam else 'exact'}):"
        )
        for name, r in results.items():
            print(f"{name:<34} {fmt(r['clairvoyant_score_fraction'])}")
    print("\ndecision time on an empty node, ms (median):")
    print(
        f"{'GPUs':>4} {'node':<28} {'allocator':<12}"
        + "".join(f"{'k=' + str(k):>9}" for k in (1, 2, 4, 8))
    )
    for gpus, t in timing.items():
        for a in ALLOCATORS:
            print(
                f"{gpus:>4} {t['node']:<28} {a:<12}"
                + "".join(f"{t[a].get(k, float('nan')):>9.2f}" for k in (1, 2, 4, 8))
            )
    below = ", ".join(goals_["below_0.95"]) or "none"
    more = ", ".join(goals_["more_waits_than_first_fit"]) or "none"
    print(
        "\ngoals: mean score fraction >= 0.95 on every node: "
        f"{'yes' if goals_['score_fraction_mean_at_least_0.95_everywhere'] else 'NO'} "
        f"(below: {below}; lowest mean {fmt(goals_['lowest_mean_score_fraction'])}, lowest "
        f"single placement {fmt(goals_['lowest_single_score_fraction'])}); never below best "
        f"effort: {'yes' if goals_['never_below_best_effort'] else 'NO'}; never more waits "
        f"than first fit (share waited, with enough free, mean wait): "
        f"{'yes' if goals_['never_more_waits_than_first_fit'] else 'NO'} (more: {more})"
    )


if __name__ == "__main__":
    sys.exit(main())
