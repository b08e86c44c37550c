"""Churn: workload cgroups come and go under a running daemon, as on a busy node.

`nodeagent run` (1 s tick, JSON log) manages one subtree while this script creates and
removes cgroups there at --rate a minute for --minutes, half of them holding a process
(a `sleep`). Lifetimes are seeded: 30% live 0.1-1 s, the rest 1-10 s. One rule gives every
cgroup a static cpu.max and memory.max; each cgroup's files are read just before it is
removed. Reports:

  cgroups   created, and of those that lived at least 1 s how many had their limits
            (goal: all), with the lifetimes of any that did not; mkdir to the cpu.max
            write (from the audit log), p50/p99/max
  daemon    ticks, failed ticks (tick.failed; goal: none but vanished cgroups), crashes
            (exits; it is restarted), CPU as a fraction of one core
  RSS       VmRSS after a warm-up minute, at the end, and the growth (goal: < 5%)
  log       every warning and error event, by name

Runs as root on cgroup v2 (scripts/bench churn runs it in the VM). With --json, stdout
gets one JSON object with the same figures.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from benchdaemon import Agent, hold
from benchkit import Bench, ms, ms_figure, percentile

ROOT = Path("/sys/fs/cgroup")
MANAGED = "nodeagent-churn.slice"
CPU_MAX = "50000 100000"  # 0.5 cores
MEMORY_MAX = 256 << 20
WARM_UP = 60.0


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10, help="how long (default 10)")
    parser.add_argument("--rate", type=float, default=1000, help="cgroups a minute (1000)")
    parser.add_argument("--seed", type=int, default=1, help="lifetimes and holders (1)")


@dataclass
class Run:
    """What a churn run saw, for the report."""

    made: int = 0
    elapsed: float = 0.0
    checked: list[tuple[str, float, bool]] = field(default_factory=list)
    """(name, lifetime in s, had its limits just before removal)"""
    born: dict[str, float] = field(default_factory=dict)
    rss: list[tuple[float, int]] = field(default_factory=list)
    """(seconds into the run, VmRSS kB)"""
    crashes: list[dict[str, object]] = field(default_factory=list)
    cpu_used: float = 0.0


@dataclass
class Workload:
    path: Path
    born: float  # wall clock, to line up with the log
    dies: float  # monotonic
    proc: int | None  # pid of its sleep


def policy(state_dir: str) -> dict[str, object]:
    return {
        "version": 1,
        "agent": {
            "interval": "1s",
            "managed_root": MANAGED,
            "state_file": f"{state_dir}/state.json",
            "socket": f"{state_dir}/api.sock",
        },
        "tenants": {"churn": {"shares": 1}},
        "rules": [
            {
                "name": "churn",
                "match": {"path": f"{MANAGED}/*"},
                "tenant": "churn",
                "limits": {"cpu_max": 0.5, "memory_max": MEMORY_MAX},
            }
        ],
    }


def lifetime(rng: random.Random) -> float:
    return rng.uniform(0.1, 1.0) if rng.random() < 0.3 else rng.uniform(1.0, 10.0)


def has_limits(path: Path) -> bool:
    try:
        cpu = (path / "cpu.max").read_text().strip()
        memory = (path / "memory.max").read_text().strip()
    except OSError:
        return False
    return cpu == CPU_MAX and memory == str(MEMORY_MAX)


class Remover:
    """Kills a workload's process and removes its cgroup once empty, without blocking."""

    def __init__(self) -> None:
        self.pending: list[tuple[Path, int | None]] = []

    def add(self, path: Path, pid: int | None) -> None:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        self.pending.append((path, pid))

    def step(self) -> None:
        left: list[tuple[Path, int | None]] = []
        for path, pid in self.pending:
            if pid is not None:
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done == 0:
                    left.append((path, pid))
                    continue
            try:
                path.rmdir()
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                left.append((path, None))
        self.pending = left

    def drain(self) -> None:
        while self.pending:
            self.step()
            time.sleep(0.01)


