"""Slurm jobs: found by their cgroups, their tenants from the accounts Slurm itself reports,
counted in the tenant split, and written at job level only (cpu.weight) when the operator
opts in. Slurm here is squeue's answers (a stand-in script or a recorded runner): the real
one runs in the VM (tests/kernel/test_slurm.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import structlog

from nodeagent.act import Outcome, WriteResult
from nodeagent.api.answers import Status
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute, CpuMax, Frozen
from nodeagent.daemon import Agent, open_agent
from nodeagent.discovery.layouts import classify
from nodeagent.discovery.registry import Registry
from nodeagent.discovery.scan import scan
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.ownership import WriteMode, classify_level, write_mode
from nodeagent.policy.classify import assign
from nodeagent.policy.plan import Target
from nodeagent.policyfile.load import check_text
from nodeagent.policyfile.model import AgentSettings, PolicySpec, SlurmSettings
from nodeagent.policyfile.yamlfile import PolicyError
from nodeagent.slurm import Answer, SlurmJobs, SlurmUnavailable, parse_jobs, run_command

SCOPE = "system.slice/slurmstepd.scope"
JOB_A, JOB_B = f"{SCOPE}/job_11", f"{SCOPE}/job_12"
SETTINGS = SlurmSettings(timeout=2.0, retry_interval=30.0)


def slurm_job(job_id: str, account: str | None = None) -> WorkloadIdentity:
    identity = classify(f"{SCOPE}/job_{job_id}", "nodeagent.slice")
    assert identity is not None
    return replace(identity, account=account)


class Squeue:
    """squeue's answers, recorded: each call's argv, and what to answer next (an answer, or
    what run_command raises: the deadline passed, or it could not start)."""

    def __init__(self, *answers: Answer | OSError | subprocess.TimeoutExpired) -> None:
        self.answers = list(answers)
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> Answer:
        self.calls.append(list(argv))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def listing(*lines: str) -> Answer:
    return Answer(0, "".join(f"{line}\n" for line in lines), "")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the adapter ---------------------------------------------------------------------------


def test_accounts_come_from_squeue_one_query_for_all_new_jobs_then_the_cache() -> None:
    squeue = Squeue(listing("11|physics", "12|bio"))
    slurm = SlurmJobs(squeue, Clock())
    jobs = [slurm_job("11"), slurm_job("12")]
    found = slurm.enrich(jobs, SETTINGS)
    assert [(i.job_id, i.account) for i in found] == [("11", "physics"), ("12", "bio")]
    (argv,) = squeue.calls
    assert argv == [
        "/usr/bin/squeue",
        "--noheader",
        "--states=all",
        "--jobs=11,12",
        "--format=%A|%a",
    ]
    for _ in range(3):
        assert slurm.enrich(jobs, SETTINGS) == found
    assert len(squeue.calls) == 1, "known jobs are not asked about again"


def test_only_slurm_jobs_cost_a_query() -> None:
    squeue = Squeue(listing())
    other = classify("system.slice/cron.service", "nodeagent.slice")
    assert other is not None
    assert SlurmJobs(squeue).enrich([other], SETTINGS) == [other]
    assert squeue.calls == []


def test_a_job_slurm_does_not_list_is_asked_about_again_after_the_retry_interval() -> None:
    squeue = Squeue(listing("11|physics"), listing("11|physics", "12|bio"))
    clock = Clock()
    slurm = SlurmJobs(squeue, clock)
    jobs = [slurm_job("11"), slurm_job("12")]
    assert [i.account for i in slurm.enrich(jobs, SETTINGS)] == ["physics", None]
    clock.now += 10
    slurm.enrich(jobs, SETTINGS)
    assert len(squeue.calls) == 1
    clock.now += 21
    assert [i.account for i in slurm.enrich(jobs, SETTINGS)] == ["physics", "bio"]
    assert squeue.calls[1][3] == "--jobs=12", "only the job still unknown"


def test_squeue_refusing_the_only_job_asked_is_an_unknown_job_not_an_outage() -> None:
    squeue = Squeue(Answer(1, "", "slurm_load_jobs error: Invalid job id specified\n"))
    slurm = SlurmJobs(squeue, Clock())
    assert slurm.enrich([slurm_job("99")], SETTINGS)[0].account is None
    assert slurm.problem is None


def test_no_account_is_none() -> None:
    assert parse_jobs("7|(null)\n8|\n", "squeue") == {"7": None, "8": None}


def test_an_account_with_the_separator_stays_whole() -> None:
    assert parse_jobs("7|odd|name\n", "squeue") == {"7": "odd|name"}


@pytest.mark.parametrize("line", ["7", "x7|a", "JOBID|ACCOUNT"])
def test_an_unexpected_answer_names_its_line(line: str) -> None:
    with pytest.raises(SlurmUnavailable, match=r"^squeue: line 2 is not job\|account: "):
        parse_jobs(f"1|a\n{line}\n", "squeue")


def test_slurm_not_answering_is_one_line_logged_once_and_retried_later() -> None:
    down = subprocess.TimeoutExpired("squeue", 2.0)
    squeue = Squeue(down, down, listing("11|physics"))
    clock = Clock()
    slurm = SlurmJobs(squeue, clock)
    jobs = [slurm_job("11")]
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            assert slurm.enrich(jobs, SETTINGS) == jobs, "the path identity, no account"
            clock.now += 1
        assert len(squeue.calls) == 1, "not asked again before the retry interval"
        clock.now += 30
        slurm.enrich(jobs, SETTINGS)
        clock.now += 31
        assert slurm.enrich(jobs, SETTINGS)[0].account == "physics"
    events = [(e["event"], e.get("error")) for e in logs]
    assert events == [
        ("slurm.unreachable", "/usr/bin/squeue --jobs=11: no answer in 2 s"),
        ("slurm.reachable", None),
    ]
    assert slurm.problem is None
    (reach,) = slurm.reach.now()
    assert (reach.name, reach.address, reach.up, reach.error) == (
        "slurm", "/usr/bin/squeue", True, None
    )  # fmt: skip
    assert reach.last_ok == reach.since, "up since its first answer after the outage"


def test_squeue_failing_names_the_command_and_what_it_said() -> None:
    said = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"
    slurm = SlurmJobs(Squeue(Answer(1, "", said)), Clock())
    slurm.enrich([slurm_job("11"), slurm_job("12")], SETTINGS)
    assert slurm.problem == (
        "/usr/bin/squeue --jobs=11,12: exited 1: slurm_load_jobs error: Unable to contact"
        " slurm controller (connect failure)"
    )


def test_a_missing_squeue_is_one_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope" / "squeue")
    slurm = SlurmJobs(run_command, Clock())
    slurm.enrich([slurm_job("11")], SlurmSettings(squeue=missing))
    assert slurm.problem == f"{missing} --jobs=11: No such file or directory"


def test_squeue_past_its_deadline_is_killed_and_said_so(tmp_path: Path) -> None:
    squeue = script(tmp_path, "exec sleep 30")
    slurm = SlurmJobs(run_command, Clock())
    t0 = time.monotonic()
    slurm.enrich([slurm_job("11")], SlurmSettings(squeue=squeue, timeout=0.3))
    assert time.monotonic() - t0 < 10
    assert slurm.problem == f"{squeue} --jobs=11: no answer in 0.3 s"


def test_a_long_job_list_is_cut_in_the_message() -> None:
    slurm = SlurmJobs(Squeue(Answer(1, "", "boom")), Clock())
    slurm.enrich([slurm_job(str(n)) for n in range(1000, 1100)], SETTINGS)
    assert slurm.problem is not None
    assert slurm.problem.startswith("/usr/bin/squeue --jobs=1000,1001,")
    assert "...: exited 1: boom" in slurm.problem and len(slurm.problem) < 140


def test_a_job_whose_cgroup_went_is_forgotten() -> None:
    """Slurm reuses job ids after a wrap (MaxJobId): another job, maybe another account."""
    squeue = Squeue(listing("11|physics"), listing("11|chem"))
    slurm = SlurmJobs(squeue, Clock())
    assert slurm.enrich([slurm_job("11")], SETTINGS)[0].account == "physics"
    slurm.enrich([], SETTINGS)
    assert slurm.enrich([slurm_job("11")], SETTINGS)[0].account == "chem"


# -- the real subprocess: a stand-in squeue script -----------------------------------------


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "squeue"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_run_command_passes_the_answer(tmp_path: Path) -> None:
    squeue = script(tmp_path, 'echo "11|$3"; echo oops >&2; exit 0')
    answer = run_command([squeue, "a", "b", "physics"], 5)
    assert answer == Answer(0, "11|physics\n", "oops\n")


# -- the policy ----------------------------------------------------------------------------


def test_write_modes_slurm_jobs_are_read_only_unless_opted_in() -> None:
    job = slurm_job("11")
    assert (job.kind, job.runtime, job.owner) == (Kind.JOB, Runtime.SLURM, Owner.SLURM)
    assert write_mode(job, AgentSettings()) is WriteMode.READ_ONLY
    opted = AgentSettings.model_validate({"slurm": {"cpu_weight": "write"}})
    assert write_mode(job, opted) is WriteMode.WEIGHT_ONLY
    scope = classify_level(SCOPE, "nodeagent.slice")
    assert (scope.runtime, scope.owner) == (Runtime.SLURM, Owner.SLURM)
    assert write_mode(scope, opted) is WriteMode.READ_ONLY, "the scope is slurmd's, always"


BASE = """\
version: 1
tenants: {physics: {shares: 1}}
rules:
"""


def test_a_rule_for_slurm_jobs_takes_no_limits() -> None:
    text = BASE + (
        "  - name: physics\n"
        "    match: {runtime: slurm, account: physics}\n"
        "    tenant: physics\n"
        "    limits: {memory_max: 1Gi}\n"
    )
    with pytest.raises(PolicyError) as e:
        check_text(text, "p.yaml")
    assert [str(p) for p in e.value.problems] == [
        "p.yaml:7:13: rules[0].limits: Slurm's jobs take no limits from nodeagent: slurmd sets"
        " their cpu.max, memory and cpuset; nodeagent writes at most their cpu.weight"
        " (agent.slurm.cpu_weight: write)"
    ]


def test_an_account_glob_matches_only_jobs_slurm_answered_for() -> None:
    spec = check_text(
        BASE + "  - {name: p, match: {account: 'phys*'}, tenant: physics}\n", "p.yaml"
    ).spec
    got = assign([slurm_job("1", "physics"), slurm_job("2", "bio"), slurm_job("3")], spec)
    assert set(got) == {f"{SCOPE}/job_1"}


# -- the daemon: discovery, tenants, the split, and what is written ------------------------

FILES = {
    "cgroup.procs": "",
    "cgroup.events": "populated 1\nfrozen 0\n",
    "cpu.weight": "100\n",
    "cpu.max": "max 100000\n",
    "memory.max": "max\n",
    "memory.high": "max\n",
    "memory.current": "4096\n",
    "cpuset.cpus": "0-1\n",
}


def slurm_node(tmp_path: Path) -> Path:
    """A node's tree as slurmd's cgroup/v2 plugin makes it: two jobs with their steps."""
    root = tmp_path / "cgroup"
    for path in [
        f"{JOB_A}/step_batch/user/task_0",
        f"{JOB_A}/step_extern",
        f"{JOB_B}/step_0/user/task_0",
        f"{SCOPE}/system",
        "nodeagent.slice",
    ]:
        (root / path).mkdir(parents=True)
    for d, _, _ in os.walk(root):
        for name, text in FILES.items():
            Path(d, name).write_text(text)
        Path(d, "cpu.stat").write_text("usage_usec 0\n")
    return root


def busy(root: Path, usec: int) -> None:
    for job in (JOB_A, JOB_B):
        (root / job / "cpu.stat").write_text(f"usage_usec {usec}\n")


def agent_on(root: Path, tmp_path: Path, slurm: dict[str, Any] | None = None) -> Agent:
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {
                "interval": 0.05,
                "state_file": str(tmp_path / "state.json"),
                "slurm": slurm or {},
            },
            "fair_share": {"active_threshold": 0},
            "tenants": {"physics": {"shares": 3}, "bio": {"shares": 1}, "hpc": {"shares": 1}},
            "rules": [
                {"name": "physics", "match": {"account": "physics"}, "tenant": "physics"},
                {"name": "bio", "match": {"runtime": "slurm", "account": "bio"}, "tenant": "bio"},
                {"name": "slurm", "match": {"runtime": "slurm"}, "tenant": "hpc",
                 "class": "training"},
            ],
        }
    )  # fmt: skip
    agent = open_agent(spec, CgroupTree(str(root)))
    agent.rec.slurm = SlurmJobs(Squeue(listing("11|physics", "12|bio")))
    agent.rec.registry.resync()
    return agent


Write = tuple[str, str, str | None, str]


def run_ticks(agent: Agent, root: Path) -> tuple[list[Write], list[WriteResult]]:
    """Two ticks with CPU used in between: the audit records of the writes, and every
    write's result."""
    writes: list[Write] = []
    agent.rec.executor.audit = lambda path, attr, old, new, why: writes.append(
        (path, attr, old, new)
    )
    results = list(agent.tick().results)
    busy(root, 200_000)
    time.sleep(0.1)
    results += agent.tick().results
    return writes, results


