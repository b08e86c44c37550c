"""Deadline jobs on a real kernel, three ways: the kernel's default (every cgroup weight
100), fair share only, and with the deadline policy (EDF).

Each job is a real CPU-burning process (scripts/burn) with declared work and a deadline,
started as `nodeagent exec` starts one (a child of this process waits on a pipe, the daemon
puts it in its cgroup, then it execs), all at one instant: no Python start-up is counted
against a deadline. One daemon serves each way for all of its sets.

Without --sets, two scenarios (the default set, or one drawn with --seed):
  feasible     a set the deadline policy can meet where equal weights miss (goal: 0 misses);
  infeasible   the same set with more work, where even the policy must miss (goal: no more
               misses than the offline simulation predicts, less tardiness than both others).
With --sets N, N random sets (1 to 3 jobs per CPU, parallelism 1 and 2, 60-95% of the CPUs
at a steady pace, one in four over 100%, some of those infeasible), each run three ways
(goal: misses with the policy no more than the offline optimum, 0 on every feasible set).

For each job it prints the rate it needed (work / time to its deadline) against the rate it
got (work / time it took), how late it was, and the finish the offline simulation
(scripts/benchref/simulate.py, the real policies on simulated ticks, with the overhead measured
on this node before the runs) predicted against the finish measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import psutil
import yaml
from benchkit import Bench, wait_for_api
from benchref.simulate import SimJob, simulate

from nodeagent.api import client
from nodeagent.errors import NodeagentError
from nodeagent.policy.edf import Demand, feasible
from nodeagent.policy.plan import DEFAULT_POLICIES
from nodeagent.policyfile.model import PolicySpec

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
TICK = 1.0


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, help="draw the random set(s) with this seed")
    p.add_argument("--jobs", type=int, default=3, help="jobs in a random scenario (default 3)")
    p.add_argument("--overload", type=float, default=1.35, help="work factor, infeasible set")
    p.add_argument(
        "--sets", type=int, metavar="N", help="run N random sets instead of the two scenarios"
    )


def policy(state: str, way: str) -> dict[str, Any]:
    return {
        "version": 1,
        "agent": {
            "managed_root": MANAGED,
            "interval": TICK,
            "state_file": f"{state}/state-{way}.json",
            "socket": f"{state}/api.sock",
        },
        "tenants": {"a": {"shares": 1}, "b": {"shares": 1}},
        "jobs": {"default_tenant": "a"},
        **WAYS[way],
    }


def spec_for(way: str) -> PolicySpec:
    return PolicySpec.model_validate(policy("/var/lib/nodeagent-bench", way))  # never opened


def predicted(jobs: list[SimJob], cpus: int, overhead: float = 0.0) -> dict[str, list[Any]]:
    """Each way's simulated finish per job (None: not done by three deadlines' time)."""
    out = {}
    for way in WAYS:
        outcomes = simulate(
            jobs,
            spec_for(way),
            cpus,
            policies=None if way == "kernel" else DEFAULT_POLICIES,
            tick=TICK,
            overhead=overhead,
        )
        out[way] = [o.finish for o in outcomes]
    return out


def misses(jobs: list[SimJob], finishes: list[float | None]) -> int:
    return sum(f is None or f > j.deadline + 1e-6 for j, f in zip(jobs, finishes, strict=True))


def demands(jobs: list[SimJob]) -> list[Demand]:
    return [Demand(j.name, j.work, j.deadline, j.parallelism) for j in jobs]


def optimum(jobs: list[SimJob], cpus: int) -> int:
    """The fewest misses any schedule can have: all but the largest feasible subset."""
    for size in range(len(jobs), 0, -1):
        if any(feasible(demands(list(s)), cpus) for s in itertools.combinations(jobs, size)):
            return len(jobs) - size
    return len(jobs)


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
        if feasible(demands(jobs), cpus / 1.25) and misses(jobs, _kernel(jobs, cpus)) > 0:
            return jobs
    raise SystemExit(f"no feasible set of {k} jobs that equal weights miss was found")


def _kernel(jobs: list[SimJob], cpus: int) -> list[float | None]:
    return [o.finish for o in simulate(jobs, spec_for("kernel"), cpus, policies=None)]


def draw_set(rng: random.Random, cpus: int, index: int) -> list[SimJob]:
    """1 to 3 jobs per CPU, parallelism 1 or 2, deadlines 12 to 36 s; at a steady pace they
    need 60-95% of the CPUs, or (one set in four) 105-130%: some of those only EDF meets,
    some no schedule can."""
    over = rng.random() < 0.25
    load = rng.uniform(1.05, 1.3) if over else rng.uniform(0.6, 0.95)
    while True:
        k = rng.choice([1, 2, 3]) * cpus
        p = [rng.choice([1, 2]) for _ in range(k)]
        d = [rng.uniform(12, 36) for _ in range(k)]
        raw = [rng.uniform(0.15, 1.0) * pi for pi in p]
        scale = load * cpus / sum(raw)
        rates = [r * scale for r in raw]
        if all(r <= pi * 0.85 for r, pi in zip(rates, p, strict=True)):
            break
    return [
        SimJob(f"s{index}-j{i}", round(r * di, 1), round(di, 1), pi, tenant=rng.choice("ab"))
        for i, (r, di, pi) in enumerate(zip(rates, d, p, strict=True))
    ]


def overloaded(jobs: list[SimJob], factor: float, cpus: int) -> list[SimJob]:
    while True:
        more = [replace(j, work=round(j.work * factor, 1)) for j in jobs]
        if misses(more, predicted(more, cpus)["deadline"]) > 0:
            return more
        factor *= 1.15


class Daemon:
    """`nodeagent run` for one way, its log in the state directory."""

    def __init__(self, state: str, way: str) -> None:
        config = Path(state, f"{way}.yaml")
        config.write_text(yaml.safe_dump(policy(state, way)))
        self.sock = f"{state}/api.sock"
        self.log = Path(state, f"agent-{way}.log")
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nodeagent", "run", "--config", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_for_api(self.sock, self.proc, self.log)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def busy_cores(seconds: float) -> float:
    """The node's busy CPUs, on average over `seconds`: what the agent and the rest of the
    node take before any job runs (the overhead the predictions subtract)."""
    before = psutil.cpu_times()
    time.sleep(seconds)
    after = psutil.cpu_times()
    idle = (after.idle + after.iowait) - (before.idle + before.iowait)
    total = sum(after) - sum(before)
    return (1 - idle / total) * (os.cpu_count() or 1) if total > 0 else 0.0


def start(sock: str, job: SimJob, t0: float) -> int:
    """The job's process, started as `nodeagent exec` starts one: it waits on a pipe until
    the daemon has put it in its cgroup under its deadline, then execs the burner."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(write_end)
        go = os.read(read_end, 1)
        if go != b"1":
            os._exit(125)
        argv = [sys.executable, "-S", BURN, str(job.work), str(job.parallelism)]
        os.execv(sys.executable, argv)  # noqa: S606 - the burner, by its full path
    os.close(read_end)
    body = {
        "name": job.name,
        "tenant": job.tenant,
        "class": str(job.workload_class),
        "deadline": t0 + job.deadline,
        "work": job.work,
        "pid": pid,
    }
    try:
        client.post(sock, "/v1/jobs", body)
    except NodeagentError:
        os.close(write_end)
        os.waitpid(pid, 0)
        raise
    os.write(write_end, b"1")
    os.close(write_end)
    return pid


