"""Benchmark of one reconcile tick, run by `scripts/bench tick` as root on cgroup v2.

Prints, for 10, 100 and 1000 workload cgroups: the agent's steady-state tick
(sense, snapshot, policies, plan, compare; nothing left to write), spaced as the
daemon spaces them so that rolling verification and re-planning cost their share;
the floor of reading each workload's cpu.stat once (open, read, close in a tight
loop) and the tick's ratio to it; the old floor (every interface file a full read
takes); and the files the agent opened per tick. Then the latency from a new
cgroup's mkdir to the daemon's first write to it, woken by inotify (interval and
resync are an hour, so nothing else wakes it), beside 10, 100 and 1000 others.

--json figures: ticks[] (cgroups, tick_p50_ms, tick_mean_ms, cpu_stat_floor_ms,
ratio_to_cpu_stat_floor, mean_ratio_to_cpu_stat_floor, all_files_floor_ms,
files_per_tick, ticks) and latency[] (background, p50_ms, p99_ms, max_ms, samples).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from benchkit import Bench, clear, populate, quantile

from nodeagent import logs
from nodeagent.cgroupfs.tree import CgroupDir, CgroupTree
from nodeagent.daemon import Agent, open_agent
from nodeagent.policyfile.model import PolicySpec
from nodeagent.sense.cgroup_files import TICK_FILES
from nodeagent.sense.sensor import raise_fd_limit

ROOT = Path("/sys/fs/cgroup")
MANAGED = "nodeagent-bench.slice"
SIZES = (10, 100, 1000)
LATENCY_SAMPLES = 40
# The defaults: a tick a second, every workload read in full within 30 s, a re-plan every
# 10 s. Spaced as the daemon spaces them, ticks do as much verification and re-planning as
# in production (a faster spacing would not: a slow tick lets more time pass, so more is due).
SPACING, RESYNC, REPLAN = 1.0, 30.0, 10.0
REPS = 30


def policy(state_dir: str, **agent: object) -> dict[str, object]:
    return {
        "version": 1,
        "agent": {
            "managed_root": MANAGED,
            "state_file": f"{state_dir}/state.json",
            "socket": f"{state_dir}/api.sock",
            **agent,
        },
        "fair_share": {"active_threshold": 0},
        "tenants": {"a": {"shares": 2}, "b": {"shares": 1}},
        "rules": [
            {
                "name": "a",
                "match": {"name": "a-*"},
                "tenant": "a",
                "limits": {"cpu_max": 1.5, "memory_high": "1Gi"},
            },
            {
                "name": "b",
                "match": {"name": "b-*"},
                "tenant": "b",
                "limits": {"cpu_max": 0.5, "memory_max": "2Gi"},
            },
        ],
    }


def names(n: int) -> list[str]:
    """Workload names that the policy's two rules share between tenants a and b."""
    return [f"{'ab'[i % 2]}-{i}" for i in range(n)]


