"""`nodeagent release` and what it hands back from (issue 13, item 4), over a plain directory
tree standing in for the cgroup root and a recording stand-in for systemd's D-Bus API; the
real kernel and systemd run it in tests/kernel/test_service.py."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from daemon_api import ROOT, daemon

from nodeagent import state
from nodeagent.cgroupfs.tree import CgroupDir, CgroupTree
from nodeagent.cgroupfs.values import Attribute
from nodeagent.cli import main
from nodeagent.daemon import open_agent, serve
from nodeagent.errors import NodeagentError
from nodeagent.originals import Originals
from nodeagent.ownership import WriteMode
from nodeagent.policyfile.load import load_policy
from nodeagent.policyfile.model import AgentSettings
from nodeagent.release import pending_job, release, stopped_for_good
from nodeagent.sdbus import NoBus

SCOPE = "system.slice/docker-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope"
JOB = "nodeagent.slice/train"
pytestmark = pytest.mark.usefixtures("files_replace_their_value")


class Units:
    """systemd's side, recorded."""

    def __init__(self, down: bool = False) -> None:
        self.calls: list[tuple[str, str, object]] = []
        self.down = down

    def unit_for_cgroup(self, cgroup: str) -> str:
        if self.down:
            raise NoBus("no D-Bus: test")
        return cgroup.rsplit("/", 1)[-1]

    def set_unit_properties(
        self, unit: str, properties: Mapping[str, int], *, runtime: bool = True
    ) -> None:
        self.calls.append(("set", unit, dict(properties)))

    def freeze_unit(self, unit: str, frozen: bool) -> None:
        self.calls.append(("freeze", unit, frozen))


def cgroup(root: Path, path: str, **files: str) -> Path:
    d = root / path
    d.mkdir(parents=True)
    (d / "cgroup.procs").write_text("")  # every cgroup has it: a file absent beside it is off
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text + "\n")
    return d


def originals(*writes: tuple[str, Attribute, str, str, WriteMode]) -> dict[str, Any]:
    o = Originals()
    for path, attribute, old, new, via in writes:
        o.note(path, attribute, old, new, via)
    return o.dump()


def saved(**kw: Any) -> state.SavedState:
    return state.SavedState(1.0, {}, **kw)


def test_originals_keep_the_first_old_value_and_drop_one_written_back() -> None:
    o = Originals()
    o.note("a", Attribute.CPU_MAX, "max 100000", "50000 100000", WriteMode.DIRECT)
    o.note("a", Attribute.CPU_MAX, "50000 100000", "20000 100000", WriteMode.DIRECT)
    o.note("a", Attribute.FREEZE, "0", "1", WriteMode.DIRECT)
    o.note("a", Attribute.FREEZE, "1", "0", WriteMode.DIRECT)  # thawed by the agent itself
    o.note("b", Attribute.CPU_WEIGHT, None, "300", WriteMode.DIRECT)  # old unknown: nothing
    o.note("c", Attribute.CPU_WEIGHT, "100", "300", WriteMode.READ_ONLY)
    assert o.dump() == {
        "a": {"cpu.max": {"was": "max 100000", "set": "20000 100000", "via": "direct"}}
    }
    again = Originals.load(o.dump())
    assert again.items() == o.items()
    o.forget(["a"])
    assert len(o) == 0


def test_each_dump_shows_every_change_since_the_last() -> None:
    """Each save dumps every original (made anew: keeping the last dump cost about 1 MB at
    1,000 workloads); any note, drop or forget shows in the next one."""
    o = Originals()
    o.note("a", Attribute.CPU_MAX, "max 100000", "50000 100000", WriteMode.DIRECT)
    assert (
        o.dump()
        == o.dump()
        == {"a": {"cpu.max": {"was": "max 100000", "set": "50000 100000", "via": "direct"}}}
    )
    o.note("a", Attribute.CPU_MAX, "50000 100000", "20000 100000", WriteMode.DIRECT)
    assert o.dump()["a"]["cpu.max"]["set"] == "20000 100000"
    o.note("b", Attribute.CPU_WEIGHT, "100", "300", WriteMode.DIRECT)
    assert set(o.dump()) == {"a", "b"}
    o.drop("b", Attribute.CPU_WEIGHT)
    assert set(o.dump()) == {"a"}
    o.forget(["gone"])
    assert set(o.dump()) == {"a"}
    o.forget(["a"])
    assert o.dump() == {}