def idle(daemon: Daemon) -> None:
    """Wait until the daemon has let the set's jobs go: their names come free again, and their
    cgroups are gone before the next way's daemon (with a state file of its own) is started."""
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up:
        listed = client.get(daemon.sock, "/v1/jobs")
        if isinstance(listed, dict) and not listed.get("jobs"):
            return
        time.sleep(0.5)
    raise SystemExit("the last set's jobs are still listed after 60 s")


def run_set(daemon: Daemon, jobs: list[SimJob]) -> dict[str, Any]:
    """Start every job at one instant (deadlines counted from it), wait for all to exit and
    for the daemon to remove their cgroups."""
    t0 = time.time() + 0.5
    pids = {j.name: start(daemon.sock, j, t0) for j in jobs}
    ends: dict[str, float] = {}
    codes: dict[str, int] = {}

    def wait(name: str, pid: int) -> None:
        _, status = os.waitpid(pid, 0)
        ends[name] = time.time()
        codes[name] = os.waitstatus_to_exitcode(status)

    waiters = [threading.Thread(target=wait, args=item) for item in pids.items()]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join()
    idle(daemon)
    rows: list[dict[str, Any]] = []
    for j in jobs:
        took = ends[j.name] - t0
        rows.append(
            {
                "job": j.name,
                "work_cpu_s": j.work,
                "parallelism": j.parallelism,
                "deadline_s": j.deadline,
                "exit": codes[j.name],
                "required_cores": j.work / j.deadline,
                "got_cores": j.work / took,
                "finish_s": took,
                "late_s": took - j.deadline,
                "missed": took > j.deadline,
            }
        )
    return {
        "misses": sum(r["missed"] for r in rows),
        "tardiness_s": sum(max(0.0, r["late_s"]) for r in rows),
        "jobs": rows,
    }


