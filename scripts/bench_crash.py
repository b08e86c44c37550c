"""Crash: kill -9 the daemon at random moments, restart it, and check what it left.

The daemon manages a Kubernetes cgroupfs-driver tree, kubepods/burstable/pod<uid>/<id>,
(--pods pods of --containers containers, each container holding a `sleep`) in a sandbox
cgroup given as --cgroup-root, with a 0.1 s tick. Rules cap both pods and containers
(cpu.max and memory.max), and two tenants share the containers by fair-share weights.
Two policies alternate, A (pod 2 cores/2Gi, container 1.5/1Gi) and B (4/4Gi, 3/3Gi), so
that switching writes every limit, loosening top-down and tightening bottom-up.

Each of --runs kills (seeded) is one of:
  startup  the policy is switched, the daemon restarted, and killed at a random moment
           of its first tick (which writes every limit, then saves the state file), or
           just after it;
  reload   the policy is switched by SIGHUP, and the daemon killed at a random moment
           between the first write of the tick that applies it and a little after its
           end;
  anytime  killed at a random moment within 3 s of a tick.
After each kill, before the restart: no pod's cpu.max or memory.max is below one of its
containers'; the state file loads with nodeagent's own loader; and whether the kill left
the state file's temp file (it landed mid-save) or landed mid-tick or mid-write (from the
log: a write logged after the last tick ended, or a tick overdue). After each restart's
first tick: every managed cgroup's files equal the plan the restarted daemon reports
through its API (else it is checked again after each later tick).

Runs as root on cgroup v2 (scripts/bench crash runs it in the VM). With --json, stdout
gets one JSON object with the same figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from benchdaemon import Agent, Event, hold
from benchkit import Bench, ms, ms_figure, percentile

from nodeagent import state
from nodeagent.api.client import get
from nodeagent.errors import NodeagentError

ROOT = Path("/sys/fs/cgroup")
SANDBOX = ROOT / "nodeagent-crash-bench"
TIER = "kubepods/burstable"
INTERVAL = 0.1
POLICIES = {  # (pod cores, pod memory, container cores, container memory)
    "A": (2, "2Gi", 1.5, "1Gi"),
    "B": (4, "4Gi", 3, "3Gi"),
}
CONTROLLERS = ("cpu", "memory")
MAX_TICKS_TO_CONVERGE = 20


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=100, help="kills (default 100)")
    parser.add_argument("--pods", type=int, default=40, help="pods (default 40)")
    parser.add_argument("--containers", type=int, default=3, help="containers a pod (3)")
    parser.add_argument("--seed", type=int, default=1, help="kill moments and kinds (1)")


def policy(name: str, state_dir: Path) -> dict[str, Any]:
    pod_cpu, pod_mem, ctr_cpu, ctr_mem = POLICIES[name]
    rules = []
    for tenant in ("a", "b"):
        pods = f"{TIER}/pod{tenant}*"
        rules.append(
            {
                "name": f"containers-{tenant}",
                "match": {"kind": "container", "path": pods},
                "tenant": tenant,
                "limits": {"cpu_max": ctr_cpu, "memory_max": ctr_mem},
            }
        )
        rules.append(
            {
                "name": f"pods-{tenant}",
                "match": {"kind": "pod", "path": pods},
                "tenant": tenant,
                "limits": {"cpu_max": pod_cpu, "memory_max": pod_mem},
            }
        )
    return {
        "version": 1,
        "agent": {
            "interval": INTERVAL,
            "managed_root": "nodeagent-crash.slice",
            "state_file": str(state_dir / "state.json"),
            "socket": str(state_dir.parent / "api.sock"),
        },
        "fair_share": {"active_threshold": 0},
        "tenants": {"a": {"shares": 2}, "b": {"shares": 1}},
        "rules": rules,
    }


@dataclass
class Layout:
    pods: list[Path]
    containers: dict[Path, list[Path]]
    procs: list[int] = field(default_factory=list)


def build(pods: int, containers: int) -> Layout:
    """The sandbox's kubepods tree: pods alternate between tenants a and b by uid."""
    enable(ROOT)
    tier = SANDBOX / TIER
    tier.mkdir(parents=True)
    for d in (SANDBOX, SANDBOX / "kubepods", tier):
        enable(d)
    layout = Layout([], {})
    for p in range(pods):
        pod = tier / f"pod{'ab'[p % 2]}{p:07x}-0000-4000-8000-{p:012x}"
        pod.mkdir()
        enable(pod)
        layout.pods.append(pod)
        layout.containers[pod] = []
        for c in range(containers):
            ctr = pod / f"{p:08x}{c:056x}"
            ctr.mkdir()
            layout.containers[pod].append(ctr)
            layout.procs.append(hold(ctr))
    return layout