def test_slurm_jobs_are_found_with_their_accounts_and_counted_in_the_split(
    tmp_path: Path,
) -> None:
    root = slurm_node(tmp_path)
    agent = agent_on(root, tmp_path)
    writes, results = run_ticks(agent, root)
    assert set(agent.rec.registry.workloads) == {JOB_A, JOB_B}, "the jobs, not their steps"
    record = agent.rec.last
    assert record is not None
    tenants = {p: a.tenant for p, a in record.assignments.items()}
    assert tenants == {JOB_A: "physics", JOB_B: "bio"}
    assert set(record.plan.tenant_usage) >= {"physics", "bio"}
    assert all(record.plan.tenant_usage[t] > 0 for t in ("physics", "bio"))
    (note,) = [n for n in record.plan.notes if n.kind == "hierarchy"]
    assert note.fields["planned"] == pytest.approx({"physics": 0.75, "bio": 0.25}, abs=0.02)
    # read-only, the jobs keep the weights slurmd gave them: the note says what that costs
    assert note.fields["expected"] == pytest.approx({"physics": 0.5, "bio": 0.5}, abs=0.02)
    levels = note.fields["read_only_levels"]
    assert isinstance(levels, list) and SCOPE in levels
    inside = [w for w in writes if f"/{SCOPE}/" in w[0] or w[0].endswith(f"/{SCOPE}")]
    assert inside == [], "read-only by default: nothing written in slurmstepd.scope"
    refused = {(r.path, r.attribute) for r in results if r.outcome is Outcome.READ_ONLY}
    assert (JOB_A, Attribute.CPU_WEIGHT) in refused
    shown = next(c for c in record.plan.cgroups if c.path == JOB_A)
    assert shown.write is WriteMode.READ_ONLY
    assert shown.identity.account == "physics"