def report(bench: Bench, name: str, scenario: dict[str, Any]) -> None:
    jobs = scenario["jobs"]
    bench.say()
    bench.say(
        f"{name}: "
        + ", ".join(
            f"{j['name']} {j['work']:g} CPU-s by {j['deadline']:g} s on {j['parallelism']}"
            f" thread(s)"
            for j in jobs
        )
    )
    bench.say(
        f"  {scenario['load']:.0%} of the CPUs at a steady pace;"
        f" {'feasible' if scenario['feasible'] else 'infeasible'} (offline optimum"
        f" {scenario['optimum']} miss(es)); predicted misses: "
        + ", ".join(f"{w} {n}" for w, n in scenario["predicted_misses"].items())
    )
    bench.say(
        f"  {'way':<11} {'misses':>6} {'tardiness':>10}   per job: needed -> got cores,"
        " late, finish measured / predicted"
    )
    for way, r in scenario["ways"].items():
        per = "; ".join(
            f"{x['job']} {x['required_cores']:.2f}->{x['got_cores']:.2f} {x['late_s']:+.1f}s"
            f" {x['finish_s']:.1f}/{_s(x['predicted_finish_s'])}"
            for x in r["jobs"]
        )
        bench.say(f"  {way:<11} {r['misses']:>6} {r['tardiness_s']:>9.1f}s   {per}")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    with Bench("deadline", __doc__, options) as bench:
        args = bench.args
        cpus = os.cpu_count() or 1
        rng = random.Random(args.seed or 0)  # noqa: S311 - a reproducible draw
        if args.sets:
            sets = {f"set {i + 1}": draw_set(rng, cpus, i + 1) for i in range(args.sets)}
        else:
            first = (
                DEFAULT_SET if args.seed is None and args.jobs == 3 else draw(rng, args.jobs, cpus)
            )
            sets = {"feasible": first, "infeasible": overloaded(first, args.overload, cpus)}
        scenarios: dict[str, dict[str, Any]] = {}
        with tempfile.TemporaryDirectory() as state:
            for way in WAYS:
                daemon = Daemon(state, way)
                try:
                    overhead = busy_cores(5.0)
                    bench.progress(f"{way}: daemon up, {overhead:.2f} cores busy before any job")
                    for name, jobs in sets.items():
                        bench.progress(f"{way}: {name}")
                        s = scenarios.setdefault(name, {"ways": {}, "overhead": {}})
                        s["overhead"][way] = overhead
                        s["ways"][way] = run_set(daemon, jobs)
                finally:
                    daemon.stop()
        for name, jobs in sets.items():
            s = scenarios[name]
            overhead = max(s["overhead"].values())
            guess = predicted(jobs, cpus, overhead)
            s |= {
                "jobs": [asdict(j) | {"workload_class": str(j.workload_class)} for j in jobs],
                "load": sum(j.work / j.deadline for j in jobs) / cpus,
                "feasible": feasible(demands(jobs), cpus),
                "optimum": optimum(jobs, cpus),
                "predicted_misses": {w: misses(jobs, guess[w]) for w in WAYS},
            }
            for way, r in s["ways"].items():
                for row, finish in zip(r["jobs"], guess[way], strict=True):
                    row["predicted_finish_s"] = finish
            report(bench, name, s)
        bench.figures["scenarios"] = scenarios
        bench.say()
        if args.sets:
            summary(bench, scenarios)
        else:
            f, i = scenarios["feasible"], scenarios["infeasible"]
            bench.say(
                f"goals: feasible with the agent {f['ways']['deadline']['misses']} misses"
                " (goal 0); infeasible with the agent"
                f" {i['ways']['deadline']['misses']} misses against"
                f" {i['predicted_misses']['deadline']} predicted (goal: no more), tardiness"
                + ", ".join(f" {w} {r['tardiness_s']:.1f}s" for w, r in i["ways"].items())
                + " (goal: the least with the agent)"
            )
        json.dumps(bench.figures)  # the figures must serialise


def summary(bench: Bench, scenarios: dict[str, dict[str, Any]]) -> None:
    rows = list(scenarios.values())
    over = [n for n, s in scenarios.items() if s["ways"]["deadline"]["misses"] > s["optimum"]]
    feasible_missed = [
        n for n, s in scenarios.items() if s["feasible"] and s["ways"]["deadline"]["misses"]
    ]
    total = {w: sum(s["ways"][w]["tardiness_s"] for s in rows) for w in WAYS}
    exact = sum(s["ways"]["deadline"]["misses"] == s["predicted_misses"]["deadline"] for s in rows)
    bench.figures["summary"] = {
        "sets": len(rows),
        "feasible_sets": sum(s["feasible"] for s in rows),
        "sets_with_more_misses_than_the_optimum": over,
        "feasible_sets_with_a_miss": feasible_missed,
        "tardiness_s": total,
        "misses": {w: sum(s["ways"][w]["misses"] for s in rows) for w in WAYS},
        "optimum_misses": sum(s["optimum"] for s in rows),
        "sets_where_predicted_misses_match": exact,
    }
    bench.say(
        f"{len(rows)} sets ({sum(s['feasible'] for s in rows)} feasible): misses "
        + ", ".join(f"{w} {n}" for w, n in bench.figures["summary"]["misses"].items())
        + f", offline optimum {bench.figures['summary']['optimum_misses']}"
    )
    bench.say("total tardiness: " + ", ".join(f"{w} {t:.1f}s" for w, t in total.items()))
    bench.say(
        f"goals: sets where the policy missed more than the optimum: {over or 'none'};"
        f" feasible sets with a miss: {feasible_missed or 'none'};"
        f" predicted misses matched on {exact} of {len(rows)} sets"
    )


if __name__ == "__main__":
    main()
