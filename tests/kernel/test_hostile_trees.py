"""Hostile cgroup trees, on a real kernel: odd names, planted symlinks, garbage in files.

A name the kernel allows (glob characters, control characters, bytes that are not UTF-8,
255 bytes) is a workload like any other: managed, and logged as one JSON line. A newline
the kernel refuses, so a tree where one appears (a fixture directory, through the
injectable root) is managed the same. Symlinks cannot be made in cgroupfs, so they are
planted with a tmpfs mounted over a cgroup; interface files with unexpected content are
bind-mounted over the real ones. Either way the cgroup is skipped with a logged reason
naming it, nothing is written through the symlink, and every other workload is still
managed in the same tick.
"""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
from helpers import ROOT, agent, bind, mount_tmpfs, rel, spec

from nodeagent import logs
from nodeagent.act import Outcome
from nodeagent.api.wire import encode
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import open_agent
from nodeagent.discovery.registry import Registry
from nodeagent.report import TickRecord, allocations

LIMITS = {"cpu_max": 1, "memory_max": "1Gi"}
CPU_MAX, MEMORY_MAX = "100000 100000", str(1 << 30)


def capped(managed: str) -> dict[str, object]:
    return {
        "tenants": {"a": {"shares": 1}},
        "rules": [
            {"name": "jobs", "match": {"path": f"{managed}/*"}, "tenant": "a", "limits": LIMITS}
        ],
    }


def written(record: TickRecord) -> dict[str, set[str]]:
    """Per cgroup path, the attributes written this tick."""
    out: dict[str, set[str]] = {}
    for r in record.results:
        if r.outcome is Outcome.WRITTEN:
            out.setdefault(r.path, set()).add(str(r.attribute))
    return out


def json_log_lines(tick: Callable[[], object]) -> list[dict[str, object]]:
    """Run `tick` with the daemon's JSON logging; every line it logs, parsed. A line that is
    not one JSON object (a raw newline in a name) fails the test here."""
    out = io.StringIO()
    logs.configure("info", fmt="json")
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=out))
    try:
        tick()
    finally:
        structlog.reset_defaults()
    return [json.loads(line) for line in out.getvalue().splitlines()]


ODD_NAMES = [
    "job-*",
    "job-?",
    "[",
    "[!a-z]",
    "*",
    "job\ttab",
    "job\x1b[31mred\x07",
    "job\r",
    "x" * 255,
    "é" * 127 + "x",  # 255 bytes of UTF-8
]
NOT_UTF8 = [b"job-\xff\xfe", b"\xc3\x28", b"\x80" * 255]


def test_names_the_kernel_allows_are_managed_and_logged_on_one_line(
    managed: str, tmp_path: Path
) -> None:
    a = agent(spec(managed, tmp_path, **capped(managed)))
    base = Path(ROOT, managed)
    (base / "ok").mkdir()
    for name in ODD_NAMES:
        (base / name).mkdir()
    for raw in NOT_UTF8:
        os.mkdir(os.fsencode(base) + b"/" + raw)
    a.rec.registry.resync()

    records: list[TickRecord] = []
    lines = json_log_lines(lambda: records.append(a.tick()))
    record = records[0]

    names = [*ODD_NAMES, *(os.fsdecode(raw) for raw in NOT_UTF8), "ok"]
    assert len(os.fsencode(names[8])) == len(os.fsencode(names[9])) == 255
    assert record.snapshot.skipped == ()
    done = written(record)
    for name in names:
        path = f"{managed}/{name}"
        assert done.get(path) == {"cpu.max", "memory.max"}, name
        assert (base / name / "cpu.max").read_text().strip() == CPU_MAX, name
        assert (base / name / "memory.max").read_text().strip() == MEMORY_MAX, name
    logged = {Path(str(e["path"])).parent.name for e in lines if e["event"] == "cgroup.write"}
    assert set(names) <= logged
    rows = [r for r in allocations(record)["allocations"] if not r["level"]]
    assert {r["cgroup"] for r in rows} == {f"{managed}/{n}" for n in names}
    # what the API serves: ASCII, and every name decodes back as it is (not-UTF-8 bytes as
    # the surrogates os.fsdecode gives them)
    body = encode(allocations(record))
    assert body.isascii()
    served = [r for r in json.loads(body)["allocations"] if not r["level"]]
    assert sorted(r["cgroup"] for r in served) == sorted(f"{managed}/{n}" for n in names)