def enable(cgroup: Path) -> None:
    control = cgroup / "cgroup.subtree_control"
    enabled = control.read_text().split()
    for c in CONTROLLERS:
        if c not in enabled:
            control.write_text(f"+{c}")


def teardown(layout: Layout | None) -> None:
    if layout is not None:
        for pid in layout.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    if not SANDBOX.exists():
        return
    for dirpath, _, _ in sorted(os.walk(SANDBOX), key=lambda w: -len(w[0])):
        for _ in range(500):
            try:
                os.rmdir(dirpath)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)


def cores(cpu_max: str) -> float:
    quota, period = cpu_max.split()
    return float("inf") if quota == "max" else int(quota) / int(period)


def memory(value: str) -> float:
    return float("inf") if value == "max" else int(value)


def parents_tighter(layout: Layout) -> list[str]:
    """Each pod whose cpu.max or memory.max is below one of its containers'."""
    found = []
    for pod, ctrs in layout.containers.items():
        pod_cpu = cores((pod / "cpu.max").read_text())
        pod_mem = memory((pod / "memory.max").read_text().strip())
        for ctr in ctrs:
            ctr_cpu = cores((ctr / "cpu.max").read_text())
            ctr_mem = memory((ctr / "memory.max").read_text().strip())
            if pod_cpu < ctr_cpu or pod_mem < ctr_mem:
                found.append(
                    f"{pod.name}: cpu {pod_cpu:g} < {ctr_cpu:g} or memory {pod_mem:g} < {ctr_mem:g}"
                )
    return found


def differences(socket: str) -> list[str]:
    """Where a managed cgroup's files differ from the plan the daemon reports."""
    plan = get(socket, "/v1/allocations", timeout=60)
    assert isinstance(plan, dict)
    found = []
    for row in plan["allocations"]:
        for attribute, value in row["values"].items():
            target = value["target"]
            if target is None:
                continue
            try:
                now = (SANDBOX / row["cgroup"] / attribute).read_text().strip()
            except OSError as e:
                now = f"unreadable: {e.strerror}"
            if now != target:
                found.append(f"{row['cgroup']}/{attribute}: {now} (plan {target})")
    return found


@dataclass
class Kill:
    kind: str
    at: float
    events: list[Event]
    temp_files: int
    state_error: str | None
    tighter: list[str]

    def landed(self) -> set[str]:
        """Where the kill landed, as far as the log tells."""
        ticks = [e for e in self.events if e.get("event") == "tick"]
        listening = [e for e in self.events if e.get("event") == "api.listening"]
        after = ticks[-1]["ts"] if ticks else (listening[0]["ts"] if listening else None)
        where = set()
        if after is None:
            where.add("starting")
        elif any(e.get("event") == "cgroup.write" and e["ts"] > after for e in self.events):
            where |= {"mid-tick", "mid-write"}
        elif not ticks or self.at > after + INTERVAL:
            where.add("mid-tick")  # the next tick was due: it was running, before its writes
        else:
            where.add("between ticks")
        if self.temp_files:
            where.add("mid-save")
        return where


@dataclass
class Runs:
    kills: list[Kill] = field(default_factory=list)
    converge_s: list[float] = field(default_factory=list)
    """From a restart to the end of the first tick after which the files equal the plan."""
    ticks_to_converge: Counter[int] = field(default_factory=Counter)
    not_converged: list[str] = field(default_factory=list)
    up_s: list[float] = field(default_factory=list)
    """From a restart to the API listening: Python's start-up, then the tree's discovery."""
    first_tick_s: list[float] = field(default_factory=list)
    """The first tick's own duration (it starts when the API listens)."""
    tick_s: list[float] = field(default_factory=list)
    write_tail_s: list[float] = field(default_factory=list)


