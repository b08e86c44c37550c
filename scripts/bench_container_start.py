"""container-start: a real `docker run` (and `podman run`), from its container's cgroup being
made to the daemon's first write to it (cpu.max), p50/p99/max, with and without the runtime
metadata lookup.

In the VM: Debian's containerd, dockerd and podman (its API service) under the cgroupfs driver
(as the kernel tests start them, tests/kernel/runtimes.py), and `nodeagent run` with a 1 h tick
and resync, so that only the fast path (inotify) acts. For --runs containers per case, started
one after another with `docker run -d` (`podman run -d`), the time from the cgroup's creation
(this script's own inotify watch on docker/ or libpod_parent/, woken as the daemon's is) to the
daemon's audit event for its cpu.max:

  no lookup     the rule matches `runtime: docker`, and agent.runtimes.docker is null: the
                daemon never asks dockerd
  lookup        the rule matches `labels: {bench: start}`: the fast path asks dockerd for the
                container's labels first (its container list, filtered to the id), then writes
  podman lookup the same rule on a `podman run`: podman holds a container while it starts it,
                so its answer comes when the start is over (the container is asked again then)
  mkdir only    a bare mkdir in the managed root, no runtime: the figure of `bench tick`

The runtime's own start (runc create, the image) is not counted: the clock starts when the
cgroup exists. The issue's goal for `lookup` is p99 <= 100 ms in the VM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from benchkit import Bench, quantile
from inotify_simple import INotify, flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernel"))
import runtimes as rt
from conftest import CGROUP_ROOT

MANAGED = "nodeagent-bench.slice"
CPU_MAX = "50000 100000"


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=20, help="containers per case (20)")


class Births:
    """When each new child of a cgroup directory appeared, by this process's own inotify."""

    def __init__(self, parent: Path) -> None:
        parent.mkdir(exist_ok=True)
        self.inotify = INotify()
        self.inotify.add_watch(str(parent), flags.CREATE | flags.ONLYDIR)
        self.seen: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.is_set():
            for event in self.inotify.read(timeout=100):
                self.seen.setdefault(event.name, time.time())

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.inotify.close()


def policy(
    state: Path, match: Mapping[str, object], sockets: Mapping[str, str | None]
) -> dict[str, object]:
    return {
        "version": 1,
        "agent": {
            "interval": 3600, "resync_interval": 3600, "managed_root": MANAGED,
            "state_file": str(state / "state.json"), "socket": str(state / "api.sock"),
            "runtimes": {"docker": None, "podman": None, **sockets},
        },
        "tenants": {"bench": {"shares": 1}},
        "rules": [{"name": "bench", "match": match, "tenant": "bench",
                   "limits": {"cpu_max": 0.5}}],
    }  # fmt: skip


def logged(log: Path) -> list[dict[str, Any]]:
    """The daemon's JSON log lines, as events."""
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def writes(log: Path) -> dict[str, float]:
    """The first cpu.max write to each cgroup, from the daemon's JSON log."""
    first: dict[str, float] = {}
    for event in logged(log):
        if event.get("event") == "cgroup.write" and event.get("attribute") == "cpu.max":
            first.setdefault(Path(event["path"]).parent.name, event["ts"])  # .../<leaf>/cpu.max
    return first


def runtime_said(log: Path) -> dict[str, object]:
    """What the daemon logged of the runtimes (unavailable / refused / available): how often,
    and the first reason, so that a slow case says why."""
    counts: dict[str, int] = {}
    first: str | None = None
    for event in logged(log):
        kind = str(event.get("event", ""))
        if kind.startswith("runtime."):
            counts[kind] = counts.get(kind, 0) + 1
            if first is None and kind != "runtime.available":
                first = str(event.get("error") or event.get("reason") or "")[:200]
    return {"events": counts, "first_reason": first}