def test_a_malformed_original_is_dropped_alone(caplog: pytest.LogCaptureFixture) -> None:
    raw = {
        "a": {
            "cpu.max": {"was": "max 100000", "set": "1000 100000", "via": "direct"},
            "cpu.nonsense": {"was": "1", "set": "2", "via": "direct"},
            "cpu.weight": {"was": "x" * 500, "set": "2", "via": "direct"},
            "memory.max": {"was": "max", "set": "4096", "via": "read-only"},
        },
        "b": ["not", "an", "object"],
    }
    loaded = Originals.load(raw)
    assert [(p, str(a)) for p, a, _ in loaded.items()] == [("a", "cpu.max")]


def test_release_hands_back_freezes_and_caps_the_way_they_were_written(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    scope = cgroup(root, SCOPE, cpu_max="150000 100000", cgroup_freeze="1", cpu_weight="300")
    job = cgroup(root, JOB, cpu_max="10000 100000", cgroup_freeze="1")
    record = originals(
        (SCOPE, Attribute.CPU_MAX, "max 100000", "150000 100000", WriteMode.SYSTEMD),
        (SCOPE, Attribute.FREEZE, "0", "1", WriteMode.SYSTEMD),
        (SCOPE, Attribute.CPU_WEIGHT, "100", "250", WriteMode.SYSTEMD),  # changed since: 300
        (JOB, Attribute.CPU_MAX, "50000 100000", "10000 100000", WriteMode.DIRECT),
        (JOB, Attribute.FREEZE, "0", "1", WriteMode.DIRECT),
        ("gone.slice/x", Attribute.CPU_MAX, "max 100000", "1000 100000", WriteMode.DIRECT),
    )
    carry = {"protection": {"frozen": [JOB], "caps": {"batch": 0.2}}, "other": {"k": 1}}
    units, audit = Units(), []
    results, after = release(
        CgroupTree(str(root)),
        saved(carry=carry, originals=record),
        managed_root="nodeagent.slice",
        settings=AgentSettings(),
        units=units,
        audit=lambda *a: audit.append(a),
    )
    outcomes = {(r.cgroup, r.attribute): r.outcome for r in results}
    assert outcomes == {
        (SCOPE, "cpu.max"): "released",
        (SCOPE, "cgroup.freeze"): "released",
        (SCOPE, "cpu.weight"): "left",
        (JOB, "cpu.max"): "released",
        (JOB, "cgroup.freeze"): "released",
        ("gone.slice/x", "cpu.max"): "gone",
    }
    assert [r.attribute for r in results if r.cgroup == JOB] == [
        "cpu.max",
        "cgroup.freeze",
    ]  # thaw last
    assert (scope / "cpu.max").read_text() == "max 100000"
    assert (scope / "cgroup.freeze").read_text() == "0"
    assert (scope / "cpu.weight").read_text() == "300\n"  # someone else's now: left as it is
    assert (job / "cpu.max").read_text() == "50000 100000"  # the job's own limit, not max
    assert (job / "cgroup.freeze").read_text() == "0"
    unit = SCOPE.rsplit("/", 1)[-1]
    assert units.calls == [
        ("set", unit, {"CPUQuotaPerSecUSec": 2**64 - 1, "CPUQuotaPeriodUSec": 100000}),
        ("freeze", unit, False),
    ]
    assert [(a[1], a[2], a[3]) for a in audit] == [
        ("cpu.max", "10000 100000", "50000 100000"),  # parents first, then by path
        ("cpu.max", "150000 100000", "max 100000"),
        ("cgroup.freeze", "1", "0"),  # thaws last
        ("cgroup.freeze", "1", "0"),
    ]
    assert after.originals == {}  # everything handled: a later agent starts clean
    assert after.carry == {"other": {"k": 1}}


def test_without_dbus_the_file_is_written_and_the_reason_said(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    scope = cgroup(root, SCOPE, cgroup_freeze="1")
    record = originals((SCOPE, Attribute.FREEZE, "0", "1", WriteMode.SYSTEMD))
    results, _ = release(
        CgroupTree(str(root)), saved(originals=record), managed_root="nodeagent.slice",
        settings=AgentSettings(), units=Units(down=True), audit=lambda *a: None,
    )  # fmt: skip
    [r] = results
    assert r.outcome == "released" and "daemon-reload undoes" in r.detail
    assert (scope / "cgroup.freeze").read_text() == "0"


def test_a_carried_freeze_without_a_record_is_thawed_too(tmp_path: Path) -> None:
    """A state file from before originals were recorded still names what it froze."""
    root = tmp_path / "cg"
    frozen = cgroup(root, "nodeagent.slice/b-1", cgroup_freeze="1")
    results, after = release(
        CgroupTree(str(root)), saved(carry={"protection": {"frozen": ["nodeagent.slice/b-1"]}}),
        managed_root="nodeagent.slice", settings=AgentSettings(), units=Units(),
        audit=lambda *a: None,
    )  # fmt: skip
    assert [(r.cgroup, r.attribute, r.outcome) for r in results] == [
        ("nodeagent.slice/b-1", "cgroup.freeze", "released")
    ]
    assert (frozen / "cgroup.freeze").read_text() == "0"
    assert after.carry == {}


def test_only_the_named_cgroups(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    a = cgroup(root, "nodeagent.slice/a", cpu_max="1000 100000")
    b = cgroup(root, "nodeagent.slice/b", cpu_max="1000 100000")
    record = originals(
        *[(f"nodeagent.slice/{n}", Attribute.CPU_MAX, "max 100000", "1000 100000", WriteMode.DIRECT)
          for n in "ab"]
    )  # fmt: skip
    _, after = release(
        CgroupTree(str(root)), saved(originals=record), managed_root="nodeagent.slice",
        settings=AgentSettings(), units=Units(), audit=lambda *a: None,
        only=["nodeagent.slice/a"],
    )  # fmt: skip
    assert (a / "cpu.max").read_text() == "max 100000"
    assert (b / "cpu.max").read_text() == "1000 100000\n"
    assert list(after.originals) == ["nodeagent.slice/b"]


@pytest.mark.parametrize(
    ("job", "result", "expected"),
    [
        ("restart", "success", False),  # systemctl restart: the stop phase of a restart job
        ("stop", "success", True),  # systemctl stop, disable --now
        ("stop", "timeout", True),  # stopped for good, if killed after TimeoutStopSec
        ("", "success", True),  # it exited by itself: Restart=on-failure does not restart it
        ("", "signal", False),  # a crash: Restart= follows
        ("", "watchdog", False),
        ("start", "exit-code", False),  # ExecStartPre= failed: Restart= follows
        (None, "success", False),  # systemd could not be asked
    ],
)
def test_stopped_for_good(job: str | None, result: str, expected: bool) -> None:
    assert stopped_for_good(job, result)[0] is expected


def test_pending_job_reads_systemctl_list_jobs() -> None:
    class Done:
        def __init__(self, rc: int, out: str) -> None:
            self.returncode, self.stdout = rc, out

    def answer(rc: int, out: str) -> Any:
        return lambda *a, **k: Done(rc, out)

    assert (
        pending_job("nodeagent.service", answer(0, "74 nodeagent.service restart running\n"))
        == "restart"
    )
    assert pending_job("nodeagent.service", answer(0, "9 other.service stop waiting\n")) == ""
    assert pending_job("nodeagent.service", answer(1, "")) is None


def _state_file(tmp_path: Path, root: Path, **kw: Any) -> Path:
    policy = tmp_path / "policy.yaml"
    path = tmp_path / "state.json"
    policy.write_text(
        f"version: 1\nagent:\n  state_file: {path}\n  socket: {tmp_path / 'none.sock'}\n"
        "tenants:\n  t: {shares: 1}\n"
    )
    state.save(str(path), saved(**kw))
    return policy


def test_the_command_releases_updates_the_state_file_and_says_so(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    b = cgroup(root, "nodeagent.slice/b", cpu_max="1000 100000", cgroup_freeze="1")
    record = originals(
        ("nodeagent.slice/b", Attribute.CPU_MAX, "max 100000", "1000 100000", WriteMode.DIRECT),
        ("nodeagent.slice/b", Attribute.FREEZE, "0", "1", WriteMode.DIRECT),
    )
    policy = _state_file(tmp_path, root, originals=record)
    args = ["release", "--all", "--config", str(policy), "--cgroup-root", str(root)]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    assert "released  nodeagent.slice/b  cgroup.freeze 1 -> 0" in out.output
    assert out.output.splitlines()[-1].startswith("nodeagent release: 2 released;")
    assert (b / "cgroup.freeze").read_text() == "0"
    loaded = state.load(str(tmp_path / "state.json"))
    assert loaded is not None and loaded.originals == {}
    again = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    assert (again["apiVersion"], again["kind"], again["results"]) == ("nodeagent/v1", "Release", [])


def test_the_command_writes_json_records_as_the_daemon_logs_them(tmp_path: Path) -> None:
    """ExecStopPost= under NODEAGENT_LOG_FORMAT=json: every line a record, as the daemon's
    (issue 36, item 9)."""
    root = tmp_path / "cg"
    cgroup(root, "nodeagent.slice/b", cpu_max="1000 100000")
    record = originals(
        ("nodeagent.slice/b", Attribute.CPU_MAX, "max 100000", "1000 100000", WriteMode.DIRECT),
    )
    policy = _state_file(tmp_path, root, originals=record)
    args = ["release", "--all", "--config", str(policy), "--cgroup-root", str(root)]
    out = CliRunner().invoke(main, args, env={"NODEAGENT_LOG_FORMAT": "json"})
    assert out.exit_code == 0, out.output
    records = [json.loads(line) for line in out.output.splitlines()]
    assert [r["event"] for r in records] == ["cgroup.write", "release.result", "release.done"]
    result = records[1]
    assert (result["cgroup"], result["outcome"], result["original"]) == (
        "nodeagent.slice/b", "released", "max 100000"
    )  # fmt: skip
    assert records[2]["counts"] == {"released": 1}


def test_the_command_asks_for_cgroups_or_all(tmp_path: Path) -> None:
    out = CliRunner().invoke(main, ["release"])
    assert out.exit_code == 2 and "pass --all" in out.output


def test_as_exec_stop_post_of_a_restart_it_releases_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cg"
    b = cgroup(root, "nodeagent.slice/b", cgroup_freeze="1")
    record = originals(("nodeagent.slice/b", Attribute.FREEZE, "0", "1", WriteMode.DIRECT))
    policy = _state_file(tmp_path, root, originals=record)
    monkeypatch.setattr("nodeagent.release.pending_job", lambda unit: "restart")
    monkeypatch.setenv("SERVICE_RESULT", "success")
    args = ["release", "--all", "--config", str(policy), "--cgroup-root", str(root)]
    out = CliRunner().invoke(main, [*args, "--on-stop", "nodeagent.service"])
    assert out.exit_code == 0, out.output
    assert out.output == (
        "nodeagent release: nodeagent.service: a restart is queued:"
        " the next agent keeps what this one set\n"
    )
    assert (b / "cgroup.freeze").read_text() == "1\n"


def test_a_jobs_save_dumps_the_originals_on_the_loops_thread_where_it_notes_its_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's start saves the state file at once. It once did so on its API thread while
    the loop noted writes and handed values back ("dictionary changed size during iteration",
    and the save was skipped), and a lock made the two take turns. Now the start is a
    command the loop runs between its ticks: every note and every dump of the originals is
    on the loop's thread, which is why Originals has no lock."""
    d = daemon(tmp_path, {"agent": {"interval": "1s"}})
    threads: set[tuple[str, int]] = set()
    for name in ("note", "dump"):
        real = getattr(Originals, name)

        def on_thread(self: Originals, *args: Any, _real: Any = real, _name: str = name) -> Any:
            threads.add((_name, threading.get_ident()))
            return _real(self, *args)

        monkeypatch.setattr(Originals, name, on_thread)
    loop = threading.Thread(target=d.agent.run)
    loop.start()
    try:
        for i in range(5):
            d.start(ROOT, f"j{i}", memory=64 << 20)
            (d.root / "nodeagent.slice" / f"j{i}" / "memory.max").write_text("max\n")  # drift
        deadline = time.monotonic() + 30
        while {n for n, _ in threads} != {"note", "dump"} and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        d.agent.stop.set()
        loop.join(30)
    assert not loop.is_alive()
    assert {n for n, _ in threads} == {"note", "dump"}, "the loop noted writes and saved"
    assert {t for _, t in threads} == {loop.ident}, "noted and dumped on the loop's thread alone"


def test_a_broken_policy_file_does_not_keep_the_freezes_after_a_stop(tmp_path: Path) -> None:
    """As ExecStopPost= of `systemctl stop` with a policy file the operator broke meanwhile:
    release says the file's error in one line and hands back with the default agent settings
    (here --state-file names the state), instead of refusing and leaving cgroups frozen."""
    root = tmp_path / "cg"
    b = cgroup(root, "nodeagent.slice/b", cgroup_freeze="1")
    record = originals(("nodeagent.slice/b", Attribute.FREEZE, "0", "1", WriteMode.DIRECT))
    policy = _state_file(tmp_path, root, originals=record)
    policy.write_text("version: 1\ntenants:\n  t: {shares: -1}\n")
    args = ["release", "--all", "--config", str(policy), "--cgroup-root", str(root)]
    out = CliRunner().invoke(main, [*args, "--state-file", str(tmp_path / "state.json")])
    assert out.exit_code == 0, out.output
    warning = [line for line in out.stderr.splitlines() if not line.startswith("{")]  # not audit
    assert len(warning) == 1 and warning[0].startswith(f"nodeagent release: {policy}:3:"), warning
    assert "handing back with the default agent settings" in warning[0]
    assert (b / "cgroup.freeze").read_text() == "0"


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch) -> set[tuple[str, str]]:
    """Interface files whose writes fail, as (cgroup, file): opened for writing, such a
    file is /dev/full, whose every write(2) fails (ENOSPC), as a write the kernel refuses
    fails (a stand-in: a plain directory tree cannot refuse a write to root)."""
    failing: set[tuple[str, str]] = set()
    opened = CgroupDir._open_file

    def open_file(self: CgroupDir, name: str, mode: int) -> int:
        if mode & os.O_WRONLY and (self.path, name) in failing:
            return os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        return opened(self, name, mode)

    monkeypatch.setattr(CgroupDir, "_open_file", open_file)
    return failing


def released(root: Path, before: state.SavedState, **kw: Any) -> tuple[list[Any], state.SavedState]:
    return release(
        CgroupTree(str(root)), before, managed_root="nodeagent.slice", settings=AgentSettings(),
        units=Units(), audit=kw.pop("audit", lambda *a: None), **kw,
    )  # fmt: skip


def test_an_original_already_back_is_already_and_its_record_dropped(tmp_path: Path) -> None:
    """Someone (or the agent itself) put the original back: nothing is written or audited,
    and the record goes, as one handed back does."""
    root = tmp_path / "cg"
    a = cgroup(root, "nodeagent.slice/a", cpu_max="max 100000", cgroup_freeze="0")
    record = originals(
        ("nodeagent.slice/a", Attribute.CPU_MAX, "max 100000", "1000 100000", WriteMode.DIRECT),
        ("nodeagent.slice/a", Attribute.FREEZE, "0", "1", WriteMode.DIRECT),
    )
    audit: list[object] = []
    results, after = released(root, saved(originals=record), audit=lambda *x: audit.append(x))
    assert [(r.attribute, r.outcome, r.now) for r in results] == [
        ("cpu.max", "already", "max 100000"),
        ("cgroup.freeze", "already", "0"),
    ]
    assert audit == [] and after.originals == {}
    assert (a / "cpu.max").read_text() == "max 100000\n"  # not written


def test_a_write_that_fails_is_failed_and_its_record_kept_for_the_next_try(
    tmp_path: Path, refusing: set[tuple[str, str]]
) -> None:
    root = tmp_path / "cg"
    a = cgroup(root, "nodeagent.slice/a", cpu_max="1000 100000", cpu_weight="50")
    record = originals(
        ("nodeagent.slice/a", Attribute.CPU_MAX, "max 100000", "1000 100000", WriteMode.DIRECT),
        ("nodeagent.slice/a", Attribute.CPU_WEIGHT, "100", "50", WriteMode.DIRECT),
    )
    refusing.add(("nodeagent.slice/a", "cpu.max"))
    results, after = released(root, saved(originals=record))
    outcomes = {r.attribute: (r.outcome, r.detail) for r in results}
    assert outcomes == {
        "cpu.max": (
            "failed",
            "cgroup nodeagent.slice/a: writing 'max 100000' to cpu.max failed:"
            " No space left on device",
        ),
        "cpu.weight": ("released", ""),
    }
    assert after.originals == {
        "nodeagent.slice/a": {
            "cpu.max": {"was": "max 100000", "set": "1000 100000", "via": "direct"}
        }
    }
    refusing.clear()  # the next try, once the write goes through
    [again], last = released(root, after)
    assert (again.attribute, again.outcome) == ("cpu.max", "released")
    assert (a / "cpu.max").read_text() == "max 100000" and last.originals == {}


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "carried-only"])
def test_a_thaw_that_fails_keeps_the_carried_freeze(
    tmp_path: Path, refusing: set[tuple[str, str]], recorded: bool
) -> None:
    """The protection controller's carried state names what it froze: dropped only once
    every thaw went through, so that a thaw that failed is tried again by the next release
    (or undone by the next agent) even when no record of the freeze exists."""
    root = tmp_path / "cg"
    frozen = cgroup(root, "nodeagent.slice/b", cgroup_freeze="1")
    carry = {"protection": {"frozen": ["nodeagent.slice/b"]}}
    record = (
        originals(("nodeagent.slice/b", Attribute.FREEZE, "0", "1", WriteMode.DIRECT))
        if recorded
        else {}
    )
    refusing.add(("nodeagent.slice/b", "cgroup.freeze"))
    [r], after = released(root, saved(carry=carry, originals=record))
    assert (r.attribute, r.outcome) == ("cgroup.freeze", "failed")
    assert after.carry == carry and after.originals == record
    assert (frozen / "cgroup.freeze").read_text() == "1\n"
    refusing.clear()
    [r], last = released(root, after)
    assert r.outcome == "released" and last.carry == {} and last.originals == {}
    assert (frozen / "cgroup.freeze").read_text() == "0"


def test_the_command_exits_1_naming_what_failed_and_keeps_it(
    tmp_path: Path, refusing: set[tuple[str, str]]
) -> None:
    """One line per attribute (the failed one names its cgroup and why), the summary, exit
    status 1; the state file keeps what failed, and the next run hands it back (exit 0)."""
    root = tmp_path / "cg"
    b = cgroup(root, "nodeagent.slice/b", cpu_max="1000 100000", cgroup_freeze="1")
    record = originals(
        ("nodeagent.slice/b", Attribute.CPU_MAX, "max 100000", "1000 100000", WriteMode.DIRECT),
        ("nodeagent.slice/b", Attribute.FREEZE, "0", "1", WriteMode.DIRECT),
    )
    policy = _state_file(tmp_path, root, originals=record)
    refusing.add(("nodeagent.slice/b", "cpu.max"))
    args = ["release", "--all", "--config", str(policy), "--cgroup-root", str(root)]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 1, out.output
    path = tmp_path / "state.json"
    assert out.stdout.splitlines() == [
        "failed    nodeagent.slice/b  cpu.max  (cgroup nodeagent.slice/b: writing"
        " 'max 100000' to cpu.max failed: No space left on device)",
        "released  nodeagent.slice/b  cgroup.freeze 1 -> 0",
        f"nodeagent release: 1 failed, 1 released; {path} updated",
    ]
    kept = state.load(str(path))
    assert kept is not None and list(kept.originals) == ["nodeagent.slice/b"]
    assert list(kept.originals["nodeagent.slice/b"]) == ["cpu.max"]
    refusing.clear()
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    assert (
        again.stdout.splitlines()[0]
        == "released  nodeagent.slice/b  cpu.max 1000 100000 -> max 100000"
    )
    assert (b / "cpu.max").read_text() == "max 100000"


@pytest.mark.parametrize(
    ("api", "dry_run"),
    [(True, False), (False, False), (True, True)],
    ids=["serving-its-api", "no-api", "dry-run-serving-its-api"],
)
def test_refused_while_a_daemon_runs(tmp_path: Path, api: bool, dry_run: bool) -> None:
    """A daemon beside it would apply its policy again at its next tick: refused (exit 1,
    nothing handed back, the state file as it was) while one runs on this state file,
    with its API on the policy's socket or with none (--no-api); a dry-run daemon, which
    marks nothing, is known by its API's answer. Once it stops, release goes ahead."""
    root = tmp_path / "cg"
    b = cgroup(root, "nodeagent.slice/b", cgroup_freeze="1")
    record = originals(("nodeagent.slice/b", Attribute.FREEZE, "0", "1", WriteMode.DIRECT))
    policy = _state_file(tmp_path, root, originals=record)
    agent = open_agent(
        load_policy(policy), CgroupTree(str(root)), dry_run=dry_run, config_path=str(policy)
    )
    server = serve(agent) if api else None
    ticked = threading.Event()
    loop = threading.Thread(target=agent.run, kwargs={"on_tick": lambda _: ticked.set()})
    loop.start()
    args = ["release", "--all", "--config", str(policy), "--cgroup-root", str(root)]
    try:
        assert ticked.wait(60), "the daemon's first tick, within 60 s"
        out = CliRunner().invoke(main, args)
    finally:
        agent.stop.set()
        loop.join(60)
        if server is not None:
            server.close()
    assert not loop.is_alive(), "the daemon's loop stops within 60 s of its stop"
    assert isinstance(out.exception, NodeagentError), out.output
    assert str(out.exception).startswith("nodeagent is running "), out.exception
    assert ("(pid " in str(out.exception)) is dry_run  # the API's answer, not the mark
    assert out.stdout == ""
    assert (b / "cgroup.freeze").read_text() == "1\n"
    kept = state.load(str(tmp_path / "state.json"))
    assert kept is not None and list(kept.originals) == ["nodeagent.slice/b"]
    after = CliRunner().invoke(main, args)
    assert after.exit_code == 0, after.output
    assert (b / "cgroup.freeze").read_text() == "0"