def after_kill(agent: Agent, kind: str, at: float, state_file: Path, layout: Layout) -> Kill:
    temps = list(state_file.parent.glob(".state-*"))
    error = None
    try:
        state.load(str(state_file), tenants={"a", "b"})
    except NodeagentError as e:
        error = str(e)
    for t in temps:  # a temp file is never read: clear it, so the next one is this kill's
        t.unlink()
    return Kill(kind, at, agent.since_start(), len(temps), error, parents_tighter(layout))


def converge(agent: Agent, runs: Runs, socket: str) -> int | None:
    """Wait for the restarted daemon's first tick; check the files, and after each later
    tick while they differ."""
    for n in range(1, MAX_TICKS_TO_CONVERGE + 1):
        tick = agent.wait_for(lambda e: e.get("event") == "tick")
        if n == 1:
            runs.first_tick_s.append(tick["seconds"])
            listening = [e for e in agent.since_start() if e.get("event") == "api.listening"]
            if listening:
                runs.up_s.append(listening[0]["ts"] - agent.started_at)
        diff = differences(socket)
        if not diff:
            runs.converge_s.append(time.time() - agent.started_at)
            runs.ticks_to_converge[n] += 1
            return n
    runs.not_converged.append(f"after {MAX_TICKS_TO_CONVERGE} ticks: {'; '.join(diff[:3])}")
    return None


def wait_to_kill(
    agent: Agent, kind: str, rng: random.Random, runs: Runs, switch: Callable[[], None]
) -> None:
    """Bring the daemon to a random moment of the kind chosen (see the module's doc)."""
    writing = percentile(runs.write_tail_s, 0.5) or 0.3
    if kind == "startup":
        agent.kill()
        switch()
        agent.start()
        agent.wait_for(lambda e: e.get("event") == "api.listening")  # the first tick begins
        first = percentile(runs.first_tick_s, 0.5) or 0.5
        time.sleep(rng.uniform(0, 1.2) * first)
    elif kind == "reload":
        switch()
        agent.signal(signal.SIGHUP)
        agent.wait_for(lambda e: e.get("event") == "policy.reloaded")
        agent.wait_for(lambda e: e.get("event") == "cgroup.write")
        time.sleep(rng.uniform(0, 1.2) * writing)
    else:
        agent.wait_for(lambda e: e.get("event") == "tick")
        time.sleep(rng.uniform(0, 3))


def write_tails(events: list[Event]) -> list[float]:
    """For each tick that wrote: seconds from its first write to its end (writes, then the
    state save when one is due)."""
    tails, first = [], None
    for e in events:
        if e.get("event") == "cgroup.write" and first is None:
            first = e["ts"]
        elif e.get("event") == "tick":
            if first is not None:
                tails.append(e["ts"] - first)
            first = None
    return tails


def run(bench: Bench, tmp: Path) -> None:
    args = bench.args
    rng = random.Random(args.seed)  # noqa: S311 (reproducible kill moments, not a secret)
    state_dir = tmp / "state"
    state_file = state_dir / "state.json"
    socket = str(tmp / "api.sock")
    config = tmp / "policy.yaml"
    current = "A"

    def switch() -> None:
        nonlocal current
        current = "B" if current == "A" else "A"
        config.write_text(yaml.safe_dump(policy(current, state_dir)))

    config.write_text(yaml.safe_dump(policy(current, state_dir)))
    agent = Agent(config, tmp / "agent.log", "--cgroup-root", str(SANDBOX))
    runs = Runs()
    layout = None
    try:
        layout = build(args.pods, args.containers)
        bench.progress(f"  {len(layout.procs)} containers in {len(layout.pods)} pods")
        agent.start()
        converge(agent, runs, socket)
        for i in range(args.runs):
            kind = rng.choice(["startup", "startup", "reload", "reload", "anytime"])
            wait_to_kill(agent, kind, rng, runs, switch)
            at = agent.kill()
            events = agent.since_start()
            runs.tick_s += [e["seconds"] for e in events if e.get("event") == "tick"]
            runs.write_tail_s += write_tails(events)
            runs.kills.append(after_kill(agent, kind, at, state_file, layout))
            agent.start()
            ticks = converge(agent, runs, socket)
            kill = runs.kills[-1]
            bench.progress(
                f"kill {i + 1} ({kind}): landed {', '.join(sorted(kill.landed()))};"
                f" {len(kill.tighter)} pods tighter; state {kill.state_error or 'loads'};"
                f" the restart equals the plan after {ticks or 'no'} tick(s)"
            )
        agent.stop()
    finally:
        if agent.exited() is None:
            agent.stop()
        teardown(layout)
        if args.out:
            shutil.copy(agent.log.path, Path(args.out, "crash-agent.log"))
    report(bench, runs)