def wait_log(log: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while needle not in log.read_text():
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {needle!r} in the daemon's log")
        time.sleep(0.01)


def case(
    bench: Bench, runtimes: rt.Runtimes | None, name: str, state: Path, *,
    match: Mapping[str, object], sockets: Mapping[str, str | None], runs: int,
    podman: bool = False,
) -> None:  # fmt: skip
    config = state / f"{name}.yaml"
    config.write_text(yaml.safe_dump(policy(state, match, sockets)))
    log = state / f"{name}.log"
    with log.open("wb") as out:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", "run", "--config", str(config), "--no-api"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    parent = CGROUP_ROOT / (
        MANAGED if runtimes is None else "libpod_parent" if podman else "docker"
    )
    births = Births(parent)
    made: list[str] = []
    try:
        wait_log(log, '"protection.idle"', daemon)  # the first tick is done: only inotify acts
        for i in range(runs):
            if runtimes is None:
                leaf = f"new-{i}"
                (parent / leaf).mkdir()
            else:
                tag = name.replace(" ", "-")
                run = runtimes.run_podman if podman else runtimes.run_docker
                c = run(f"bench-{tag}-{i}", "--label", "bench=start")
                leaf = c.cgroup.name
            made.append(leaf)
            deadline = time.monotonic() + 60
            while leaf not in writes(log) and time.monotonic() < deadline:
                time.sleep(0.01)
            if leaf not in writes(log):
                # the rest would wait as long: say why now, with what the daemon said
                raise SystemExit(
                    f"{name}: the daemon never wrote cpu.max to {parent / leaf} in 60 s;"
                    f" its log ends:\n{log.read_text()[-4000:]}"
                )
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        births.close()
        if runtimes is not None:
            runtimes.remove_containers()
        else:
            for leaf in made:
                (parent / leaf).rmdir()
    written = writes(log)
    lat = sorted(written[c] - births.seen[c] for c in made if c in written and c in births.seen)
    missing = runs - len(lat)
    p50, p99, top = (quantile(lat, q) * 1e3 for q in (0.5, 0.99, 1)) if lat else (0.0,) * 3
    bench.say(f"  {name:<13} p50 {p50:7.1f} ms   p99 {p99:7.1f} ms   max {top:7.1f} ms"
              f"   (n={len(lat)}{f', {missing} never written' if missing else ''})")  # fmt: skip
    said = runtime_said(log)
    if said["events"]:
        bench.say(f"             the daemon said: {said['events']}, first: {said['first_reason']}")
    bench.figures.setdefault("cases", []).append(
        {"case": name, "p50_ms": round(p50, 2), "p99_ms": round(p99, 2), "max_ms": round(top, 2),
         "samples": len(lat), "never_written": missing, "runtime": said}
    )  # fmt: skip


def main() -> None:
    with Bench("container-start", __doc__, options) as bench:
        runs = bench.args.runs
        with (
            tempfile.TemporaryDirectory() as tmp,
            rt.started(rt.InVm(), CGROUP_ROOT) as runtimes,
        ):
            state = Path(tmp)
            bench.figures["dockerd_start_s"] = round(runtimes.started["dockerd"], 2)
            runtimes.run_docker("warm-up")  # docker/ exists, the image is unpacked once
            runtimes.run_podman("warm-up")
            runtimes.remove_containers()
            bench.say(f"cgroup made -> first cpu.max write, {runs} containers per case"
                      f" ({os.cpu_count()} CPUs)")  # fmt: skip
            docker = {"docker": runtimes.paths.docker}
            no_lookup = {"runtime": "docker"}
            case(bench, runtimes, "no lookup", state, match=no_lookup, sockets={}, runs=runs)
            lookup = {"labels": {"bench": "start"}}
            case(bench, runtimes, "lookup", state, match=lookup, sockets=docker, runs=runs)
            podman = {"podman": runtimes.paths.podman}
            case(bench, runtimes, "podman lookup", state, match=lookup, sockets=podman,
                 runs=runs, podman=True)  # fmt: skip
            case(bench, None, "mkdir only", state, match={"kind": "job"}, sockets={}, runs=runs)


if __name__ == "__main__":
    main()