def test_the_kernel_refuses_a_newline_and_a_tree_with_one_is_still_managed(
    managed: str, tmp_path: Path
) -> None:
    Path(ROOT, managed).mkdir()
    with pytest.raises(OSError) as refused:
        Path(ROOT, managed, "job\nx").mkdir()
    assert refused.value.errno == errno.EINVAL

    # the same names under the injectable root, over a fixture tree
    root = tmp_path / "cgroup"
    for name in ("managed", "managed/ok", "managed/job\nx", "managed/\n"):
        d = root / name
        d.mkdir(parents=True)
        for f, text in {
            "cgroup.procs": "",
            "cpu.max": "max 100000\n",
            "memory.max": "max\n",
        }.items():
            (d / f).write_text(text)
    a = open_agent(spec("managed", tmp_path, **capped("managed")), CgroupTree(str(root)))
    a.rec.registry.resync()
    records: list[TickRecord] = []
    lines = json_log_lines(lambda: records.append(a.tick()))
    for name in ("ok", "job\nx", "\n"):
        assert (root / "managed" / name / "cpu.max").read_text() == CPU_MAX, repr(name)
    logged = {Path(str(e["path"])).parent.name for e in lines if e["event"] == "cgroup.write"}
    assert {"ok", "job\nx", "\n"} <= logged


def test_symlinks_planted_in_a_cgroup_are_never_followed(
    managed: str, tmp_path: Path, mounts: list[Path]
) -> None:
    """A tmpfs over `planted` whose interface files are symlinks to `victim`'s: the agent
    must skip `planted`, not write its limit into `victim` through the links."""
    policy = spec(
        managed,
        tmp_path,
        tenants={"a": {"shares": 1}},
        rules=[
            {
                "name": "planted",
                "match": {"name": "planted"},
                "tenant": "a",
                "limits": {"cpu_max": 0.2},
            },
            {"name": "rest", "match": {}, "tenant": "a", "limits": LIMITS},
        ],
    )
    a = agent(policy)
    base = Path(ROOT, managed)
    victim, planted, ok = base / "victim", base / "planted", base / "ok"
    for d in (victim, planted, ok):
        d.mkdir()
    mount_tmpfs(planted, mounts)
    (planted / "cgroup.procs").write_text("")
    for f in ("cgroup.events", "cpu.stat", "cpu.max", "cpu.weight", "memory.max", "memory.high"):
        (planted / f).symlink_to(victim / f)
    a.rec.registry.resync()

    with structlog.testing.capture_logs() as events:
        record = a.tick()
    skipped = {s.path: s.reason for s in record.snapshot.skipped}
    assert set(skipped) == {rel(planted)}
    assert "symlink" in skipped[rel(planted)] and rel(planted) in skipped[rel(planted)]
    assert {(e["event"], e["cgroup"]) for e in events if e["event"] == "cgroup.skipped"} == {
        ("cgroup.skipped", rel(planted))
    }
    assert (victim / "cpu.max").read_text().strip() == CPU_MAX, "written through a symlink"
    assert written(record)[rel(ok)] == {"cpu.max", "memory.max"}
    assert written(record)[rel(victim)] == {"cpu.max", "memory.max"}


def test_a_symlinked_workload_directory_is_not_followed(
    cgroup_sandbox: Path, tmp_path: Path, mounts: list[Path]
) -> None:
    """A pod whose directory is a tmpfs holding a 'container' that is a symlink to another
    pod's container: discovery logs it and does not follow it, so nothing is written
    through it, and the rest of the tree is managed in the same tick."""
    root = cgroup_sandbox
    pod = root / "kubepods" / "besteffort" / "pod0b6a1b3e-6f3c-4a57-9b8e-2d6a3f1e9c11"
    other = root / "kubepods" / "besteffort" / "pod1c7b2c4f-7a4d-4b68-8c9f-3e7b4a2f0d22"
    victim = other / ("cd" * 32)
    victim.mkdir(parents=True)
    pod.mkdir()
    for d in (root / "kubepods", root / "kubepods" / "besteffort", other):
        for c in ("cpu", "memory"):
            (d / "cgroup.subtree_control").write_text(f"+{c}")
    mount_tmpfs(pod, mounts)
    (pod / ("ab" * 32)).symlink_to(victim)
    policy = spec(
        "managed",
        tmp_path,
        tenants={"a": {"shares": 1}},
        rules=[
            {
                "name": "in-pod",
                "match": {"pod_uid": pod.name[3:]},
                "tenant": "a",
                "limits": {"cpu_max": 0.2},
            },
            {"name": "rest", "match": {"kind": "container"}, "tenant": "a", "limits": LIMITS},
        ],
    )
    a = open_agent(policy, CgroupTree(str(root)))
    with structlog.testing.capture_logs() as events:
        a.prepare()
        record = a.tick()
    link = str((pod / ("ab" * 32)).relative_to(root))
    assert [(e["cgroup"], e["reason"]) for e in events if e["event"] == "discovery.skipped"] == [
        (link, "a symlink (cgroupfs has none): not followed")
    ]
    assert (victim / "cpu.max").read_text().strip() == CPU_MAX, "written through a symlink"
    assert written(record)[str(victim.relative_to(root))] == {"cpu.max", "memory.max"}
    assert link not in {w.path for w in record.snapshot.workloads}