def churn(bench: Bench, agent: Agent, seconds: float, rate: float, seed: int) -> None:
    rng = random.Random(seed)  # noqa: S311 (a reproducible load, not a secret)
    period = 60.0 / rate
    live: list[Workload] = []
    remover = Remover()
    run = Run()
    start = time.monotonic()
    cpu_start = agent.cpu_seconds() or 0.0
    next_make, next_sample, next_progress = start, start, start + 60
    while (now := time.monotonic()) < start + seconds:
        if now >= next_make:
            name = f"w-{run.made}"
            path = ROOT / MANAGED / name
            path.mkdir()
            run.born[name] = time.time()
            pid = hold(path) if run.made % 2 else None
            live.append(Workload(path, run.born[name], now + lifetime(rng), pid))
            run.made += 1
            next_make += period
        for w in [w for w in live if w.dies <= now]:
            run.checked.append((w.path.name, time.time() - w.born, has_limits(w.path)))
            live.remove(w)
            remover.add(w.path, w.proc)
        remover.step()
        if now >= next_sample:
            status = agent.exited()
            if status is not None:  # a crash: count it, and go on with a new daemon
                run.crashes.append({"at_s": round(now - start, 1), "status": status})
                agent.start()
                cpu_start = 0.0
            else:
                kb = agent.rss_kb()
                if kb is not None:
                    run.rss.append((now - start, kb))
                run.cpu_used = (agent.cpu_seconds() or 0.0) - cpu_start
            next_sample += 1.0
        if now >= next_progress:
            minutes = (now - start) / 60
            bench.progress(f"  {minutes:.0f} min: {run.made} cgroups made, {len(live)} live")
            next_progress += 60
        wake = min([next_make, next_sample, *(w.dies for w in live)])
        time.sleep(max(0.0, min(0.01, wake - time.monotonic())))
    for w in live:
        run.checked.append((w.path.name, time.time() - w.born, has_limits(w.path)))
        remover.add(w.path, w.proc)
    remover.drain()
    run.elapsed = time.monotonic() - start
    bench.progress(f"churn over: {run.made} cgroups made; reading the daemon's log")
    report(bench, agent, run)


