"""Benchmark of one reconcile tick, run by `scripts/bench tick` as root on cgroup v2.

Prints, for 10, 100 and 1000 workload cgroups: the agent's steady-state tick
(sense, snapshot, policies, plan, compare; nothing left to write), the raw
cost of reading the same interface files in a tight loop, and their ratio.
Then the latency from a new cgroup's mkdir to the daemon's first write to it,
woken by inotify (interval and resync are an hour, so nothing else wakes it).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import yaml

from nodeagent import logs
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import Agent
from nodeagent.sense.cgroup_files import TICK_FILES
from nodeagent.spec.model import PolicySpec

ROOT = Path("/sys/fs/cgroup")
MANAGED = "nodeagent-bench.slice"
SIZES = (10, 100, 1000)
LATENCY_SAMPLES = 40
OUT: list[Path] = []


def say(line: str = "") -> None:
    """Print a figure, and append it to the output file at once: a crash keeps what was found."""
    print(line, flush=True)
    for path in OUT:
        with open(path, "a") as f:
            f.write(line + "\n")


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


def populate(n: int) -> list[subprocess.Popen[bytes]]:
    """n workload cgroups, each with one sleeping process so that it counts as active."""
    procs = []
    (ROOT / MANAGED).mkdir(exist_ok=True)
    for i in range(n):
        d = ROOT / MANAGED / f"{'ab'[i % 2]}-{i}"
        d.mkdir()
        enter = 'echo $$ > "$0/cgroup.procs" && exec sleep 3600'
        procs.append(subprocess.Popen(["sh", "-c", enter, str(d)]))
    for p, i in zip(procs, range(n), strict=True):
        d = ROOT / MANAGED / f"{'ab'[i % 2]}-{i}"
        while str(p.pid) not in (d / "cgroup.procs").read_text().split():
            time.sleep(0.01)
    return procs


def clear(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()
    base = ROOT / MANAGED
    for d in sorted(base.iterdir()) if base.exists() else []:
        if d.is_dir():
            while True:
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)


def raw_read(paths: list[str]) -> None:
    """The least Python can do to read a file: open, one read, close."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.read(fd, 65536)
        os.close(fd)


def bench_ticks(state_dir: str) -> None:
    say("tick cost (steady state: policies run, nothing left to write)")
    say(f"{'cgroups':>8} {'tick ms':>9} {'raw read ms':>12} {'ratio':>6} {'files/tick':>11}")
    logs.configure("warning")  # the audit trail of the set-up ticks would drown the figures
    spec = PolicySpec.model_validate(policy(state_dir))
    for n in SIZES:
        procs = populate(n)
        try:
            agent = Agent(spec, CgroupTree(str(ROOT)))
            agent.prepare()
            agent.tick()  # applies everything
            agent.tick()  # rates now known; fair share settles
            reps = max(5, 2000 // n)
            ticks = []
            for _ in range(reps):
                t0 = time.perf_counter()
                record = agent.tick()
                ticks.append(time.perf_counter() - t0)
                assert not record.results, f"steady state wrote: {record.results[:3]}"
            files = [
                str(ROOT / w.path / name) for w in record.snapshot.workloads for name in TICK_FILES
            ]
            raws = []
            for _ in range(reps):
                t0 = time.perf_counter()
                raw_read(files)
                raws.append(time.perf_counter() - t0)
            tick_ms, raw_ms = statistics.median(ticks) * 1e3, statistics.median(raws) * 1e3
            say(f"{n:>8} {tick_ms:>9.2f} {raw_ms:>12.2f} {tick_ms / raw_ms:>6.2f} {len(files):>11}")
        finally:
            clear(procs)


def bench_latency(state_dir: str, background: int) -> None:
    config = Path(state_dir, "latency.yaml")
    config.write_text(yaml.safe_dump(policy(state_dir, interval=3600, resync_interval=3600)))
    procs = populate(background)
    log_path = Path(state_dir, "agent.log")
    with open(log_path, "w") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", "run", "--config", str(config), "--no-api"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_log(log_path, '"cpu.weight"', agent)
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
        p50 = statistics.median(lat) * 1e3
        p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))] * 1e3
        say(
            f"mkdir -> first write, {background} other cgroups: p50 {p50:.1f} ms, p99 {p99:.1f} ms"
            f" (n={len(lat)}, max {lat[-1] * 1e3:.1f} ms)"
        )
    finally:
        agent.terminate()
        agent.wait()
        clear(procs)


def wait_for_log(path: Path, needle: str, agent: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while needle not in path.read_text():
        if agent.poll() is not None:
            raise SystemExit(f"the agent exited:\n{path.read_text()}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {needle!r} in the agent log")
        time.sleep(0.005)


def main() -> None:
    if len(sys.argv) > 1:
        OUT.append(Path(sys.argv[1]))
        OUT[0].write_text("")
    say(f"kernel {os.uname().release}, {os.cpu_count()} CPUs")
    try:
        with tempfile.TemporaryDirectory() as state_dir:
            bench_ticks(state_dir)
            say()
            say("latency from mkdir to the first applied write (inotify; interval and resync 1 h)")
            for background in (10, 100):
                bench_latency(state_dir, background)
    except BaseException:
        say(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
