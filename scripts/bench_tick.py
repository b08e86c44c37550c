"""Benchmark of one reconcile tick, run by `scripts/bench tick` as root on cgroup v2.

Prints, for 10, 100 and 1000 workload cgroups, each holding a sleeping process, then
each holding a busy one (`--modes`): the agent's steady-state tick (sense, snapshot,
policies, plan, compare; sleeping: nothing left to write), spaced as the daemon spaces
them so that rolling verification and re-planning cost their share, in wall time and in
the agent's CPU time; the floor of reading each workload's cpu.stat once (open, read,
close in a tight loop) and the tick's ratio to it; the floor of reading each one again
through a descriptor kept open (pread at offset 0: kernfs makes the content anew), as the
sensor now does; the old floor (every interface file a full read takes); the files the
agent opened per tick; and the share of workloads whose cpu.stat moved from one tick to
the next. Busy workloads spin in a slice of cpu.weight 1, so that they use the CPUs the
agent leaves and hardly delay its tick: every one's usage moves every tick (the moved
column says how many did). With --profile, the ticks at the largest size are run again
under cProfile: the functions that took most of them, by own time and by cumulative
time, go to the table (the first 15) and to OUT/tick-profile-MODE.txt (the first 40).
Then the latency from a new cgroup's mkdir to the daemon's first write to it, woken by
inotify (interval and resync are an hour, so nothing else wakes it), beside 10, 100 and
1000 sleeping others.

--json figures: ticks[] (mode, cgroups, tick_p50_ms, tick_mean_ms, tick_max_ms, tick_cpu_mean_ms,
cpu_stat_floor_ms, ratio_to_cpu_stat_floor, mean_ratio_to_cpu_stat_floor,
kept_cpu_stat_floor_ms, all_files_floor_ms, files_per_tick, writes_per_tick,
moved_share, ticks), profile[] (mode, cgroups, ticks, functions[]: name, calls,
own_ms_per_tick, cumulative_ms_per_tick) and latency[] (background, p50_ms, p99_ms,
max_ms, samples).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
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


def kept_floor_ms(paths: list[str], reps: int) -> float:
    """The median time to read `paths` again through descriptors kept open: one pread at
    offset 0 each, the least a sensor that keeps them open can do."""
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        took = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for fd in fds:
                os.pread(fd, 65536, 0)
            took.append(time.perf_counter() - t0)
    finally:
        for fd in fds:
            os.close(fd)
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


@dataclass
class Ticks:
    """Steady ticks, timed: wall and CPU seconds each, writes, and workloads whose usage
    moved since the tick before."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    writes: int = 0
    moved: list[float] = field(default_factory=list)


def steady_ticks(agent: Agent, reps: int, busy: bool) -> Ticks:
    """`reps` ticks, one every SPACING seconds as the daemon would run them, timed. Asleep,
    the workloads leave nothing to write; busy, fair share may move a weight now and then."""
    out = Ticks()
    last: dict[str, int | None] = {}
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        record = agent.tick()
        took, cpu = time.perf_counter() - t0, time.thread_time() - c0
        out.wall.append(took)
        out.cpu.append(cpu)
        out.writes += len(record.results)
        assert busy or not record.results, f"steady state wrote: {record.results[:3]}"
        now = {w.path: w.sample.cpu_usage_us for w in record.snapshot.workloads}
        if last:
            out.moved.append(sum(now[p] != last.get(p) for p in now) / max(1, len(now)))
        last = now
        time.sleep(max(0.0, SPACING - took))
    return out


def profiled(bench: Bench, agent: Agent, mode: str, n: int) -> None:
    """REPS more ticks under cProfile; the functions that took most of them."""
    profile = cProfile.Profile()
    for _ in range(REPS):
        profile.enable()
        agent.tick()
        profile.disable()
        time.sleep(SPACING)
    stats = pstats.Stats(profile)
    rows = []
    for (file, line, func), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        name = f"{Path(file).name}:{line}({func})" if line else func
        rows.append((own, cumulative, calls, name))
    total = sum(r[0] for r in rows)
    bench.say(
        f"profile: {REPS} ticks at {n} {mode} workloads, {total / REPS * 1e3:.1f} ms a tick"
        " profiled (cProfile slows Python, not the kernel); by own time:"
    )
    functions = []
    for key, title in ((0, "own"), (1, "cumulative")):
        top = sorted(rows, key=lambda r: r[key], reverse=True)[:40]
        lines = [
            f"{own / REPS * 1e3:9.3f} {cum / REPS * 1e3:9.3f} {calls / REPS:9.1f}  {name}"
            for own, cum, calls, name in top
        ]
        head = f"{'own ms':>9} {'cum ms':>9} {'calls':>9}  function (per tick, by {title} time)"
        if key == 0:
            for text in [head, *lines[:15]]:
                bench.say(f"  {text}")
            functions = [
                {
                    "name": name,
                    "calls": round(calls / REPS, 1),
                    "own_ms_per_tick": round(own / REPS * 1e3, 3),
                    "cumulative_ms_per_tick": round(cum / REPS * 1e3, 3),
                }
                for own, cum, calls, name in top
            ]
        if bench.args.out:
            with open(Path(bench.args.out, f"tick-profile-{mode}.txt"), "a" if key else "w") as f:
                f.write("\n".join([head, *lines]) + "\n\n")
    bench.figures.setdefault("profile", []).append(
        {"mode": mode, "cgroups": n, "ticks": REPS, "functions": functions}
    )