def report(bench: Bench, agent: Agent, run: Run) -> None:
    made, elapsed, checked, born, rss = run.made, run.elapsed, run.checked, run.born, run.rss
    crashes, cpu_used = run.crashes, run.cpu_used
    agent.log.read()
    events = agent.log.events
    f = bench.figures
    rate = made / elapsed * 60

    first_write: dict[str, float] = {}
    for e in events:
        if e.get("event") == "cgroup.write" and e.get("attribute") == "cpu.max":
            name = Path(str(e["path"])).parent.name
            if name in born and name not in first_write:
                first_write[name] = e["ts"] - born[name]
    latency = list(first_write.values())
    long_lived = [(name, life, ok) for name, life, ok in checked if life >= 1.0]
    missing = [(name, life) for name, life, ok in long_lived if not ok]
    short_ok = sum(ok for _, life, ok in checked if life < 1.0)
    f["cgroups"] = {
        "created": made,
        "rate_per_minute": round(rate, 1),
        "checked": len(checked),
        "lived_1s_or_more": len(long_lived),
        "lived_1s_or_more_with_limits": len(long_lived) - len(missing),
        "lived_1s_or_more_without_limits": len(missing),
        "without_limits_lifetimes_s": sorted(round(life, 3) for _, life in missing)[:100],
        "lived_under_1s": len(checked) - len(long_lived),
        "lived_under_1s_with_limits": short_ok,
        "mkdir_to_limits_ms": {
            "n": len(latency),
            "p50": ms_figure(percentile(latency, 0.5)),
            "p99": ms_figure(percentile(latency, 0.99)),
            "max": ms_figure(max(latency, default=None)),
        },
    }
    bench.say(
        f"cgroups: {made} created in {elapsed / 60:.1f} min ({rate:.0f}/min), half with a"
        f" process; {len(checked)} checked just before removal"
    )
    lifetimes = ", ".join(f"{life:.2f}s" for _, life in missing[:10])
    bench.say(
        f"  lived >= 1 s: {len(long_lived)}, with their limits {len(long_lived) - len(missing)},"
        f" without {len(missing)}" + (f" (lifetimes {lifetimes})" if missing else "")
    )
    bench.say(f"  lived < 1 s: {len(checked) - len(long_lived)}, with their limits {short_ok}")
    bench.say(
        f"  mkdir -> cpu.max written: p50 {ms(percentile(latency, 0.5))},"
        f" p99 {ms(percentile(latency, 0.99))}, max {ms(max(latency, default=None))}"
        f" (n={len(latency)})"
    )

    ticks = [e for e in events if e.get("event") == "tick"]
    durations = [float(e["seconds"]) for e in ticks if "seconds" in e]
    failed = [e for e in events if e.get("event") == "tick.failed"]
    vanished = [e for e in failed if "vanish" in str(e.get("error", ""))]
    errors = Counter(str(e.get("error", ""))[:200] for e in failed)
    f["daemon"] = {
        "ticks": len(ticks),
        "ticks_per_s": round(len(ticks) / elapsed, 2),
        "tick_ms": {
            "p50": ms_figure(percentile(durations, 0.5)),
            "p99": ms_figure(percentile(durations, 0.99)),
            "max": ms_figure(max(durations, default=None)),
        },
        "failed_ticks": len(failed),
        "failed_ticks_vanished": len(vanished),
        "failed_tick_errors": dict(errors.most_common(10)),
        "crashes": crashes,
        "cpu_fraction_of_a_core": round(cpu_used / elapsed, 3),
    }
    bench.say(
        f"daemon: {len(ticks)} ticks ({len(ticks) / elapsed:.2f}/s; interval 1 s, and inotify"
        f" wakes it early), tick p50 {ms(percentile(durations, 0.5))},"
        f" p99 {ms(percentile(durations, 0.99))}, max {ms(max(durations, default=None))}"
    )
    bench.say(
        f"  failed ticks {len(failed)} ({len(vanished)} on vanished cgroups), crashes"
        f" {len(crashes)}, CPU {cpu_used / elapsed:.1%} of a core"
    )
    for error, count in errors.most_common(5):
        bench.say(f"    {count} x tick.failed: {error}")

    warm = [kb for t, kb in rss if t >= min(WARM_UP, elapsed / 2)]
    if warm:
        first, last, peak = warm[0], warm[-1], max(warm)
        f["rss_kb"] = {
            "after_warm_up": first,
            "end": last,
            "max_after_warm_up": peak,
            "growth_percent": round((last - first) / first * 100, 2),
            "max_growth_percent": round((peak - first) / first * 100, 2),
            "per_minute_max": [
                max(kb for t, kb in rss if m * 60 <= t < (m + 1) * 60)
                for m in range(int(rss[-1][0] // 60) + 1)
                if any(m * 60 <= t < (m + 1) * 60 for t, _ in rss)
            ],
        }
        bench.say(
            f"RSS: {first / 1024:.1f} MB after the warm-up, {last / 1024:.1f} MB at the end"
            f" ({(last - first) / first:+.1%}); max {peak / 1024:.1f} MB"
            f" ({(peak - first) / first:+.1%})"
        )

    noisy = Counter(
        str(e.get("event"))
        for e in events
        if e.get("level") in ("warning", "error", "critical") or e.get("event") == "raw"
    )
    f["log_warnings_and_errors"] = dict(noisy.most_common())
    bench.say(
        "log warnings/errors: "
        + (", ".join(f"{name} {n}" for name, n in noisy.most_common()) or "none")
    )


def main() -> None:
    with Bench("churn", __doc__, options) as bench:
        run_churn(bench)


def run_churn(bench: Bench) -> None:
    args = bench.args
    bench.figures.update(minutes=args.minutes, rate=args.rate, seed=args.seed)
    bench.say(
        f"churn: {args.minutes:g} min at {args.rate:g} cgroups/min (seed {args.seed}),"
        " daemon ticking every 1 s"
    )
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp, "policy.yaml")
        config.write_text(yaml.safe_dump(policy(tmp)))
        agent = Agent(config, Path(tmp, "agent.log"))
        agent.start()
        try:
            agent.wait_for(lambda e: e.get("event") == "tick")
            bench.progress(f"the daemon ticks ({time.time() - agent.started_at:.0f} s to start)")
            churn(bench, agent, args.minutes * 60, args.rate, args.seed)
        finally:
            bench.progress("stopping the daemon")
            status = agent.stop()
            bench.figures["exit_status"] = status
            with contextlib.suppress(OSError):
                if bench.args.out:
                    shutil.copy(agent.log.path, Path(bench.args.out, "churn-agent.log"))
            cleanup()


def cleanup() -> None:
    base = ROOT / MANAGED
    if not base.exists():
        return
    for child in base.iterdir():
        if child.is_dir():
            with contextlib.suppress(OSError):
                (child / "cgroup.kill").write_text("1")
            for _ in range(500):
                try:
                    child.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)
    with contextlib.suppress(OSError):
        base.rmdir()


if __name__ == "__main__":
    main()
