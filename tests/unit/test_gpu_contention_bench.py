"""scripts/bench_gpu_contention.py, the article's question on a simulated clock: the trace is
seeded, every job that starts runs once and gives its GPUs back, and the figures say what
the queues do (an 8-GPU job starves behind small ones under greedy backfill, and starts
when its kept GPUs were promised under reservations). Figures, not speed, are checked."""

from __future__ import annotations

import random

import bench_gpu_contention as bench
import pytest

from nodeagent.gpu.simulated import load_simulated
from nodeagent.gpualloc import ledger as ledger_module
from nodeagent.gpualloc.placement import NodeGpus
from nodeagent.policyfile.model import Backfill


@pytest.fixture(scope="module")
def node() -> NodeGpus:
    backend = load_simulated(bench.NODES / bench.SHAPES["dgx-h100"])
    return NodeGpus(backend.inventory(), backend.topology())


def test_the_trace_is_seeded() -> None:
    def trace(seed: int) -> list[tuple[str, float, float]]:
        return [
            (j.name, j.arrives, j.runs) for j in bench.workload(random.Random(seed), 2, 150, True)
        ]

    assert trace(1) == trace(1) != trace(2)


@pytest.mark.parametrize("backfill", list(Backfill))
def test_every_job_that_starts_holds_its_gpus_once_and_never_more_than_the_node(
    node: NodeGpus, backfill: Backfill
) -> None:
    jobs = bench.workload(random.Random(3), 3, 150, True)
    bench.simulate(node, jobs, backfill, 3, 10)
    started = [j for j in jobs if j.started is not None]
    assert started and all(j.started is not None and j.started >= j.arrives for j in started)
    for t in range(0, 3 * 3600, 60):  # never more GPUs held than the node has
        busy = sum(
            j.count for j in started
            if j.started is not None and j.started <= t < (j.ended if j.ended is not None else 1e9)
        )  # fmt: skip
        assert busy <= len(node.devices), t


def test_reservations_start_the_big_job_when_promised_and_greedy_starves_it(
    node: NodeGpus,
) -> None:
    for seed in (1, 2, 3):
        greedy = bench.simulate(node, bench.workload(random.Random(seed), 6, 150, True),
                                Backfill.GREEDY, 6, 10)  # fmt: skip
        reserve = bench.simulate(node, bench.workload(random.Random(seed), 6, 150, True),
                                 Backfill.RESERVE, 6, 10)  # fmt: skip
        g = bench.figures("dgx-h100", Backfill.GREEDY, seed, greedy, 6)
        r = bench.figures("dgx-h100", Backfill.RESERVE, seed, reserve, 6)
        assert g["training_start_s"] is None, f"seed {seed}: greedy let it start"
        promised, started = r["promised_start_s"], r["training_start_s"]
        assert isinstance(promised, float) and isinstance(started, float)
        assert started <= promised + 2 * 10, f"seed {seed}: within a tick of its promise"
        assert r["utilisation"] >= g["utilisation"]  # type: ignore[operator]


def test_a_seed_gives_the_same_run_and_the_ledgers_own_ids_stay_random(node: NodeGpus) -> None:
    def run() -> dict[str, object]:
        jobs = bench.workload(random.Random(5), 2, 150, True)
        return bench.figures(
            "dgx-h100", Backfill.RESERVE, 5, bench.simulate(node, jobs, Backfill.RESERVE, 2, 10), 2
        )

    assert run() == run()
    assert len(ledger_module.new_id()) >= 20, "the bench's counting ids are its own"
