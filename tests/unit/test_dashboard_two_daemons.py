"""The dashboard and the shipped alert rules over the scrapes of three real daemons.

Three `nodeagent run` processes (not dry runs), each with its own policy (its own tenants
and workloads; node-a also a deadline job and a GPU), API socket, state file and metrics
port, are scraped over HTTP: UP scrapes of all three, TICKS ticks of each apart (waited for
on their tick counters), node-c refusing a reload of a broken policy file (SIGHUP) from its
second; then node-b is stopped (SIGSTOP), its endpoint stops answering, and DOWN more
scrapes find it down. The scrapes become promtool's input series (promseries.py) labelled
as Prometheus labels them (job, instance "127.0.0.1:PORT", `up`), and every panel's query
is evaluated through promtool at the last scrape of all three and at the very last: each
per-node panel for the daemons it has data from, the fleet row's counts (nodes up and
down, the worst tick age, refused reloads), the top-10 panels' nodes; with the alert
rules.

Stand-ins, said plainly: the cgroup root is a plain directory tree of interface files that
this test writes (the daemons' writes of cpu.weight, cpu.max and memory.* land in plain
files), its workloads' CPU usage moved by this test as the kernel would account it; the
proc root is a directory whose self/mountinfo says the tree is a cgroup2 mount (its stat,
meminfo and cpuinfo are the host's); node-a's GPU is simulated (gpu.simulate). What runs as
on a host is the daemon itself: its command line, loop, sensor, policies, writer, metrics
endpoint and signal handling.

Clocks: scrape i is at i * SCRAPE seconds on promtool's clock, while the daemons tick every
INTERVAL on the wall clock. Each timestamp a daemon exports (last tick, reload, deadline) is
moved by its scrape's offset (wall time at the scrape -> the scrape's promtool time), so
the ages the dashboard shows are those at the scrape; counters' rates are per promtool
second (their values are not asserted).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from promseries import (
    JOB,
    SCRAPE,
    Series,
    alert_annotations,
    at,
    input_series,
    promtool_test,
    put,
    samples,
)
from test_grafana_dashboard import DASHBOARD, FLEET_ROWS, filled, fleet_targets, node_targets
from test_metrics_server import free_port
from test_prometheus_alerts import RULES
from ticks import GPU_NODE
from waits import wait_for

INTERVAL = 0.2
"""agent.interval of the daemons, in seconds."""
TICKS = 3
"""Ticks of each daemon, at least, between two scrapes of it (its endpoint renders at most
once a second, so they come about a second apart)."""
UP, DOWN = 6, 22
"""Scrapes of all daemons; then scrapes with node-b stopped: NodeagentDown's 5 minutes
(20 scrapes) and one to spare, after the first that finds it down."""
STEPS = UP + DOWN
FRESH_S = 10.0
"""A tick this recent is fresh (generous for a loaded host; the alert's bound is 120 s)."""
START_S, WAIT_S = 90.0, 60.0
"""Ceilings: for a daemon's first tick on its endpoint, and for TICKS more."""
ANSWER_TIMEOUT_S = 10.0
"""A scrape's timeout (Prometheus's default scrape_timeout); the daemons answer in about a
millisecond."""
STOPPED_TIMEOUT_S = 1.0
"""A scrape's timeout once node-b is stopped: about as long as node-a's TICKS take, which
it runs beside."""

FILES = {
    "cgroup.procs": "",
    "cgroup.threads": "",
    "cgroup.events": "populated 1\nfrozen 0\n",
    "cgroup.freeze": "0\n",
    "cgroup.controllers": "cpu memory\n",
    "cgroup.subtree_control": "cpu memory\n",
    "cpu.weight": "100\n",
    "cpu.max": "max 100000\n",
    "cpu.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    "memory.current": "314572800\n",
    "memory.max": "max\n",
    "memory.high": "max\n",
    "memory.low": "0\n",
    "memory.min": "0\n",
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
    "memory.stat": "anon 209715200\nfile 104857600\n",
    "memory.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
}
"""The interface files of each cgroup of the stand-in tree (cpu.stat is the load's)."""

DUE = (datetime.now(UTC) + timedelta(days=1)).isoformat(timespec="seconds")
NODES: dict[str, dict[str, Any]] = {
    "node-a": {
        "workloads": {"nodeagent.slice/research-train": 1.0, "nodeagent.slice/prod-web": 0.5},
        "gpus": True,
        "policy": {
            "tenants": {"research": {"shares": 2}, "prod": {"shares": 1}},
            "rules": [
                {
                    "name": "research-training",
                    "match": {"path": "nodeagent.slice/research-*"},
                    "tenant": "research",
                    "class": "training",
                    "deadline": DUE,
                    "work": 3600,
                },
                {
                    "name": "prod-web",
                    "match": {"path": "nodeagent.slice/prod-*"},
                    "tenant": "prod",
                    "class": "batch",
                    "limits": {"cpu_max": 1.5, "memory_max": "1Gi"},
                },
            ],
        },
    },
    "node-b": {
        "workloads": {"nodeagent.slice/shop-api": 0.3, "nodeagent.slice/etl-1": 1.2},
        "gpus": False,
        "policy": {
            "tenants": {"shop": {"shares": 1}, "analytics": {"shares": 3}},
            "rules": [
                {
                    "name": "shop-api",
                    "match": {"path": "nodeagent.slice/shop-*"},
                    "tenant": "shop",
                    "class": "inference",
                    "limits": {"memory_max": "2Gi"},
                },
                {
                    "name": "etl",
                    "match": {"path": "nodeagent.slice/etl-*"},
                    "tenant": "analytics",
                    "class": "batch",
                    "limits": {"cpu_max": 0.5},
                },
            ],
        },
    },
    "node-c": {
        "workloads": {"nodeagent.slice/ci-build": 0.8},
        "gpus": False,
        "policy": {
            "tenants": {"ci": {"shares": 1}},
            "rules": [
                {
                    "name": "ci",
                    "match": {"path": "nodeagent.slice/ci-*"},
                    "tenant": "ci",
                    "class": "batch",
                    "limits": {"cpu_max": 0.5, "memory_max": "1Gi"},
                },
            ],
        },
    },
}
"""Each daemon's workloads (cgroup: CPU cores it uses), whether it has a (simulated) GPU,
and its policy beyond agent: and gpu:."""
BROKEN = {"tenants": {"ci": {"shares": -1}}}
"""What node-c's policy file says when it is reloaded: a tenant's shares the agent refuses."""


def stand_in_tree(base: Path, workloads: dict[str, float]) -> tuple[Path, Path]:
    """A plain directory tree standing in for a cgroup root, and a proc root whose
    mountinfo makes it a cgroup2 mount (the rest of that proc root is the host's)."""
    root = base / "cgroup"
    for path in ["", "nodeagent.slice", *workloads]:
        (root / path).mkdir(parents=True, exist_ok=True)
        for name, text in {**FILES, "cpu.stat": cpu_stat(0.0)}.items():
            (root / path / name).write_text(text)
    proc = base / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/\n")
    (proc / "self" / "mountinfo").write_text(
        "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        f"41 22 0:38 / {os.path.realpath(root)} rw,relatime - cgroup2 cgroup2 rw\n"
    )
    for name in ("stat", "meminfo", "cpuinfo"):
        (proc / name).symlink_to(f"/proc/{name}")
    return root, proc


def cpu_stat(used_s: float) -> str:
    usage, periods = int(used_s * 1e6), int(used_s * 10)
    return (
        f"usage_usec {usage}\nuser_usec {usage}\nsystem_usec 0\n"
        f"nr_periods {periods}\nnr_throttled {periods // 10}\nthrottled_usec {usage // 20}\n"
    )


class Load:
    """Moves each workload's cpu.stat at its rate, as the kernel accounts CPU time (written
    whole by rename, so that a daemon never reads half a file)."""

    def __init__(self, roots: dict[Path, dict[str, float]]) -> None:
        self.roots, self.stop = roots, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        while not self.stop.wait(0.05):
            elapsed = time.monotonic() - start
            for root, workloads in self.roots.items():
                for path, cores in workloads.items():
                    new = root / path / ".cpu.stat.new"
                    new.write_text(cpu_stat(cores * elapsed))
                    new.replace(root / path / "cpu.stat")

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


@dataclass(eq=False)
class Daemon:
    name: str
    port: int
    proc: subprocess.Popen[bytes] = field(repr=False)
    log: Path = field(repr=False)
    scrapes: list[tuple[float, str] | None] = field(default_factory=list, repr=False)
    """(wall time at its end, exposition text) of each scrape; None where it failed."""
    _names: dict[int, set[str]] = field(default_factory=dict, repr=False)

    @property
    def instance(self) -> str:
        return f"127.0.0.1:{self.port}"

    def get(self, timeout: float) -> str | None:
        """/metrics, or None when the endpoint does not answer within `timeout`."""
        url = f"http://{self.instance}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:  # loopback only
                return str(response.read().decode()) if response.status == 200 else None
        except (OSError, urllib.error.URLError):
            return None

    def ticks(self) -> int:
        """Ticks completed, as of its last scrape."""
        last = self.scrapes[-1]
        assert last is not None
        return ticks(last[1])

    def scrape(self, after: int, ceiling: float) -> None:
        """Scrape once the endpoint shows `after` ticks more than the last scrape did."""
        want = (self.ticks() if self.scrapes else 0) + after
        deadline = time.monotonic() + ceiling
        while True:
            assert self.proc.poll() is None, f"{self.name} exited: {self.tail()}"
            text = self.get(ANSWER_TIMEOUT_S)
            if text is not None and ticks(text) >= want:
                self.scrapes.append((time.time(), text))
                return
            assert time.monotonic() < deadline, (
                f"{self.name}: no {want} ticks on its endpoint in {ceiling:.0f} s: {self.tail()}"
            )
            time.sleep(0.05)

    def names(self, step: int) -> set[str]:
        """The series names in its scrape at `step` (none where it did not answer)."""
        if step not in self._names:
            scrape = self.scrapes[step]
            self._names[step] = set() if scrape is None else {n for n, _, _ in samples(scrape[1])}
        return self._names[step]

    def tail(self) -> str:
        return self.log.read_text()[-2000:]


def ticks(text: str) -> int:
    """nodeagent_ticks_total, both results (read without the full parser: this polls)."""
    return int(sum(float(v) for v in TICKS_TOTAL.findall(text)))


TICKS_TOTAL = re.compile(r"^nodeagent_ticks_total\{[^}]*\} (\S+)$", re.MULTILINE)


def start(name: str, base: Path, sockdir: Path, port: int) -> tuple[Daemon, Path]:
    node = NODES[name]
    base.mkdir()
    root, proc = stand_in_tree(base, node["workloads"])
    gpus = {}
    if node["gpus"]:
        (base / "gpus.yaml").write_text(GPU_NODE.split("processes:")[0])  # no stray processes
        gpus = {"gpu": {"simulate": str(base / "gpus.yaml")}}
    agent = {
        "interval": f"{int(INTERVAL * 1000)}ms",
        "state_file": str(base / "state.json"),
        "socket": str(sockdir / f"{name}.sock"),
        "metrics": {"listen": f"127.0.0.1:{port}"},
    }
    policy = base / "policy.yaml"
    policy.write_text(yaml.safe_dump({"version": 1, "agent": agent, **gpus, **node["policy"]}))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("NODEAGENT_") and k not in ("INVOCATION_ID", "NOTIFY_SOCKET")
    }
    log = base / "daemon.log"
    with log.open("wb") as out:
        command = [sys.executable, "-m", "nodeagent", "run", "--config", str(policy)]
        command += ["--cgroup-root", str(root), "--proc-root", str(proc)]
        daemon = subprocess.Popen(command, stdout=out, stderr=out, env=env, cwd=base)
    return Daemon(name, port, daemon, log), root


