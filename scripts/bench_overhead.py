"""Benchmark of the daemon's idle overhead, run by `scripts/bench overhead` as root on cgroup v2.

Starts `nodeagent run` as an operator does (1 s tick, info logging, its API on) beside
200 workload cgroups, then 1000, each holding a sleeping process, and lets it settle.
Then, over --seconds (60), it prints the daemon's CPU time (user + system, from
/proc/PID/stat) as a fraction of one core, and its RSS at the end and at most (sampled
each second). Goals in the VM: <= 3% of a core and <= 60 MB RSS at 200 workloads.

Then the daemon is stopped (SIGTERM: it saves its state) and started again, as systemd
restarts it: the seconds from its exec to the end of its first tick (its `agent.ready`
line), the writes that tick made (0: the node was left converged, and
the restarted daemon finds it so), beside the seconds `python3 -c 'import
nodeagent.daemon'` takes in the same place (the median of 3), which bounds how fast any
start can be. Goal: the restart at most 2 s more than the import.

--json figures: runs[] (workloads, seconds, cpu_fraction, rss_mb_end, rss_mb_max,
failed_events: events whose name ends in "failed", which should be 0, restart_s,
restart_writes, import_s).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from benchdaemon import Agent
from benchkit import Bench, clear, populate

ROOT = Path("/sys/fs/cgroup")
MANAGED = "nodeagent-overhead.slice"
SETTLE = 15.0


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=60, help="measured time (default 60)")
    parser.add_argument(
        "--sizes", default="200,1000", help="workload counts, comma-separated (200,1000)"
    )


def policy(state_dir: str) -> dict[str, object]:
    return {
        "version": 1,
        "agent": {
            "interval": "1s",
            "managed_root": MANAGED,
            "state_file": f"{state_dir}/state.json",
            "socket": f"{state_dir}/api.sock",
        },
        "tenants": {"a": {"shares": 2}, "b": {"shares": 1}},
        "rules": [
            {"name": "a", "match": {"name": "a-*"}, "tenant": "a", "limits": {"cpu_max": 1.5}},
            {
                "name": "b",
                "match": {"name": "b-*"},
                "tenant": "b",
                "limits": {"cpu_max": 0.5, "memory_max": "2Gi"},
            },
        ],
    }


def measure(bench: Bench, n: int, seconds: float, tmp: str) -> None:
    procs = populate(ROOT / MANAGED, [f"{'ab'[i % 2]}-{i}" for i in range(n)])
    config = Path(tmp, f"policy-{n}.yaml")
    config.write_text(yaml.safe_dump(policy(tmp)))
    agent = Agent(config, Path(tmp, f"agent-{n}.log"), "--log-level", "info")
    agent.start()
    try:
        last = f"{MANAGED}/{'ab'[(n - 1) % 2]}-{n - 1}/cpu.max"
        agent.wait_for(lambda e: e.get("event") == "cgroup.write" and last in str(e.get("path")))
        bench.progress(f"{n} workloads: all limits applied; settling {SETTLE:g} s")
        time.sleep(SETTLE)
        cpu0, t0 = agent.cpu_seconds(), time.monotonic()
        rss = []
        while time.monotonic() - t0 < seconds:
            time.sleep(1)
            kb = agent.rss_kb()
            if kb is not None:
                rss.append(kb)
        cpu1, t1 = agent.cpu_seconds(), time.monotonic()
        if cpu0 is None or cpu1 is None or agent.exited() is not None:
            raise SystemExit(f"the daemon exited: status {agent.exited()}")
        fraction = (cpu1 - cpu0) / (t1 - t0)
        end, top = rss[-1] / 1024, max(rss) / 1024
        failed = [e for e in agent.since_start() if str(e.get("event")).endswith("failed")]
        agent.stop()
        restart, writes = restarted(agent)
        imported = import_seconds()
        bench.say(
            f"{n:>9} {t1 - t0:>8.0f} {fraction * 100:>10.2f}% {end:>10.1f} {top:>10.1f}"
            f" {len(failed):>13} {restart:>10.2f} {writes:>8} {imported:>8.2f}"
        )
        bench.figures["runs"].append(
            {
                "workloads": n,
                "seconds": round(t1 - t0, 1),
                "cpu_fraction": round(fraction, 4),
                "rss_mb_end": round(end, 1),
                "rss_mb_max": round(top, 1),
                "failed_events": len(failed),
                "restart_s": round(restart, 2),
                "restart_writes": writes,
                "import_s": round(imported, 2),
            }
        )
    finally:
        agent.stop()
        clear(ROOT / MANAGED, procs)


def restarted(agent: Agent) -> tuple[float, int]:
    """Start the stopped daemon again: seconds from its exec to the end of its first tick,
    and the writes made by then."""
    agent.start()
    done = agent.wait_for(lambda e: e.get("event") == "agent.ready")
    return float(str(done["ts"])) - agent.started_at, int(str(done["writes"]))


def import_seconds() -> float:
    """The median wall time of `python3 -c 'import nodeagent.daemon'`, three runs."""
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import nodeagent.daemon"], check=True)
        took.append(time.monotonic() - t0)
    return statistics.median(took)


def main() -> None:
    with Bench("overhead", __doc__, options) as bench, tempfile.TemporaryDirectory() as tmp:
        args = bench.args
        sizes = [int(s) for s in args.sizes.split(",")]
        bench.figures["runs"] = []
        bench.say("the daemon idle beside sleeping workloads: 1 s tick, info logging, API on")
        bench.say(
            f"{'workloads':>9} {'seconds':>8} {'CPU/core':>11} {'RSS MB end':>10}"
            f" {'RSS MB max':>10} {'failed events':>13} {'restart s':>10} {'writes':>8}"
            f" {'import s':>8}"
        )
        for n in sizes:
            measure(bench, n, args.seconds, tmp)


if __name__ == "__main__":
    main()
