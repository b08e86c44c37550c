"""Deadline jobs on a real kernel, three ways: the kernel's default (every cgroup weight
100), fair share only, and with the deadline policy (EDF).

Each job is a real CPU-burning process (scripts/burn) with declared work and a deadline,
started through `nodeagent exec`. Two scenarios:

  feasible     a set the deadline policy can meet where equal weights miss (goal: 0 misses
               with the agent);
  infeasible   the same set with more work, where even the policy must miss (goal: no more
               misses than the offline simulation of the same set predicts).

For each way it prints the misses, the total tardiness, and for each job the CPU rate it
needed (work / time to its deadline) against the rate it got (work / time it took).
The offline predictions come from nodeagent.policy.simulate, which runs the real policies
on simulated ticks. --seed and --jobs draw a random set instead of the default one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import yaml
from benchkit import Bench

from nodeagent.api import client
from nodeagent.errors import NodeagentError
from nodeagent.policy.edf import Demand, feasible
from nodeagent.policy.simulate import SimJob, simulate
from nodeagent.spec.model import PolicySpec

MANAGED = "nodeagent-bench.slice"
BURN = str(Path(__file__).with_name("burn"))
WAYS = {
    "kernel": {"fair_share": {"enabled": False}, "deadlines": {"enabled": False}},
    "fair-share": {"deadlines": {"enabled": False}},
    "deadline": {},
}
# 2 CPUs: one two-threaded job needs 1.6 cores for 45 s; two small ones need little but
# share the CPUs under equal weights until they are done, and the big one misses.
DEFAULT_SET = [
    SimJob("big", 72, 45, 2, tenant="a"),
    SimJob("small-1", 12, 90, 1, tenant="b"),
    SimJob("small-2", 12, 90, 1, tenant="b"),
]


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, help="draw a random job set with this seed")
    p.add_argument("--jobs", type=int, default=3, help="jobs in a random set (default 3)")
    p.add_argument("--overload", type=float, default=1.35, help="work factor, infeasible set")


def policy(state: str, way: str) -> dict[str, Any]:
    return {
        "version": 1,
        "agent": {
            "managed_root": MANAGED,
            "interval": 1,
            "state_file": f"{state}/state.json",
            "socket": f"{state}/api.sock",
        },
        "tenants": {"a": {"shares": 1}, "b": {"shares": 1}},
        "jobs": {"default_tenant": "a"},
        **WAYS[way],
    }


def spec_for(way: str) -> PolicySpec:
    return PolicySpec.model_validate(policy("/var/lib/nodeagent-bench", way))  # never opened


def predicted(jobs: list[SimJob], cpus: int) -> dict[str, int]:
    kernel = simulate(jobs, spec_for("kernel"), cpus, policies=None)
    planned = simulate(jobs, spec_for("deadline"), cpus)
    return {"kernel": sum(o.missed for o in kernel), "deadline": sum(o.missed for o in planned)}


def draw(rng: random.Random, k: int, cpus: int) -> list[SimJob]:
    """A set feasible with 25% to spare that equal weights miss, drawn at random."""
    for _ in range(2000):
        jobs = []
        for i in range(k):
            p = rng.choice([1, 1, 2])
            deadline = rng.uniform(30, 90)
            rate = rng.uniform(0.1, 0.9) * p
            jobs.append(SimJob(f"j{i}", round(rate * deadline, 1), round(deadline), p,
                               tenant=rng.choice("ab")))  # fmt: skip
        demands = [Demand(j.name, j.work, j.deadline, j.parallelism) for j in jobs]
        if feasible(demands, cpus / 1.25) and predicted(jobs, cpus)["kernel"] > 0:
            return jobs
    raise SystemExit(f"no feasible set of {k} jobs that equal weights miss was found")


def overloaded(jobs: list[SimJob], factor: float, cpus: int) -> list[SimJob]:
    while True:
        more = [replace(j, work=round(j.work * factor, 1)) for j in jobs]
        if predicted(more, cpus)["deadline"] > 0:
            return more
        factor *= 1.15


def wait_for_api(sock: str, agent: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if agent.poll() is not None:
            raise SystemExit(f"the agent exited:\n{log.read_text()[-3000:]}")
        try:
            status = client.get(sock, "/v1/status")
            if isinstance(status, dict) and status.get("tick"):
                return
        except NodeagentError:
            pass
        time.sleep(0.2)
    raise SystemExit("the agent did not answer in time")


def run_way(jobs: list[SimJob], way: str, state: str) -> dict[str, Any]:
    config = Path(state, f"{way}.yaml")
    config.write_text(yaml.safe_dump(policy(state, way)))
    sock = f"{state}/api.sock"
    log = Path(state, f"agent-{way}.log")
    with open(log, "w") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", "run", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_api(sock, agent, log)
        procs = {}
        for j in jobs:
            procs[j.name] = subprocess.Popen(
                ["nodeagent", "exec", "--socket", sock, "--name", j.name, "--tenant", j.tenant,
                 "--class", "training", "--deadline", f"+{j.deadline}s", "--work", str(j.work),
                 "--", sys.executable, "-S", BURN, str(j.work), str(j.parallelism)],
            )  # fmt: skip
        records: dict[str, dict[str, Any]] = {}
        finished: dict[str, float] = {}
        codes: dict[str, int] = {}
        while len(finished) < len(jobs):
            if len(records) < len(jobs):
                listed = client.get(sock, "/v1/jobs")
                assert isinstance(listed, dict)
                records.update({r["name"]: r for r in listed["jobs"]})
            for name, p in procs.items():
                if name not in finished and p.poll() is not None:
                    finished[name] = time.time()
                    codes[name] = p.returncode
            time.sleep(0.05)
        status = client.get(sock, "/v1/status")
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
    rows = []
    for j in jobs:
        r = records.get(j.name)
        if r is None:
            raise SystemExit(f"job {j.name} was never seen by the daemon (exit {codes[j.name]})")
        start, deadline, end = r["submitted_at"], r["deadline"], finished[j.name]
        rows.append(
            {
                "job": j.name,
                "work_cpu_s": j.work,
                "parallelism": j.parallelism,
                "exit": codes[j.name],
                "required_cores": j.work / (deadline - start),
                "got_cores": j.work / (end - start),
                "late_s": end - deadline,
                "missed": end > deadline,
            }
        )
    return {
        "misses": sum(r["missed"] for r in rows),
        "tardiness_s": sum(max(0.0, r["late_s"]) for r in rows),
        "deadline_misses_counted_by_daemon": None
        if not isinstance(status, dict)
        else status.get("deadline_misses"),
        "jobs": rows,
    }


def report(bench: Bench, scenario: str, jobs: list[SimJob], results: dict[str, Any]) -> None:
    bench.say()
    bench.say(f"scenario {scenario}: " + ", ".join(
        f"{j.name} {j.work:g} CPU-s by {j.deadline:g} s on {j.parallelism} thread(s)" for j in jobs
    ))  # fmt: skip
    bench.say(
        f"  offline prediction: {results['predicted']['kernel']} miss(es) with equal weights,"
        f" {results['predicted']['deadline']} with the deadline policy"
    )
    bench.say(f"  {'way':<11} {'misses':>6} {'tardiness':>10}   per job: needed -> got cores, late")
    for way, r in results["ways"].items():
        per = "; ".join(
            f"{x['job']} {x['required_cores']:.2f}->{x['got_cores']:.2f} {x['late_s']:+.1f}s"
            for x in r["jobs"]
        )
        bench.say(f"  {way:<11} {r['misses']:>6} {r['tardiness_s']:>9.1f}s   {per}")


def main() -> None:
    with Bench("deadline", __doc__, options) as bench:
        args = bench.args
        cpus = os.cpu_count() or 1
        if args.seed is None and args.jobs == 3:
            feasible_set = DEFAULT_SET
        else:
            rng = random.Random(args.seed or 0)  # noqa: S311 - a reproducible draw
            feasible_set = draw(rng, args.jobs, cpus)
        scenarios = {
            "feasible": feasible_set,
            "infeasible": overloaded(feasible_set, args.overload, cpus),
        }
        bench.figures["scenarios"] = {}
        with tempfile.TemporaryDirectory() as state:
            for scenario, jobs in scenarios.items():
                results: dict[str, Any] = {
                    "jobs": [asdict(j) | {"workload_class": str(j.workload_class)} for j in jobs],
                    "predicted": predicted(jobs, cpus),
                    "ways": {},
                }
                for way in WAYS:
                    results["ways"][way] = run_way(jobs, way, state)
                bench.figures["scenarios"][scenario] = results
                report(bench, scenario, jobs, results)
        f = bench.figures["scenarios"]
        bench.say()
        bench.say(
            f"goals: feasible with the agent {f['feasible']['ways']['deadline']['misses']} misses"
            " (goal 0); infeasible with the agent"
            f" {f['infeasible']['ways']['deadline']['misses']} misses against"
            f" {f['infeasible']['predicted']['deadline']} predicted (goal: no more)"
        )
        json.dumps(bench.figures)  # the figures must serialise


if __name__ == "__main__":
    main()