def raw_read(paths: list[str]) -> None:
    """The least Python can do to read a file: open, one read, close."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.read(fd, 65536)
        os.close(fd)


def floor_ms(paths: list[str], reps: int) -> float:
    """The median time to read `paths` raw, once each."""
    took = []
    for _ in range(reps):
        t0 = time.perf_counter()
        raw_read(paths)
        took.append(time.perf_counter() - t0)
    return statistics.median(took) * 1e3


class Counted:
    """Counts the interface files the agent opens, to report files per tick."""

    def __init__(self) -> None:
        self.opened = 0
        self._real = CgroupDir._open_file

    def __enter__(self) -> Counted:
        real, counted = self._real, self

        def counting(self: CgroupDir, name: str, mode: int) -> int:  # _open_file's signature
            counted.opened += 1
            return real(self, name, mode)

        CgroupDir._open_file = counting  # type: ignore[method-assign]
        return self

    def __exit__(self, *_: object) -> None:
        CgroupDir._open_file = self._real  # type: ignore[method-assign]


def steady_ticks(agent: Agent, reps: int) -> list[float]:
    """`reps` ticks, one every SPACING seconds as the daemon would run them, timed."""
    ticks = []
    for _ in range(reps):
        t0 = time.perf_counter()
        record = agent.tick()
        took = time.perf_counter() - t0
        ticks.append(took)
        assert not record.results, f"steady state wrote: {record.results[:3]}"
        time.sleep(max(0.0, SPACING - took))
    return ticks


def bench_ticks(bench: Bench, state_dir: str) -> None:
    bench.say(
        f"tick cost in steady state (nothing left to write), {REPS} ticks {SPACING:g} s apart,"
        f" resync_interval {RESYNC:g} s, replan_interval {REPLAN:g} s (the defaults)"
    )
    bench.say(
        f"{'cgroups':>8} {'tick p50':>9} {'tick mean':>10} {'cpu.stat floor':>15}"
        f" {'ratio':>6} {'all-files floor':>16} {'files/tick':>11}"
    )
    rows = bench.figures["ticks"] = []
    logs.configure("warning")  # the audit trail of the set-up ticks would drown the figures
    spec = PolicySpec.model_validate(
        policy(state_dir, interval=SPACING, resync_interval=RESYNC, replan_interval=REPLAN)
    )
    for n in SIZES:
        procs = populate(ROOT / MANAGED, names(n))
        try:
            raise_fd_limit()  # as `nodeagent run` does
            agent = open_agent(spec, CgroupTree(str(ROOT)))
            agent.prepare()
            agent.tick()  # applies everything
            time.sleep(SPACING)
            agent.tick()  # rates now known; fair share settles
            with Counted() as counted:
                ticks = steady_ticks(agent, REPS)
            workloads = [str(ROOT / w.path) for w in agent.last.snapshot.workloads]  # type: ignore[union-attr]
            reps = max(5, 2000 // n)
            cpu_stat = floor_ms([f"{w}/cpu.stat" for w in workloads], reps)
            # those a full read finds: cpuset.cpus only where the cpuset controller is on
            every = floor_ms(
                [f"{w}/{f}" for w in workloads for f in TICK_FILES if os.path.exists(f"{w}/{f}")],
                reps,
            )
            p50, mean = statistics.median(ticks) * 1e3, statistics.fmean(ticks) * 1e3
            files = counted.opened / REPS
            bench.say(
                f"{n:>8} {p50:>9.2f} {mean:>10.2f} {cpu_stat:>15.2f} {p50 / cpu_stat:>6.2f}"
                f" {every:>16.2f} {files:>11.0f}"
            )
            rows.append(
                {
                    "cgroups": n,
                    "tick_p50_ms": round(p50, 3),
                    "tick_mean_ms": round(mean, 3),
                    "cpu_stat_floor_ms": round(cpu_stat, 3),
                    "ratio_to_cpu_stat_floor": round(p50 / cpu_stat, 3),
                    "mean_ratio_to_cpu_stat_floor": round(mean / cpu_stat, 3),
                    "all_files_floor_ms": round(every, 3),
                    "files_per_tick": round(files, 1),
                    "ticks": REPS,
                }
            )
        finally:
            agent.sensor.close()
            clear(ROOT / MANAGED, procs)


def bench_latency(bench: Bench, state_dir: str, background: int) -> None:
    config = Path(state_dir, "latency.yaml")
    config.write_text(yaml.safe_dump(policy(state_dir, interval=3600, resync_interval=3600)))
    procs = populate(ROOT / MANAGED, names(background))
    log_path = Path(state_dir, "agent.log")
    with open(log_path, "w") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", "run", "--config", str(config), "--no-api"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        # the first tick has applied everything once its notes are logged: the daemon is idle
        wait_for_log(log_path, '"protection.idle"', agent)
        made: dict[str, float] = {}
        for i in range(LATENCY_SAMPLES):
            name = f"a-new-{i}"
            t = time.time()
            (ROOT / MANAGED / name).mkdir()
            made[f"/{MANAGED}/{name}/"] = t
            wait_for_log(log_path, f"/{name}/", agent)
        first: dict[str, float] = {}
        for line in log_path.read_text().splitlines():
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            if event.get("event") != "cgroup.write":
                continue
            for key, t in made.items():
                if key in event["path"] and key not in first:
                    first[key] = event["ts"] - t
        lat = sorted(first.values())
        p50, p99, top = (quantile(lat, q) * 1e3 for q in (0.5, 0.99, 1))
        bench.say(
            f"mkdir -> first write, {background} other cgroups: p50 {p50:.1f} ms, p99 {p99:.1f} ms"
            f" (n={len(lat)}, max {top:.1f} ms)"
        )
        bench.figures.setdefault("latency", []).append(
            {
                "background": background,
                "p50_ms": round(p50, 2),
                "p99_ms": round(p99, 2),
                "max_ms": round(top, 2),
                "samples": len(lat),
            }
        )
    finally:
        agent.terminate()
        agent.wait()
        clear(ROOT / MANAGED, procs)


def wait_for_log(path: Path, needle: str, agent: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while needle not in path.read_text():
        if agent.poll() is not None:
            raise SystemExit(f"the agent exited:\n{path.read_text()}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {needle!r} in the agent log")
        time.sleep(0.005)


def main() -> None:
    with Bench("tick", __doc__) as bench, tempfile.TemporaryDirectory() as state_dir:
        bench_ticks(bench, state_dir)
        bench.say()
        bench.say("latency from mkdir to the first applied write (inotify; interval, resync 1 h)")
        for background in SIZES:
            bench_latency(bench, state_dir, background)


if __name__ == "__main__":
    main()
