"""Benchmark of the article's first question, run by `scripts/bench gpu-contention` (no
cgroups, no GPU: a simulated clock on simulated nodes, driving the daemon's own GPU ledger,
queue and placement, nodeagent.gpualloc).

A training job needs all 8 GPUs; 6 are held by 1-GPU inference jobs and 1-GPU batch jobs
keep arriving. What does the scheduler do? On a DGX H100 (NVSwitch) and a DGX-1 (V100,
hybrid cube mesh), from config/gpus/ (labelled stand-ins, their topologies as NVIDIA
documents them), for each seed:

- at 0 s six inference jobs start, one GPU each, for 20-60 min (uniform, seeded);
- at 60 s the training job asks for 8 GPUs, for 2 h;
- from 0 s on, 1-GPU batch jobs arrive (Poisson, one every --every seconds on average,
  150 by default, 5-30 min each, uniform: 7 of the 8 GPUs' worth) until --hours (6);
- every job declares its duration (as Slurm's time limits do; --undeclared leaves the
  batch jobs' to their class's history), asks as `exec --gpus` asks, claims its grant at
  once and releases it when it ends; the loop steps every --tick seconds, with every
  waiting request asked about (its exec polls).

Two queues: `greedy` (gpu.backfill: greedy, the queue before reservations: anything that
fits goes) and `reserve` (the default, EASY backfill: the first request that fits nowhere
has the GPUs it will get at its expected start kept for it). For each: when the training
job started (or that it never did within --hours), the start its reservation promised when
it was first made, the batch jobs' waits (p50, p95, max, and how many ever started),
GPU utilisation (GPU-seconds held over GPU-seconds in all) and the GPU-hours of work lost
to preemption, which is none: preemption that frees GPUs is not built yet (issue 38 item 2),
so the third queue the issue asks for is not here.
"""

from __future__ import annotations

import argparse
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path

from benchkit import Bench, percentile

from nodeagent import logs
from nodeagent.gpu.simulated import load_simulated
from nodeagent.gpualloc import ledger as ledger_module
from nodeagent.gpualloc.ledger import GpuLedger
from nodeagent.gpualloc.placement import GpuRequest, NodeGpus
from nodeagent.policyfile.model import Backfill

NODES = Path(__file__).resolve().parents[1] / "config" / "gpus"
SHAPES = {"dgx-h100": "dgx-h100-nvswitch.yaml", "dgx-1": "dgx1-v100-hybrid-cube-mesh.yaml"}
TRAINING_AT = 60.0
TRAINING_FOR = 2 * 3600.0


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", default="1,2,3", help="seeds, comma-separated (1,2,3)")
    parser.add_argument("--hours", type=float, default=6.0, help="simulated hours (6)")
    parser.add_argument(
        "--every", type=float, default=150.0, help="mean seconds between batch jobs (150)"
    )
    parser.add_argument("--tick", type=float, default=10.0, help="s between loop steps (10)")
    parser.add_argument(
        "--undeclared",
        action="store_true",
        help="batch jobs declare no duration: their class's recent holds estimate it",
    )


@dataclass
class Job:
    name: str
    count: int
    workload_class: str
    arrives: float
    runs: float
    declared: bool
    uid: int
    rid: str | None = None
    hold: str | None = None
    started: float | None = None
    ended: float | None = None


@dataclass
class Run:
    jobs: list[Job]
    promised: float | None = None
    """The training job's expected start when GPUs were first kept for it."""
    held: float = 0.0
    """GPU-seconds held by jobs."""
    notes: list[str] = field(default_factory=list)


def workload(rng: random.Random, hours: float, every: float, declared: bool) -> list[Job]:
    jobs = [
        Job(f"inference-{i}", 1, "inference", 0.0, rng.uniform(20, 60) * 60, True, 2000 + i)
        for i in range(6)
    ]
    jobs.append(Job("training", 8, "training", TRAINING_AT, TRAINING_FOR, True, 3000))
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(1.0 / every)
        if t >= hours * 3600:
            break
        jobs.append(Job(f"batch-{i}", 1, "batch", t, rng.uniform(5, 30) * 60, declared, 4000 + i))
        i += 1
    return sorted(jobs, key=lambda j: j.arrives)


def simulate(node: NodeGpus, jobs: list[Job], backfill: Backfill, hours: float, tick: float) -> Run:
    # requests asked in one step share its time, so the queue orders them by id: the ledger's
    # are random (unguessable, as the API needs); here they count up, so that a seed gives
    # the same run every time and ties go by arrival
    counter, random_ids = itertools.count(), ledger_module.new_id
    ledger_module.new_id = lambda: f"r{next(counter):08d}"
    try:
        return _simulate(node, jobs, backfill, hours, tick)
    finally:
        ledger_module.new_id = random_ids