def report(bench: Bench, runs: Runs) -> None:
    kills = runs.kills
    landed = Counter(w for k in kills for w in k.landed())
    kinds = Counter(k.kind for k in kills)
    state_failures = [k.state_error for k in kills if k.state_error]
    tighter = [t for k in kills for t in k.tighter]
    tighter_runs = sum(bool(k.tighter) for k in kills)
    f = bench.figures
    f.update(
        runs=len(kills),
        kinds=dict(kinds),
        landed=dict(landed),
        failures={
            "state_file_unloadable": len(state_failures),
            "parent_tighter_than_child": tighter_runs,
            "not_converged_within_one_tick": len(kills) + 1 - runs.ticks_to_converge[1],
            "not_converged_at_all": len(runs.not_converged),
        },
        state_errors=state_failures[:10],
        parent_tighter_examples=tighter[:10],
        not_converged=runs.not_converged[:10],
        ticks_to_converge=dict(runs.ticks_to_converge),
        restart_to_converged_s={
            "p50": _s(percentile(runs.converge_s, 0.5)),
            "max": _s(max(runs.converge_s, default=None)),
        },
        restart_to_api_s={
            "p50": _s(percentile(runs.up_s, 0.5)),
            "max": _s(max(runs.up_s, default=None)),
        },
        first_tick_ms={
            "p50": ms_figure(percentile(runs.first_tick_s, 0.5)),
            "max": ms_figure(max(runs.first_tick_s, default=None)),
        },
        tick_ms={
            "p50": ms_figure(percentile(runs.tick_s, 0.5)),
            "max": ms_figure(max(runs.tick_s, default=None)),
        },
    )
    bench.say(
        f"kills: {len(kills)} ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))});"
        f" landed: {', '.join(f'{n} {w}' for w, n in sorted(landed.items()))}"
    )
    bench.say(f"state file failed to load: {len(state_failures)}")
    bench.say(f"a pod left tighter than its container: {tighter_runs} kills")
    for t in tighter[:5]:
        bench.say(f"    {t}")
    within_one = runs.ticks_to_converge[1]
    restarts = len(kills) + 1
    later = [f"{n} after {t} ticks" for t, n in sorted(runs.ticks_to_converge.items()) if t > 1]
    bench.say(
        f"restarts whose files equal the plan after the first tick: {within_one} of {restarts};"
        f" later: {', '.join(later) or 'none'}; never: {len(runs.not_converged)}"
    )
    for line in runs.not_converged[:5]:
        bench.say(f"    {line}")
    bench.say(
        f"restart -> converged: p50 {ms(percentile(runs.converge_s, 0.5))},"
        f" max {ms(max(runs.converge_s, default=None))}"
        f" = restart -> API up p50 {ms(percentile(runs.up_s, 0.5))}"
        f" (Python's start-up under TCG), then the first tick p50"
        f" {ms(percentile(runs.first_tick_s, 0.5))}, max {ms(max(runs.first_tick_s, default=None))}"
    )


def _s(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def main() -> None:
    with Bench("crash", __doc__, options) as bench:
        run_crash(bench)


def run_crash(bench: Bench) -> None:
    args = bench.args
    bench.figures.update(pods=args.pods, containers=args.containers, seed=args.seed)
    bench.say(
        f"crash: {args.runs} kill -9s (seed {args.seed}), {args.pods} pods x {args.containers}"
        f" containers, {INTERVAL:g} s tick"
    )
    teardown(None)  # what an interrupted run left
    with tempfile.TemporaryDirectory() as tmp:
        run(bench, Path(tmp))


if __name__ == "__main__":
    main()