@pytest.fixture
def daemons(tmp_path: Path, sockdir: Path) -> Iterator[dict[str, Daemon]]:
    """Both daemons running, and the load on their trees; both stopped after, whatever
    happened (SIGCONT first: a stopped process acts on SIGTERM only once continued)."""
    started: dict[str, Daemon] = {}
    roots: dict[Path, dict[str, float]] = {}
    try:
        ports: set[int] = set()
        while len(ports) < len(NODES):  # free now; distinct, as the daemons bind them later
            ports.add(free_port())
        for name, port in zip(NODES, sorted(ports), strict=True):
            started[name], root = start(name, tmp_path / name, sockdir, port)
            roots[root] = NODES[name]["workloads"]
        load = Load(roots)
        try:
            yield started
        finally:
            load.close()
    finally:
        for d in started.values():
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGCONT)
                d.proc.terminate()
                try:
                    d.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
                    d.proc.wait()


def as_series(ds: list[Daemon]) -> list[dict[str, str]]:
    """Every scrape of each daemon at its step, labelled as Prometheus labels it, with its
    `up`; each exported timestamp moved by its scrape's offset to promtool's clock."""
    series: Series = {}
    for d in ds:
        target = {"job": JOB, "instance": d.instance}
        for step, scrape in enumerate(d.scrapes):
            put(series, STEPS, step, "up", target, int(scrape is not None))
            if scrape is None:
                continue
            wall, text = scrape
            for name, labels, v in samples(text):
                timestamp = name.endswith("_timestamp_seconds") or name.endswith("_time_seconds")
                value = v - wall + step * SCRAPE if timestamp else v
                put(series, STEPS, step, name, {**labels, **target}, value)
    return input_series(series)


