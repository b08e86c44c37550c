"""Deadlines by EDF priority on a real kernel: three single-threaded jobs that only strict
ordering meets are all met, and the one due last never takes CPU the earlier ones need.

The jobs run on two CPUs whatever the host has (they are pinned to two, and the rest is
reserved for the system in the policy), so the test means the same in the 2-CPU VM and on
a larger native host.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, running, spawn, spec, usage_us, wait_for

from nodeagent.cgroupfs.values import Attribute, CpuWeight
from nodeagent.daemon import Agent

BURN = str(Path(__file__).parents[2] / "scripts" / "burn")
# At a steady pace the set needs 0.71 + 0.71 + 0.55 = 1.96 of the 2 CPUs, and of what the
# emulated VM really gives the jobs beside the daemon (about 1.7, measured) more than all: equal
# weights (2/3 of a core each at best) finish a and b at 18 s or later, late. EDF runs a and b
# on a CPU each (done at 12 s, or near 14.5 s on what the VM gives), then c on the first CPU
# free (done near 36-41 s): each meets its deadline, with room for what the daemon and the VM
# take themselves (a set with 3 s to spare for a and b missed by a second on a loaded host).
JOBS = {"a": (12.0, 17.0), "b": (12.0, 17.0), "c": (24.0, 44.0)}  # CPU-s, deadline in s


@pytest.mark.nightly
def test_three_jobs_only_strict_ordering_meets_are_all_met(
    managed: str, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    two = sorted(os.sched_getaffinity(0))[:2]
    cpus = os.cpu_count() or 2
    start = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=20)  # after the agent is up
    paths = {n: Path(ROOT, managed, f"d-{n}") for n in JOBS}
    for p in paths.values():
        p.mkdir(parents=True)

    def rule(name: str) -> dict[str, Any]:
        work, due = JOBS[name]
        when = (start + dt.timedelta(seconds=due)).isoformat()
        return {"name": name, "match": {"name": f"d-{name}"}, "tenant": "t",
                "class": "training", "deadline": when, "work": work}  # fmt: skip

    policy = spec(
        managed,
        tmp_path,
        agent={"interval": 1},
        tenants={"t": {"shares": 1}},
        node={"reserved_cpu": cpus - 2},  # plan on the two CPUs the jobs are pinned to
        rules=[rule(n) for n in JOBS],
    )
    with running(policy) as agent:
        wait = (start - dt.datetime.now(dt.UTC)).total_seconds()
        assert wait > 0, "the agent took longer than 20 s to start"
        time.sleep(wait)
        t0 = time.time()
        pinned = ["taskset", "-c", ",".join(map(str, two)), "python3", "-S", BURN]
        for n, (work, _) in JOBS.items():
            procs.append(spawn(paths[n], [*pinned, str(work)]))
        ends: dict[str, float] = {}

        def wait_for_exit(name: str, p: subprocess.Popen[bytes]) -> None:
            p.wait()
            ends[name] = time.time() - t0

        waiters = [
            threading.Thread(target=wait_for_exit, args=(n, p))
            for n, p in zip(JOBS, procs[-3:], strict=True)
        ]
        for w in waiters:
            w.start()
        # the agent has planned them: c, due last, has the least weight
        assert wait_for(lambda: agent.rec.last is not None and _ranked(agent, managed), timeout=10)
        c_before, c_at = usage_us(paths["c"]), time.time()
        assert wait_for(lambda: bool(ends), timeout=60), "neither a nor b finished in 60 s"
        c_rate = (usage_us(paths["c"]) - c_before) / 1e6 / (time.time() - c_at)
        for w in waiters:
            w.join(timeout=120)
    print(f"finished: {ends}; c used {c_rate:.3f} cores while a and b ran")
    # c, due last, is held back while a and b run: equal weights would give it 2/3 of a core.
    # It gets a little (0.01-0.29 measured in the VM: the plan's margin, the kernel's balancing,
    # its cap lapsing between shortfalls), never what a and b need to be on time (asserted
    # below)
    assert c_rate < 0.4, f"c took {c_rate:.2f} cores while a and b ran"
    for n, (_, due) in JOBS.items():
        assert n in ends, f"job {n} did not finish"
        assert ends[n] <= due, f"job {n} finished at {ends[n]:.1f} s, deadline {due:.0f} s"


def _ranked(agent: Agent, managed: str) -> bool:
    """The last tick planned the three jobs, c with the least weight."""
    last = agent.rec.last
    assert last is not None
    weights = {}
    for cg in last.plan.cgroups:
        name = cg.path.rsplit("/", 1)[-1]
        target = cg.targets.get(Attribute.CPU_WEIGHT)
        if cg.path.startswith(managed) and name.startswith("d-") and target is not None:
            assert isinstance(target.value, CpuWeight)
            weights[name] = target.value.value
    return len(weights) == 3 and weights["d-c"] < min(weights["d-a"], weights["d-b"])
