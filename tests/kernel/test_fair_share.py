"""The fair-share scenario on a real kernel: tenants with shares 2:1, where the
2-share tenant runs one cgroup with 2 busy processes and the other runs 4
cgroups of 1 busy process each. Without the agent the kernel splits CPU per
cgroup (about 1:4); with it the split follows the shares.

The six processes run on two CPUs whatever the host has (a cpuset on the sandbox, the rest
reserved for the system in the policy), so that they compete and the test means the same in
the 2-CPU VM and on a larger native host."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, agent, busy, rel, spec, usage_us, wait_for

WINDOW = float(os.environ.get("NODEAGENT_SPLIT_WINDOW", "30"))


def split(cgroups: dict[str, list[Path]], seconds: float) -> dict[str, float]:
    """CPU seconds each tenant used over `seconds` of wall time."""
    before = {t: sum(usage_us(c) for c in cs) for t, cs in cgroups.items()}
    time.sleep(seconds)
    return {t: (sum(usage_us(c) for c in cs) - before[t]) / 1e6 for t, cs in cgroups.items()}


@pytest.fixture
def scenario(cgroup_sandbox: str) -> Iterator[tuple[str, dict[str, list[Path]]]]:
    managed = rel(cgroup_sandbox) + "/managed"
    base = Path(ROOT, managed)
    base.mkdir()
    for controller in ("cpu", "memory"):
        Path(base, "cgroup.subtree_control").write_text(f"+{controller}")
    cgroups = {"a": [base / "a-0"], "b": [base / f"b-{i}" for i in range(4)]}
    procs: list[subprocess.Popen[bytes]] = []
    for c in cgroups["a"] + cgroups["b"]:
        c.mkdir()
    procs += [busy(cgroups["a"][0]), busy(cgroups["a"][0])]
    procs += [busy(c) for c in cgroups["b"]]
    yield managed, cgroups
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.nightly
def test_cpu_split_follows_shares_not_cgroup_count(
    two_cpus: float, scenario: tuple[str, dict[str, list[Path]]], tmp_path: Path
) -> None:
    managed, cgroups = scenario
    time.sleep(1)
    without = split(cgroups, 10)
    ratio_without = without["a"] / without["b"]
    assert ratio_without < 0.5, f"kernel default should favour the 4-cgroup tenant: {without}"

    policy = spec(
        managed,
        tmp_path,
        node={"reserved_cpu": two_cpus},
        tenants={"a": {"shares": 2}, "b": {"shares": 1}},
        rules=[
            {"name": "a", "match": {"name": "a-*"}, "tenant": "a"},
            {"name": "b", "match": {"name": "b-*"}, "tenant": "b"},
        ],
    )
    a = agent(policy)
    loop = threading.Thread(target=a.run, daemon=True)
    loop.start()
    try:
        assert wait_for(lambda: a.rec.last is not None and a.rec.last.snapshot.seq >= 3, timeout=30)
        with_agent = split(cgroups, WINDOW)
    finally:
        a.stop.set()
        loop.join(timeout=10)
    ratio = with_agent["a"] / with_agent["b"]
    print(f"a:b without agent {ratio_without:.2f} {without}")
    print(f"a:b with agent {ratio:.2f} {with_agent}")
    assert 1.8 <= ratio <= 2.2, f"with the agent a:b should be 2:1 within 10%, got {ratio:.2f}"