# Interface files with unexpected content: each a job of its own, one file replaced.
GARBAGE: dict[str, bytes] = {
    "cpu.max": b"lots 100000\n",
    "cpu.weight": b"10001\n",
    "memory.max": b"-5\n",
    "memory.high": b"12ab\n",
    "cgroup.events": b"populated maybe\n",
    "cpu.pressure": b"some avg10=x avg60=0 avg300=0 total=0\n",
    "memory.stat": b"anon \xff\xfe\n",
    "cgroup.freeze": b"2\n",
    "memory.events": b"oom " + b"9" * 70_000 + b"\n",
}


def test_interface_files_with_unexpected_content_skip_only_their_cgroup(
    managed: str, tmp_path: Path, mounts: list[Path]
) -> None:
    a = agent(spec(managed, tmp_path, **capped(managed)))
    base = Path(ROOT, managed)
    (base / "ok").mkdir()
    for n, (name, content) in enumerate(GARBAGE.items()):
        job = base / f"bad-{n}"
        job.mkdir()
        garbage = tmp_path / f"garbage-{n}"
        garbage.write_bytes(content)
        bind(garbage, job / name, mounts)
    a.rec.registry.resync()

    with structlog.testing.capture_logs() as events:
        record = a.tick()
    skipped = {s.path: s.reason for s in record.snapshot.skipped}
    expected = {f"{managed}/bad-{n}" for n in range(len(GARBAGE))}
    assert set(skipped) == expected, {
        n: skipped.get(f"{managed}/bad-{i}") for i, n in enumerate(GARBAGE)
    }
    logged = {e["cgroup"]: e["reason"] for e in events if e["event"] == "cgroup.skipped"}
    assert set(logged) == expected
    for n, name in enumerate(GARBAGE):
        assert name in logged[f"{managed}/bad-{n}"], (name, logged[f"{managed}/bad-{n}"])
    assert written(record)[f"{managed}/ok"] == {"cpu.max", "memory.max"}


CAP = 1024
"""The cgroups discovery looks at below one user manager, as docs/architecture.md documents it."""


def kernel_watches(registry: Registry) -> int:
    """The inotify watches the kernel holds for the registry (its fdinfo, one line each)."""
    fd = registry.fileno()
    assert fd is not None
    text = Path(f"/proc/self/fdinfo/{fd}").read_text()
    return sum(line.startswith("inotify wd:") for line in text.splitlines())


def test_a_users_delegated_subtree_costs_a_bounded_walk_and_bounded_watches(
    cgroup_sandbox: Path,
) -> None:
    """Issue 12.19 on cgroupfs: uid 65534 owns its user manager's cgroup (Delegate=yes) and
    makes plain cgroups, which can hold no workload, and more slices than the cap. Neither
    costs watches past the cap, before or after the resync; the subtree is named once; the
    rootless container of another user is found."""
    root = cgroup_sandbox
    user = root / "user.slice/user-65534.slice/user@65534.service"
    rootless = (
        root / f"user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{'ab' * 32}.scope"
    )
    user.mkdir(parents=True)
    rootless.mkdir(parents=True)
    os.chown(user, 65534, 65534)

    def as_the_user(names: list[str]) -> None:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "mkdir"]
        subprocess.run([*argv, *(str(user / n) for n in names)], check=True)

    as_the_user([f"d{i}" for i in range(300)] + [f"s{i}.slice" for i in range(CAP + 50)])
    registry = Registry(CgroupTree(str(root)), "managed", watch=True)
    with structlog.testing.capture_logs() as events:
        registry.resync()
        as_the_user([f"t{i}.slice" for i in range(100)])
        registry.poll()
        registry.resync()
    assert str(rootless.relative_to(root)) in registry.workloads
    assert kernel_watches(registry) <= CAP + 10
    skipped = [e["cgroup"] for e in events if e["event"] == "discovery.skipped"]
    assert skipped == [str(user.relative_to(root))]