def test_opted_in_only_the_jobs_cpu_weight_is_written(tmp_path: Path) -> None:
    root = slurm_node(tmp_path)
    agent = agent_on(root, tmp_path, {"cpu_weight": "write"})
    writes, _ = run_ticks(agent, root)
    inside = {w[0].removeprefix(str(root) + "/"): int(w[3]) for w in writes if SCOPE in w[0]}
    assert sorted(inside) == [f"{JOB_A}/cpu.weight", f"{JOB_B}/cpu.weight"]
    assert inside[f"{JOB_A}/cpu.weight"] == pytest.approx(3 * inside[f"{JOB_B}/cpu.weight"])
    for below in ("step_batch", "step_extern"):
        assert (root / JOB_A / below / "cpu.weight").read_text() == "100\n"
    assert (root / SCOPE / "cpu.weight").read_text() == "100\n"


def test_protection_never_throttles_or_freezes_a_slurm_job(tmp_path: Path) -> None:
    """cpu.max and cgroup.freeze a policy plans for a Slurm job stay plans: refused, and
    said so, even with cpu.weight opted in."""
    root = slurm_node(tmp_path)
    agent = agent_on(root, tmp_path, {"cpu_weight": "write"})
    run_ticks(agent, root)
    record = agent.rec.last
    assert record is not None
    cg = next(c for c in record.plan.cgroups if c.path == JOB_A)

    targets = {
        **cg.targets,
        Attribute.CPU_MAX: Target(CpuMax(50_000, 100_000), "protection", "throttled"),
        Attribute.FREEZE: Target(Frozen(True), "protection", "frozen"),
    }
    plan = replace(record.plan, cgroups=(replace(cg, targets=targets),))
    results = agent.rec.executor.apply(plan, record.snapshot)
    outcomes = {r.attribute: r.outcome for r in results}
    assert outcomes[Attribute.CPU_MAX] is Outcome.READ_ONLY
    assert outcomes[Attribute.FREEZE] is Outcome.READ_ONLY
    assert (root / JOB_A / "cpu.max").read_text() == "max 100000\n"