def _simulate(
    node: NodeGpus, jobs: list[Job], backfill: Backfill, hours: float, tick: float
) -> Run:
    ledger = GpuLedger()
    run = Run(jobs)
    waiting: list[Job] = []
    pending = list(jobs)
    running: list[Job] = []
    gpus = len(node.devices)
    t = 0.0
    while t <= hours * 3600:
        for j in [j for j in running if j.started is not None and j.started + j.runs <= t]:
            assert j.hold is not None
            ledger.release_job(j.hold, j.uid, now=t)
            j.ended = t
            running.remove(j)
        while pending and pending[0].arrives <= t:
            j = pending.pop(0)
            answer = ledger.ask(
                j.name, GpuRequest(j.count), uid=j.uid, tenant="research", priority=100,
                deadline=None, fairness=0.0, workload_class=j.workload_class, node=node,
                now=t, claim_timeout=3600.0, max_waiting=10_000,
                declared=j.runs if j.declared else None, patience=0.0, backfill=backfill,
            )  # fmt: skip
            j.rid = answer.id
            waiting.append(j)
        asked = {w.id: t for w in ledger.queue()}  # every exec polls its request
        ledger.commit(ledger.decide(node, t, 3600.0, 0.0, asked=asked, backfill=backfill))
        # each exec learns of its grant from its status call (an ask may grant others too,
        # when it serves the whole queue) and claims it at once
        for j in [j for j in waiting if j.rid in ledger._granted]:
            waiting.remove(j)
            _claim(ledger, j, t, running)
        head = ledger.view().reserved
        if run.promised is None and head is not None and head.owner == "training":
            run.promised = head.start if head.start is not None else float("inf")
        run.held += tick * sum(j.count for j in running) / gpus
        t += tick
    return run


def _claim(ledger: GpuLedger, j: Job, t: float, running: list[Job]) -> None:
    assert j.rid is not None
    hold = ledger.claim(
        j.rid, uid=j.uid, owner=j.name, cgroup=f"jobs/{j.name}", tenant="research",
        workload_class=j.workload_class,
    )  # fmt: skip
    j.hold, j.started = hold.id, t
    running.append(j)


def main() -> None:
    with Bench("gpu-contention", __doc__, options) as bench:
        logs.configure("warning")
        args = bench.args
        seeds = [int(s) for s in args.seeds.split(",")]
        rows = []
        bench.say(
            "an 8-GPU training job at 60 s, 6 GPUs held by 1-GPU inference jobs, 1-GPU batch"
            f" jobs every {args.every:.0f} s on average, {args.hours:g} h simulated,"
            f" {'batch durations undeclared' if args.undeclared else 'every duration declared'}"
        )
        bench.say(
            f"{'node':<9} {'queue':<8} {'seed':>4} {'training starts':>16} {'promised':>9}"
            f" {'batch wait p50':>14} {'p95':>7} {'max':>7} {'started':>9} {'util':>5}"
            f" {'lost GPU-h':>10}"
        )
        for shape, file in SHAPES.items():
            backend = load_simulated(NODES / file)
            node = NodeGpus(backend.inventory(), backend.topology())
            for seed in seeds:
                for backfill in (Backfill.GREEDY, Backfill.RESERVE):
                    jobs = workload(
                        random.Random(seed),  # noqa: S311 - a seeded trace, not a secret
                        args.hours,
                        args.every,
                        not args.undeclared,
                    )
                    run = simulate(node, jobs, backfill, args.hours, args.tick)
                    row = figures(shape, backfill, seed, run, args.hours)
                    rows.append(row)
                    bench.say(line(row))
        bench.figures["runs"] = rows
        bench.say(
            "(training starts: seconds after it asked, 'never' within the run; promised: the"
            " start its kept GPUs were expected free at, when first kept; lost GPU-h: work"
            " lost to preemption, none without it)"
        )


def figures(shape: str, backfill: Backfill, seed: int, run: Run, hours: float) -> dict[str, object]:
    training = next(j for j in run.jobs if j.name == "training")
    batch = [j for j in run.jobs if j.workload_class == "batch"]
    waits = [j.started - j.arrives for j in batch if j.started is not None]
    start = None if training.started is None else training.started - training.arrives
    promised = run.promised
    return {
        "node": shape,
        "queue": str(backfill),
        "seed": seed,
        "training_start_s": start,
        "promised_start_s": None
        if promised is None or promised == float("inf")
        else promised - training.arrives,
        "promised_unknown": promised == float("inf"),
        "batch_jobs": len(batch),
        "batch_started": len(waits),
        "batch_wait_p50_s": percentile(waits, 0.5),
        "batch_wait_p95_s": percentile(waits, 0.95),
        "batch_wait_max_s": max(waits, default=None),
        "utilisation": round(run.held / (hours * 3600), 4),
        "gpu_hours_lost": 0.0,
    }


def line(row: dict[str, object]) -> str:
    def s(v: object) -> str:
        return "-" if v is None else f"{float(v):.0f}"  # type: ignore[arg-type]

    start = "never" if row["training_start_s"] is None else s(row["training_start_s"])
    promised = "unknown" if row["promised_unknown"] else s(row["promised_start_s"])
    started = f"{row['batch_started']}/{row['batch_jobs']}"
    return (
        f"{row['node']:<9} {row['queue']:<8} {row['seed']:>4} {start:>16} {promised:>9}"
        f" {s(row['batch_wait_p50_s']):>14} {s(row['batch_wait_p95_s']):>7}"
        f" {s(row['batch_wait_max_s']):>7} {started:>9} {row['utilisation']:>5.2f}"
        f" {row['gpu_hours_lost']:>10.1f}"
    )


if __name__ == "__main__":
    main()