RANGE = re.compile(r"(\w+)\((nodeagent_\w+)\{[^}]*\}\[(\d+)([smhd])\]\)")
"""A range selector, in the function that takes it: rate(name{...}[1m])."""
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def answers(d: Daemon, expr: str, step: int) -> bool:
    """Whether `expr` has data from `d` at `step`, as PromQL selects it: an instant selector
    the series of that scrape (none where it failed: what went is stale), a range selector
    those of the scrapes in its window (at least two for rate() and increase()), `up`
    whether or not it answered; one branch of an `or` is enough. Whether the data passes
    the query's own filters is not asked."""

    def branch(part: str) -> bool:
        for fn, name, n, unit in RANGE.findall(part):
            window = [
                j
                for j in range(step + 1)
                if (step - j) * SCRAPE < int(n) * SECONDS[unit] and name in d.names(j)
            ]
            if len(window) < (2 if fn in ("rate", "increase") else 1):
                return False
        instant = set(re.findall(r"\bnodeagent_\w+\b", RANGE.sub("", part)))
        return instant <= d.names(step)

    return any(branch(part) for part in expr.split(" or "))


def panel_tests(ds: list[Daemon], step: int) -> tuple[list[dict[str, Any]], dict[int, list[str]]]:
    """For each query of each per-node panel and top-10 panel at `step`: it answers for
    every daemon it has data from, by its instance, and for no other; each of its series
    has a legend of its own (one result per instance where the legend names only the
    instance). With the panel of each query, by how many daemons it answers for. (Failed
    writes, 1h keeps only nodes with some: none here.)"""
    board = json.loads(DASHBOARD.read_text())
    tests: list[dict[str, Any]] = []
    counts: dict[int, list[str]] = {n: [] for n in range(len(ds) + 1)}
    top = [(title, t) for title, t in fleet_targets(board, FLEET_ROWS[1]) if "> 0" not in t["expr"]]
    for title, t in node_targets(board) + top:
        expr = filled(t["expr"])
        shown = [d.instance for d in ds if answers(d, expr, step)]
        counts[len(shown)].append(title)
        tests.append(
            {
                "expr": f"group by (instance) ({expr})",
                "eval_time": at(step),
                "exp_samples": [{"labels": f'{{instance="{i}"}}', "value": 1} for i in shown],
            }
        )
        legend = sorted(set(re.findall(r"\{\{(\w+)\}\}", t["legendFormat"])))
        tests.append(
            {
                "expr": f"count by (instance) ({expr})"
                f" - count by (instance) (count by ({', '.join(legend)}) ({expr}))",
                "eval_time": at(step),
                "exp_samples": [{"labels": f'{{instance="{i}"}}', "value": 0} for i in shown],
            }
        )
    return tests, counts


