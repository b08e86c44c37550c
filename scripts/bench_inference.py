"""Inference first, on a real kernel: a latency probe in an `inference` cgroup beside busy
training jobs, without the agent and with it.

The probe (scripts/probe) does a fixed small unit of work (calibrated to --unit-ms on the
idle node), sleeps 20 ms and repeats, recording each unit's wall time: the time a
request would take with the CPU the probe gets. Beside it, --trainers training jobs each
burn a CPU without end. Both are started through `nodeagent exec` (classes inference and
training). It prints the probe's p50 and p99 without the agent (the kernel's default:
the daemon only starts the jobs, every control off) and with it (the shipped defaults:
inference protected against CPU pressure, 20% of the CPUs reserved for it), and the
training throughput lost (CPU-seconds the trainers got, with against without).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from benchkit import Bench, wait_for_api

from nodeagent.api import client

MANAGED = "nodeagent-bench.slice"
HERE = Path(__file__).parent
WAYS: dict[str, dict[str, Any]] = {
    "without agent": {
        "fair_share": {"enabled": False},
        "deadlines": {"enabled": False},
        "protection": {"enabled": False},
    },
    "with agent": {"classes": {"inference": {"reserved_cpu": "20%"}}},
}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=40, help="measured window per way")
    p.add_argument("--trainers", type=int, default=4, help="busy training jobs (default 4)")
    p.add_argument("--unit-ms", type=float, default=5, help="probe work unit on an idle CPU")


def policy(state: str, way: str) -> dict[str, Any]:
    return {
        "version": 1,
        "agent": {
            "managed_root": MANAGED,
            "interval": 1,
            "state_file": f"{state}/state.json",
            "socket": f"{state}/api.sock",
        },
        "tenants": {"serving": {"shares": 1}, "research": {"shares": 1}},
        "jobs": {"default_tenant": "research"},
        **WAYS[way],
    }


def usage(cgroup: Path) -> float:
    for line in (cgroup / "cpu.stat").read_text().splitlines():
        key, value = line.split()
        if key == "usage_usec":
            return int(value) / 1e6
    return 0.0


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_way(way: str, state: str, args: argparse.Namespace, units: int) -> dict[str, Any]:
    config = Path(state, "policy.yaml")
    config.write_text(yaml.safe_dump(policy(state, way)))
    sock, log = f"{state}/api.sock", Path(state, f"agent-{way.replace(' ', '-')}.log")
    with open(log, "w") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", "run", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    jobs: list[subprocess.Popen[bytes]] = []
    try:
        wait_for_api(sock, agent, log)
        exec_ = ["nodeagent", "exec", "--socket", sock]
        burn = [sys.executable, "-S", str(HERE / "burn"), "1e9"]
        for i in range(args.trainers):
            name = ["--name", f"train-{i}", "--class", "training"]
            jobs.append(subprocess.Popen([*exec_, *name, "--", *burn]))
        trainers = [Path("/sys/fs/cgroup", MANAGED, f"train-{i}") for i in range(args.trainers)]
        deadline = time.monotonic() + 120
        while not all(
            (t / "cgroup.procs").exists() and (t / "cgroup.procs").read_text() for t in trainers
        ):
            if time.monotonic() > deadline:
                raise SystemExit("the training jobs did not start")
            time.sleep(0.1)
        time.sleep(3)  # the agent sees them busy
        samples = Path(state, "probe.txt")
        before = sum(usage(t) for t in trainers)
        started = time.monotonic()
        as_inference = ["--name", "probe", "--tenant", "serving", "--class", "inference"]
        probe = [sys.executable, "-S", str(HERE / "probe"), str(units), str(args.seconds)]
        subprocess.run([*exec_, *as_inference, "--", *probe, str(samples)], check=True)
        elapsed = time.monotonic() - started
        trained = sum(usage(t) for t in trainers) - before
        allocations = client.get(sock, "/v1/allocations")
    finally:
        for j in jobs:
            j.send_signal(signal.SIGTERM)
        for j in jobs:
            j.wait(timeout=60)
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
    times = [float(x) for x in samples.read_text().split()]
    notes = allocations.get("node_notes", []) if isinstance(allocations, dict) else []
    return {
        "probe_units": len(times),
        "p50_ms": statistics.median(times) * 1e3,
        "p99_ms": quantile(times, 0.99) * 1e3,
        "max_ms": max(times) * 1e3,
        "training_cpu_s": trained,
        "training_cores": trained / elapsed,
        "window_s": elapsed,
        "protection": [n.get("status") for n in notes if n.get("kind") == "protection"],
    }


def main() -> None:
    with Bench("inference", __doc__, options) as bench:
        args = bench.args
        calibrate = [sys.executable, "-S", str(HERE / "probe"), "--calibrate", str(args.unit_ms)]
        units = int(subprocess.run(calibrate, check=True, capture_output=True, text=True).stdout)
        bench.figures["probe_units_per_request"] = units
        bench.say(
            f"probe: {units} loop iterations per request (~{args.unit_ms:g} ms idle),"
            f" every 20 ms for {args.seconds:g} s, beside {args.trainers} busy trainers"
        )
        results = {}
        with tempfile.TemporaryDirectory() as state:
            for way in WAYS:
                results[way] = run_way(way, state, args, units)
        bench.figures["ways"] = results
        bench.say(f"{'':<14} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'training cores':>15}")
        for way, r in results.items():
            bench.say(f"{way:<14} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['max_ms']:>8.1f}"
                      f" {r['training_cores']:>15.2f}")  # fmt: skip
        lost = (
            1 - results["with agent"]["training_cores"] / results["without agent"]["training_cores"]
        )
        bench.figures["training_throughput_lost"] = lost
        bench.say(f"training throughput lost with the agent: {lost:.1%}")
        json.dumps(bench.figures)


if __name__ == "__main__":
    main()