def test_slurm_down_the_jobs_are_claimed_by_the_rules_that_need_no_account(
    tmp_path: Path,
) -> None:
    root = slurm_node(tmp_path)
    agent = agent_on(root, tmp_path)
    agent.rec.slurm = SlurmJobs(Squeue(subprocess.TimeoutExpired("squeue", 5)))
    with structlog.testing.capture_logs() as logs:
        run_ticks(agent, root)
    record = agent.rec.last
    assert record is not None
    assert {p: a.tenant for p, a in record.assignments.items()} == {JOB_A: "hpc", JOB_B: "hpc"}
    unreachable = [e for e in logs if e["event"] == "slurm.unreachable"]
    assert [e["error"] for e in unreachable] == ["/usr/bin/squeue --jobs=11,12: no answer in 5 s"]
    status = agent.routes()["/v1/status"]["GET"](None)  # type: ignore[arg-type]
    assert isinstance(status, Status)
    assert status.slurm_problem == "/usr/bin/squeue --jobs=11,12: no answer in 5 s"


def test_the_scan_watches_the_scope_and_stops_at_the_jobs(tmp_path: Path) -> None:
    root = slurm_node(tmp_path)
    registry = Registry(CgroupTree(str(root)), "nodeagent.slice", watch=False)
    result = scan(CgroupTree(str(root)), "nodeagent.slice")
    assert SCOPE in result.parents
    assert not [p for p in result.parents if p.startswith(f"{JOB_A}/") or p == JOB_A]
    registry.resync()
    assert set(registry.workloads) == {JOB_A, JOB_B}