def bench_ticks(bench: Bench, state_dir: str, mode: str, sizes: list[int]) -> None:
    busy = mode == "busy"
    bench.say(
        f"tick cost in steady state, {mode} workloads, {REPS} ticks {SPACING:g} s apart,"
        f" resync_interval {RESYNC:g} s, replan_interval {REPLAN:g} s (the defaults)"
    )
    bench.say(
        f"{'cgroups':>8} {'tick p50':>9} {'tick mean':>10} {'tick max':>9} {'cpu mean':>9}"
        f" {'cpu.stat floor':>15} {'p50/floor':>10} {'mean/floor':>11} {'kept floor':>11}"
        f" {'all-files floor':>16} {'files/tick':>11} {'writes/tick':>12} {'moved':>6}"
    )
    rows = bench.figures.setdefault("ticks", [])
    logs.configure("warning")  # the audit trail of the set-up ticks would drown the figures
    spec = PolicySpec.model_validate(
        policy(state_dir, interval=SPACING, resync_interval=RESYNC, replan_interval=REPLAN)
    )
    for n in sizes:
        procs = populate(ROOT / MANAGED, names(n), busy=busy)
        try:
            raise_fd_limit()  # as `nodeagent run` does
            agent = open_agent(spec, CgroupTree(str(ROOT)))
            agent.prepare()
            agent.tick()  # applies everything
            time.sleep(SPACING)
            agent.tick()  # rates now known; fair share settles
            with Counted() as counted:
                ticks = steady_ticks(agent, REPS, busy)
            workloads = [str(ROOT / w.path) for w in agent.rec.last.snapshot.workloads]  # type: ignore[union-attr]
            reps = max(5, 2000 // n)
            stats = [f"{w}/cpu.stat" for w in workloads]
            cpu_stat, kept = floor_ms(stats, reps), kept_floor_ms(stats, reps)
            # those a full read finds: cpuset.cpus only where the cpuset controller is on
            every = floor_ms(
                [f"{w}/{f}" for w in workloads for f in TICK_FILES if os.path.exists(f"{w}/{f}")],
                reps,
            )
            p50, mean = statistics.median(ticks.wall) * 1e3, statistics.fmean(ticks.wall) * 1e3
            top = max(ticks.wall) * 1e3
            cpu = statistics.fmean(ticks.cpu) * 1e3
            files, writes = counted.opened / REPS, ticks.writes / REPS
            moved = statistics.fmean(ticks.moved) if ticks.moved else 0.0
            bench.say(
                f"{n:>8} {p50:>9.2f} {mean:>10.2f} {top:>9.2f} {cpu:>9.2f} {cpu_stat:>15.2f}"
                f" {p50 / cpu_stat:>10.2f} {mean / cpu_stat:>11.2f} {kept:>11.2f} {every:>16.2f}"
                f" {files:>11.0f} {writes:>12.1f} {moved:>6.0%}"
            )
            rows.append(
                {
                    "mode": mode,
                    "cgroups": n,
                    "tick_p50_ms": round(p50, 3),
                    "tick_mean_ms": round(mean, 3),
                    "tick_max_ms": round(top, 3),
                    "tick_cpu_mean_ms": round(cpu, 3),
                    "cpu_stat_floor_ms": round(cpu_stat, 3),
                    "ratio_to_cpu_stat_floor": round(p50 / cpu_stat, 3),
                    "mean_ratio_to_cpu_stat_floor": round(mean / cpu_stat, 3),
                    "kept_cpu_stat_floor_ms": round(kept, 3),
                    "all_files_floor_ms": round(every, 3),
                    "files_per_tick": round(files, 1),
                    "writes_per_tick": round(writes, 2),
                    "moved_share": round(moved, 3),
                    "ticks": REPS,
                }
            )
            if bench.args.profile and n == max(sizes):
                profiled(bench, agent, mode, n)
        finally:
            agent.rec.sensor.close()
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


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--modes", default="sleeping,busy", help="workloads asleep, busy, or both (sleeping,busy)"
    )
    parser.add_argument(
        "--sizes", default="10,100,1000", help="workload counts, comma-separated (10,100,1000)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile the ticks at the largest size, by function"
    )
    parser.add_argument(
        "--no-latency", action="store_true", help="leave out the mkdir -> first write latency"
    )


def main() -> None:
    with Bench("tick", __doc__, options) as bench, tempfile.TemporaryDirectory() as state_dir:
        args = bench.args
        sizes = [int(n) for n in args.sizes.split(",")]
        for mode in args.modes.split(","):
            if mode not in ("sleeping", "busy"):
                raise SystemExit(f"--modes: {mode!r} is neither sleeping nor busy")
            bench_ticks(bench, state_dir, mode, sizes)
            bench.say()
        if args.no_latency:
            return
        bench.say("latency from mkdir to the first applied write (inotify; interval, resync 1 h)")
        for background in sizes:
            bench_latency(bench, state_dir, background)


if __name__ == "__main__":
    main()