def fleet_tests(step: int, values: dict[str, float | None]) -> list[dict[str, Any]]:
    """Each fleet panel named in `values` at `step`: its figure (summed: one per version and
    policy), or, for None, a tick age under FRESH_S."""
    board = json.loads(DASHBOARD.read_text())
    queries = dict(fleet_targets(board, FLEET_ROWS[0]))
    tests = []
    for title, value in values.items():
        expr = f"sum({filled(queries[title]['expr'])})"
        if value is None:  # fresh: 1 where under FRESH_S, else nothing
            expr = f"0 * (({expr}) >= 0 < {FRESH_S}) + 1"
        expected = [{"labels": "{}", "value": 1 if value is None else value}]
        tests.append({"expr": expr, "eval_time": at(step), "exp_samples": expected})
    return tests


def stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (state T in /proc/PID/task/*/stat)."""
    states = [
        stat.read_text().rsplit(")", 1)[1].split()[0]
        for stat in Path(f"/proc/{pid}/task").glob("*/stat")
    ]
    return bool(states) and all(s == "T" for s in states)


def fresh_age(d: Daemon) -> float:
    """Seconds from its last tick to its last scrape."""
    last = d.scrapes[-1]
    assert last is not None
    (stamp,) = [v for n, _, v in samples(last[1]) if n == "nodeagent_last_tick_timestamp_seconds"]
    return last[0] - stamp