def test_workloads_shows_the_accounts_and_says_when_slurm_does_not_answer(
    tmp_path: Path,
) -> None:
    from click.testing import CliRunner

    from nodeagent.cli import main

    root = slurm_node(tmp_path)
    squeue = script(tmp_path, 'echo "11|physics"; echo "12|bio"')
    config = tmp_path / "policy.yaml"
    for answering in (squeue, str(tmp_path / "missing")):
        config.write_text(
            BASE.replace("rules:\n", "")
            + f"agent:\n  slurm: {{squeue: {answering}}}\n"
            + "rules:\n  - {name: p, match: {account: physics}, tenant: physics}\n"
        )
        result = CliRunner().invoke(
            main, ["workloads", "--cgroup-root", str(root), "--config", str(config), "--json"]
        )
        assert result.exit_code == 0, result.output
        rows = {r["cgroup"]: r for r in json.loads(result.stdout)["items"]}
        got = {p: (r["job_id"], r["account"], r["tenant"]) for p, r in rows.items()}
        if answering == squeue:
            assert got == {JOB_A: ("11", "physics", "physics"), JOB_B: ("12", "bio", None)}
            assert result.stderr == ""
        else:
            assert got == {JOB_A: ("11", None, None), JOB_B: ("12", None, None)}
            assert result.stderr == (
                f"warning: Slurm did not answer ({answering} --jobs=11,12: No such file or"
                " directory): its jobs are shown without their accounts, and rules with"
                " `account:` do not claim them\n"
            )
