"""Benchmark of the daemon's GPU queue, run by `scripts/bench gpu-queue` (no cgroups).

The daemon's GPU side (GpuService with its ledger, on the simulated 8x H100 node, a
labelled fake with no process on its GPUs) is called through its API routes
(nodeagent.routes.gpus), in process: one request takes all eight GPUs, then --requests
more (one GPU each, from one uid per 16 requests, so that no per-uid cap refuses them)
are asked for and wait. Then --seconds of steady state: each second every waiting
requester asks for its status once (as `exec` does) and the loop ticks once. Then the
holder's grant is cancelled and one tick serves the queue. It prints the CPU seconds
(time.process_time) of each phase. (The holder's grant lapses after gpu.claim_timeout,
30 s: where the asks take longer than that, the steady state serves the freed GPUs too.)

It runs against whatever nodeagent is importable, so the same script measures an older
tree (PYTHONPATH=/path/to/old/tree): the routes' shape is the same.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchkit import Bench

from nodeagent import logs
from nodeagent.api.peer import Peer
from nodeagent.api.server import Request
from nodeagent.commands import Commands
from nodeagent.gpu.choice import open_backend
from nodeagent.gpualloc import ledger
from nodeagent.gpualloc.service import GpuService
from nodeagent.policyfile.model import PolicySpec
from nodeagent.routes.gpus import GpuRoutes
from nodeagent.wakeup import Wakeup

NODE = Path(__file__).resolve().parents[1] / "config" / "gpus" / "dgx-h100-nvswitch.yaml"
MONOTONIC = hasattr(ledger, "HoldRecord")
"""The ledger runs on the monotonic clock (before that: Unix time)."""


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=3000, help="waiting requests (3000)")
    parser.add_argument("--seconds", type=int, default=10, help="seconds of polling (10)")


def now() -> float:
    return time.monotonic() if MONOTONIC else time.time()


def call(routes: Any, method: str, path: str, uid: int, **given: Any) -> Any:
    peer = Peer(pid=1, uid=uid, gid=uid, groups=frozenset())
    query = given.pop("query", {})
    got = routes[path][method](Request(method, path, query, peer, given))
    # the routes answer with models now (api.answers); an older tree's, with dicts
    return got.model_dump() if hasattr(got, "model_dump") else got


def main() -> None:
    with Bench("gpu-queue", __doc__, options) as bench:
        logs.configure("warning")  # each grant and lapse is an audit line: not the figures
        n, seconds = bench.args.requests, bench.args.seconds
        spec = PolicySpec.model_validate(
            {"version": 1, "tenants": {"a": {"shares": 1}}, "jobs": {"default_tenant": "a"}}
        )
        service = GpuService(open_backend(str(NODE)), lambda: spec, lambda c: True)
        service.sense(now())
        routes = Commands(Wakeup()).serve(
            GpuRoutes(service, lambda: spec, lambda t: 0.0).routes(), then=service.publish
        )  # as the daemon serves them: a new view after each change
        holder = call(routes, "POST", "/v1/gpus/requests", 0, name="holder", count=8)
        assert holder["status"] == "granted", holder
        clock = "monotonic" if MONOTONIC else "wall"
        bench.say(f"nodeagent's GPU queue, {n} waiting requests ({clock} clock)")

        started = time.process_time()
        ids = []
        for i in range(n):
            got = call(routes, "POST", "/v1/gpus/requests", 1000 + i // 16, name=f"w{i}")
            assert got["status"] == "waiting", got
            ids.append((1000 + i // 16, got["id"]))
        asked = time.process_time() - started
        bench.say(f"{n} asks: {asked:.2f} s CPU ({asked / n * 1e3:.3f} ms each)")

        started = time.process_time()
        for _ in range(seconds):
            for uid, rid in ids:
                call(routes, "GET", "/v1/gpus/requests", uid, query={"id": rid})
            service.sense(now())
        steady = time.process_time() - started
        bench.say(
            f"{seconds} s of steady state ({n} status calls and one tick a second):"
            f" {steady:.2f} s CPU ({steady / seconds:.3f} s CPU per second)"
        )

        started = time.process_time()
        call(routes, "DELETE", "/v1/gpus/requests", 0, id=holder["id"])
        service.sense(now())
        served = time.process_time() - started
        granted = sum(1 for h in service.ledger.holds() if str(h.kind) == "request")
        bench.say(f"release 8 GPUs and serve the queue: {served:.3f} s CPU ({granted} granted)")
        bench.figures.update(
            requests=n,
            asks_cpu_s=round(asked, 3),
            steady_cpu_s_per_s=round(steady / seconds, 4),
            serve_after_release_cpu_s=round(served, 4),
            granted_after_release=granted,
        )


if __name__ == "__main__":
    main()
