"""Benchmark of the local API under a burst, run by `scripts/bench api` as root on cgroup v2.

Starts the daemon (`python -m nodeagent run`) on a managed root holding a few workload
cgroups, then releases N `nodeagent allocations` calls at once, for R rounds, two ways:
N threads of one process (released by a barrier), then N processes (started, imported and
released together through a pipe). A call is what the command runs past argument parsing:
the client's GET, then the table. Threads make the N connect() calls coincide even in a
slow VM; processes are what a burst of real CLI calls is, and in a VM with few CPUs they
mostly measure how long N Pythons take to share them. Prints, per way, per round and
overall, how many calls succeeded out of N, their latency from release to the end of the
call (p50, p99, max), and the errors of those that failed.

It needs only `python -m nodeagent run`, nodeagent.api.client.get and
nodeagent.cli.inspection.allocations_table, so it measures older checkouts too: run it
with that checkout's Python (/path/to/checkout/.venv/bin/python scripts/bench_api.py).
The code measured is printed.

--json figures: clients, timeout_s, code (nodeagent's path), and for threads and for
processes: calls, succeeded, p50_ms, p99_ms, max_ms, errors{} over all rounds, and rounds[]
with the same per round.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import yaml
from benchkit import Bench, clear, populate, quantile

import nodeagent
from nodeagent.api import client
from nodeagent.cli.inspection import allocations_table
from nodeagent.errors import NodeagentError

ROOT = Path("/sys/fs/cgroup")
MANAGED = "nodeagent-bench-api.slice"
WORKLOADS = 20

# A process that makes one call when the gate pipe closes, and reports it as a JSON line.
CALL = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from bench_api import one_call
gate, sock, timeout = int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
print("ready", flush=True)
os.read(gate, 1)
print(json.dumps(one_call(sock, timeout)))
"""
MODES = ("threads", "processes")


def one_call(sock: str, timeout: float) -> dict[str, Any]:
    """`nodeagent allocations` past argument parsing: the client's GET, then the table."""
    start, code, error = time.perf_counter(), 0, ""
    try:
        allocations_table(
            cast(Mapping[str, Any], client.get(sock, "/v1/allocations", timeout=timeout))
        )
    except NodeagentError as e:
        code, error = 1, f"nodeagent: error: {e}"
    except Exception as e:  # what an operator would see as a traceback
        code, error = 99, f"traceback: {type(e).__name__}: {e}"
    seconds = time.perf_counter() - start
    return {"code": code, "seconds": seconds, "error": " ".join(error.split())}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=64, help="calls per burst (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="bursts (default 3)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="each call's time limit in seconds (default 5, the CLI's own); a slow VM running"
        " N calls at once may need more, to tell calls lost to the listen queue from calls"
        " that were merely slow",
    )


def start_daemon(state_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    sock = f"{state_dir}/api.sock"
    config = Path(state_dir, "policy.yaml")
    config.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "agent": {
                    "managed_root": MANAGED,
                    "state_file": f"{state_dir}/state.json",
                    "socket": sock,
                },
                "tenants": {"a": {"shares": 2}, "b": {"shares": 1}},
                "rules": [
                    {"name": "a", "match": {"name": "a-*"}, "tenant": "a"},
                    {"name": "b", "match": {"name": "b-*"}, "tenant": "b"},
                ],
            }
        )
    )
    log = open(Path(state_dir, "agent.log"), "w")  # noqa: SIM115 (the daemon keeps it)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "nodeagent", "run", "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while True:
        try:
            client.get(sock, "/v1/allocations")
            return daemon, sock
        except Exception as exc:
            if daemon.poll() is not None or time.monotonic() > deadline:
                daemon.kill()
                log_text = Path(state_dir, "agent.log").read_text()
                raise SystemExit(
                    f"the daemon did not come up (exit {daemon.poll()}, {exc}):\n{log_text}"
                ) from None
            time.sleep(0.1)


def burst_processes(n: int, sock: str, timeout: float) -> list[dict[str, Any]]:
    """n simultaneous calls, a process each; one {code, seconds, error} per call."""
    gate_r, gate_w = os.pipe()
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CALL, here, str(gate_r), sock, str(timeout)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(gate_r,),
            text=True,
        )
        for _ in range(n)
    ]
    os.close(gate_r)
    for p in procs:
        assert p.stdout is not None
        p.stdout.readline()  # "ready", or "" if it died: then its result says so
    os.close(gate_w)  # go
    results = []
    for p in procs:
        out, err = p.communicate()
        lines = out.splitlines()
        try:
            results.append(json.loads(lines[-1]))
        except (IndexError, ValueError):
            detail = " ".join(err.split())[-200:] or f"exit {p.returncode}"
            results.append({"code": 98, "seconds": 0.0, "error": f"the call died: {detail}"})
    return results


def burst_threads(n: int, sock: str, timeout: float) -> list[dict[str, Any]]:
    """n simultaneous calls, a thread each, released by a barrier."""
    barrier = threading.Barrier(n)
    results: list[dict[str, Any]] = [{} for _ in range(n)]

    def run(i: int) -> None:
        barrier.wait()
        results[i] = one_call(sock, timeout)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    took = [r["seconds"] * 1e3 for r in results]
    errors = collections.Counter(r["error"] or f"exit {r['code']}" for r in results if r["code"])
    return {
        "calls": len(results),
        "succeeded": sum(1 for r in results if r["code"] == 0),
        "p50_ms": round(quantile(took, 0.5), 1),
        "p99_ms": round(quantile(took, 0.99), 1),
        "max_ms": round(max(took), 1),
        "errors": dict(errors.most_common()),
    }


def line(label: str, s: dict[str, Any]) -> str:
    return (
        f"{label:<20} {s['succeeded']:>3}/{s['calls']:<3} succeeded"
        f"   p50 {s['p50_ms']:>7.1f} ms   p99 {s['p99_ms']:>7.1f} ms   max {s['max_ms']:>7.1f} ms"
    )


def main() -> None:
    with Bench("api", __doc__, options) as bench, tempfile.TemporaryDirectory() as state_dir:
        n, rounds, timeout = bench.args.clients, bench.args.rounds, bench.args.timeout
        code = os.path.dirname(nodeagent.__file__)
        bench.figures.update(clients=n, code=code, timeout_s=timeout)
        bench.say(f"nodeagent from {code}")
        bench.say(
            f"{n} simultaneous 'nodeagent allocations' calls, {rounds} rounds,"
            f" {timeout:g} s time limit per call"
        )
        procs = populate(ROOT / MANAGED, [f"{'ab'[i % 2]}-{i}" for i in range(WORKLOADS)])
        daemon = None
        try:
            daemon, sock = start_daemon(state_dir)
            for mode in MODES:
                burst = burst_threads if mode == "threads" else burst_processes
                every: list[dict[str, Any]] = []
                per_round = []
                for r in range(rounds):
                    results = burst(n, sock, timeout)
                    every += results
                    per_round.append(summary(results))
                    bench.say(line(f"{mode}, round {r + 1}", per_round[-1]))
                total = summary(every)
                bench.figures[mode] = {**total, "rounds": per_round}
                bench.say(line(f"{mode}, all", total))
                for error, count in total["errors"].items():
                    bench.say(f"  {count:>4} x {error}")
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait()
            clear(ROOT / MANAGED, procs)
            (ROOT / MANAGED).rmdir()


if __name__ == "__main__":
    main()