def refused_reload(d: Daemon) -> bool:
    """Whether the daemon's endpoint says its last reload was refused."""
    text = d.get(ANSWER_TIMEOUT_S) or ""
    return "\nnodeagent_config_last_reload_successful 0.0\n" in text


def test_the_dashboard_shows_each_of_three_daemons_and_the_one_that_stopped(
    daemons: dict[str, Daemon], tmp_path: Path
) -> None:
    a, b, c = daemons["node-a"], daemons["node-b"], daemons["node-c"]
    every = [a, b, c]
    began = time.monotonic()
    for d in every:
        d.scrape(1, START_S)
    policy = tmp_path / c.name / "policy.yaml"
    policy.write_text(yaml.safe_dump({**yaml.safe_load(policy.read_text()), **BROKEN}))
    c.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: refused_reload(c), WAIT_S, "node-c refused the reload of a broken policy")
    for _ in range(UP - 1):
        for d in every:
            d.scrape(TICKS, WAIT_S)
    ages = {d.name: fresh_age(d) for d in every}
    b.proc.send_signal(signal.SIGSTOP)
    # stopped once every thread of it is (each stops when it next runs, later on a busy host):
    # a scrape sent before that could be answered (seen once, in a full run beside the build)
    wait_for(lambda: stopped(b.proc.pid), 30, "node-b stopped by SIGSTOP")
    with ThreadPoolExecutor(1) as pool:  # node-b's scrape runs out its timeout meanwhile
        for _ in range(DOWN):
            answer = pool.submit(b.get, STOPPED_TIMEOUT_S)
            a.scrape(TICKS, WAIT_S)
            c.scrape(TICKS, WAIT_S)
            assert answer.result() is None, "node-b answered a scrape while stopped"
            b.scrapes.append(None)
    scraped_s = time.monotonic() - began
    b.proc.send_signal(signal.SIGCONT)
    assert b.get(ANSWER_TIMEOUT_S) is not None, "node-b answers again once continued"

    all_up, last = UP - 1, STEPS - 1
    tests, at_all = panel_tests(every, all_up)
    more, at_last = panel_tests(every, last)
    board = json.loads(DASHBOARD.read_text())
    (up,) = [filled(t["expr"]) for title, t in node_targets(board) if title == "Up"]
    (age,) = [filled(t["expr"]) for title, t in node_targets(board) if title == "Last tick"]
    fresh = f"0 * (({age}) >= 0 < {FRESH_S}) + 1"

    def each(expr: str, step: int, values: dict[Daemon, int], name: str = "") -> dict[str, Any]:
        return {
            "expr": expr,
            "eval_time": at(step),
            "exp_samples": [
                {"labels": f'{name}{{instance="{d.instance}", job="{JOB}"}}', "value": v}
                for d, v in values.items()
            ],
        }

    common = {"Nodes gone (1d)": 0, "Reload failures": 1, "Nodes ticking late": 0}
    tests += [
        *more,
        each(up, all_up, {a: 1, b: 1, c: 1}, "up"),
        each(fresh, all_up, {a: 1, b: 1, c: 1}),
        each(up, last, {a: 1, b: 0, c: 1}, "up"),
        each(fresh, last, {a: 1, c: 1}),  # node-b's last tick went stale with its scrapes
        *fleet_tests(all_up, {"Nodes up": 3, "Nodes down": 0, "Worst tick age": None, **common}),
        *fleet_tests(last, {"Nodes up": 2, "Nodes down": 1, "Worst tick age": None, **common}),
        *fleet_tests(all_up, {"Versions": 3, "Policies in force": 3}),
        *fleet_tests(last, {"Versions": 2, "Policies in force": 2}),
    ]
    rules = {r["alert"]: r for r in yaml.safe_load(RULES.read_text())["groups"][0]["rules"]}
    firing_at = {
        (all_up, "NodeagentConfigReloadFailed"): [c],
        (last, "NodeagentConfigReloadFailed"): [c],
        (last, "NodeagentDown"): [b],
    }
    alerts = []
    for step in (all_up, last):
        for name, rule in rules.items():
            firing = []
            for d in firing_at.get((step, name), []):
                labels = {
                    "job": JOB,
                    "instance": d.instance,
                    "severity": rule["labels"]["severity"],
                }
                rendered = alert_annotations(rule, {**labels, "alertname": name})
                firing.append({"exp_labels": labels, "exp_annotations": rendered})
            alerts.append({"alertname": name, "eval_time": at(step), "exp_alerts": firing})
    began_promtool = time.monotonic()
    promtool_test(
        tmp_path,
        as_series(every),
        {"promql_expr_test": tests, "alert_rule_test": alerts},
        rule_files=[RULES],
    )
    queries = sum(len(v) for v in at_all.values())
    print(
        f"\n3 daemons ({', '.join(d.instance for d in every)}), {STEPS} scrapes each ({UP} of"
        f" all, then {DOWN} with node-b stopped) in {scraped_s:.1f} s; ages of the last tick"
        f" at scrape {all_up}: {', '.join(f'{n} {s:.3f} s' for n, s in ages.items())}"
        f"\n{queries} per-node and top-10 panel queries at scrape {all_up}:"
        f" {len(at_all[3])} answer for all three, {len(at_all[2])} for two, {len(at_all[1])}"
        f" for one ({', '.join(sorted(set(at_all[1])))}), {len(at_all[0])} for none"
        f" ({', '.join(sorted(set(at_all[0])))}); at scrape {last}: {len(at_last[2])} for"
        f" node-a and node-c, {len(at_last[3])} for all three"
        f" ({', '.join(sorted(set(at_last[3])))})"
        f"\n{len(tests)} promql and {len(alerts)} alert tests passed"
        f" (promtool {time.monotonic() - began_promtool:.1f} s)"
    )

    for d in every:
        d.proc.terminate()
        assert d.proc.wait(timeout=60) == 0, d.tail()
        assert "Traceback" not in d.log.read_text(), d.tail()
