"""A job is never less bounded than its caller (issue 34 item 4): `nodeagent exec` moves the
caller's process out of its session into the managed root, which has no pids.max, no
memory.max and no cpu.max of its own. With user-1002.slice at pids.max 16 and memory.max
96M, a session's 15th fork failed while through exec 60 of 60 children started and 300 MiB
were touched. So for a caller other than root each of cpus, memory and pids is the
tightest of the request's, the caller's own cgroups' (its cgroup and every ancestor) and
`jobs.per_user_limits`'; root's jobs take the request alone.

A daemon over a plain directory tree (daemon_api): the caller's session is a cgroup chain
in that tree and /proc/<caller>/cgroup names it; the kernel's side is
tests/kernel/test_exec_bounds.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import daemon_api
import pytest
from daemon_api import ALICE, ROOT, Daemon, daemon, restart
from structlog.testing import capture_logs

from nodeagent.errors import BadRequest, Forbidden
from nodeagent.jobs import Job
from nodeagent.policyfile.model import WorkloadClass
from nodeagent.state import JobRecord

SLICE = "user.slice/user-1000.slice"
SESSION = f"{SLICE}/session-3.scope"
FROM_SLICE = f"cgroup {SLICE}"
POLICY = "jobs.per_user_limits"
JOB = "nodeagent.slice/j"
pytestmark = pytest.mark.usefixtures("files_replace_their_value")


def session(
    d: Daemon, files: dict[str, str] | None = None, peer: Any = ALICE, at: str = SESSION
) -> None:
    """`peer` runs in the cgroup `at` of a session's chain (each a cgroup, as the kernel
    makes one: its cgroup.procs); `files` ({"user.slice/pids.max": "16"}) are written below
    the cgroup root."""
    for cgroup in ("", SLICE.split("/", maxsplit=1)[0], SLICE, SESSION):
        (d.root / cgroup).mkdir(exist_ok=True)
        (d.root / cgroup / "cgroup.procs").touch()
    for where, text in (files or {}).items():
        (d.root / where).write_text(text + "\n")
    (d.proc / str(peer.pid)).mkdir(parents=True, exist_ok=True)
    (d.proc / str(peer.pid) / "cgroup").write_text(f"0::/{at}\n")


def job(d: Daemon, peer: Any = ALICE, name: str = "j", **body: Any) -> dict[str, Any]:
    """The job GET /v1/jobs lists after `peer` started it as `name` with `body`."""
    d.start(peer, name, **body)
    [listed] = [j for j in d.call(ROOT, "GET", "/v1/jobs")["jobs"] if j["name"] == name]
    assert isinstance(listed, dict)
    return listed


def written(d: Daemon, name: str) -> str:
    return (d.root / JOB / name).read_text()


# (the slice's file, its text, the request's key and a looser value, what the job gets)
CAPS = [
    ("pids.max", "16", "pids", 100, 16),
    ("memory.max", str(96 << 20), "memory", 1 << 30, 96 << 20),
    ("cpu.max", "50000 100000", "cpus", 2.0, 0.5),
]


@pytest.mark.parametrize(("file", "text", "key", "looser", "tightest"), CAPS)
def test_each_limit_is_the_tightest_of_the_request_and_the_callers_slice(
    tmp_path: Path, file: str, text: str, key: str, looser: float, tightest: float
) -> None:
    d = daemon(tmp_path)
    session(d, {f"{SLICE}/{file}": text})
    asked: dict[str, Any] = {key: looser}
    got = job(d, **asked)
    assert (got[key], got["limits_from"][key]) == (tightest, FROM_SLICE)
    assert written(d, file) == ("50000 100000" if key == "cpus" else text), "in the kernel"
    tighter = tightest / 2 if key != "pids" else 8
    asked = {key: int(tighter) if key != "cpus" else tighter}
    again = job(d, name="k", **asked)
    assert (again[key], again["limits_from"][key]) == (tighter, "the request")


def test_with_no_request_the_job_takes_the_slices_limits_and_the_policys_pids(
    tmp_path: Path,
) -> None:
    d = daemon(tmp_path)
    session(d, {f"{SLICE}/memory.max": str(96 << 20)})
    got = job(d)
    assert (got["cpus"], got["memory"], got["pids"]) == (None, 96 << 20, 4096)
    assert got["limits_from"] == {"memory": FROM_SLICE, "pids": POLICY}
    assert written(d, "pids.max") == "4096" and written(d, "memory.max") == str(96 << 20)
    assert written(d, "cpu.max") == "max 100000", "nothing bounds its CPU"


def test_an_ancestor_tighter_than_the_callers_own_cgroup_binds(tmp_path: Path) -> None:
    d = daemon(tmp_path)
    session(d, {"user.slice/pids.max": "10", f"{SLICE}/pids.max": "16"})
    got = job(d)
    assert (got["pids"], got["limits_from"]["pids"]) == (10, "cgroup user.slice")


def test_the_policys_per_user_limits_bind_where_they_are_tighter(tmp_path: Path) -> None:
    d = daemon(tmp_path, {"jobs": {"per_user_limits": {"pids_max": 12, "memory_max": "64Mi",
                                                       "cpu_max": 0.25}}})  # fmt: skip
    session(d, {f"{SLICE}/pids.max": "16"})
    got = job(d, cpus=1.0, memory=1 << 30)
    assert (got["cpus"], got["memory"], got["pids"]) == (0.25, 64 << 20, 12)
    assert got["limits_from"] == {"cpus": POLICY, "memory": POLICY, "pids": POLICY}


def test_max_and_missing_files_bound_nothing(tmp_path: Path) -> None:
    """'max' is no bound; a file that is missing is a controller off there: no bound; nor is
    a quota of more CPUs than a job may ask for (no node has them)."""
    d = daemon(tmp_path, {"jobs": {"per_user_limits": {"pids_max": None}}})
    session(
        d,
        {
            f"{SLICE}/pids.max": "max",
            f"{SLICE}/memory.max": "max",
            f"{SLICE}/cpu.max": "max 100000",
            "user.slice/cpu.max": f"{2**44 - 1} 1000",
        },
    )
    got = job(d)
    assert (got["cpus"], got["memory"], got["pids"], got["limits_from"]) == (None, None, None, {})
    assert written(d, "pids.max") == "max"


def test_roots_jobs_take_the_request_alone(tmp_path: Path) -> None:
    """Root is the operator: neither its session's limits nor the per-user ones."""
    d = daemon(tmp_path)
    session(d, {f"{SLICE}/pids.max": "16"}, ROOT)
    got = job(d, ROOT)
    assert (got["cpus"], got["memory"], got["pids"], got["limits_from"]) == (None, None, None, {})
    got = job(d, ROOT, "k", pids=100000)
    assert (got["pids"], got["limits_from"]) == (100000, {"pids": "the request"})


@pytest.mark.parametrize(
    ("cgroup", "problem"),
    [
        ("0::/../../elsewhere.scope\n", "has an empty, '.' or '..' component"),
        ("0::/no/such.scope\n", "vanished"),
        ("12:cpu:/user.slice\n", "no cgroup v2 line"),
        (None, "no cgroup v2 line"),
    ],
)
def test_a_caller_whose_cgroups_cannot_be_read_gets_the_policys_limits_said_once(
    tmp_path: Path, cgroup: str | None, problem: str
) -> None:
    """Outside the agent's cgroup root (another cgroup namespace's path), gone, or no /proc
    entry to say: the request and jobs.per_user_limits bound the job, and it is said once
    per uid, not at every job."""
    d = daemon(tmp_path)
    session(d, {f"{SLICE}/pids.max": "16"})
    if cgroup is None:
        (d.proc / str(ALICE.pid) / "cgroup").unlink()
    else:
        (d.proc / str(ALICE.pid) / "cgroup").write_text(cgroup)
    with capture_logs() as logs:
        first = job(d)
        second = job(d, name="k")
    assert first["pids"] == second["pids"] == 4096
    assert first["limits_from"] == {"pids": POLICY}
    said = [e for e in logs if e["event"] == "job.caller_limits_unknown"]
    assert len(said) == 1 and said[0]["uid"] == ALICE.uid, said
    assert problem in said[0]["problem"]


def test_a_slice_that_leaves_too_little_for_any_job_refuses_it(tmp_path: Path) -> None:
    d = daemon(tmp_path)
    session(d, {f"{SLICE}/pids.max": "0"})
    e = d.refused(ALICE, "POST", "/v1/jobs", {"name": "j", "pid": d.child(ALICE)})
    assert isinstance(e, Forbidden)
    assert str(e) == (f"uid 1000: cgroup {SLICE} allows 0 tasks, too few for a job (at least 1)")
    assert not (d.root / JOB).exists()


def test_a_job_whose_pids_max_cannot_be_written_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No pids controller in the managed root (the host offers none): a job that must have
    a pids.max does not start without it, and the refusal names it."""
    monkeypatch.delitem(daemon_api.FILES, "pids.max")
    d = daemon(tmp_path)
    session(d)
    e = d.refused(ALICE, "POST", "/v1/jobs", {"name": "j", "pid": d.child(ALICE)})
    assert isinstance(e, BadRequest)
    assert str(e).startswith("cannot start job 'j': its limits are not in place: pids.max 4096:")
    assert "no pids.max: its controller is not enabled" in str(e)
    assert "\n" not in str(e)
    assert d.jobs() == []
    assert job(d, ROOT, "k")["pids"] is None, "root's job, with no pids.max to write, starts"


def test_a_request_for_pids_is_checked(tmp_path: Path) -> None:
    d = daemon(tmp_path)
    for bad, message in ((0, "pids: must be at least 1, got 0"),
                         ("16", "pids: must be a whole number, got '16'")):  # fmt: skip
        e = d.refused(ALICE, "POST", "/v1/jobs", {"name": "j", "pid": d.child(ALICE), "pids": bad})
        assert isinstance(e, BadRequest) and str(e) == message


def test_the_limits_and_where_they_came_from_survive_a_restart(tmp_path: Path) -> None:
    d = daemon(tmp_path)
    session(d, {f"{SLICE}/pids.max": "16"})
    started = job(d, memory=1 << 30)
    again = restart(d)
    [kept] = again.call(ROOT, "GET", "/v1/jobs")["jobs"]
    assert kept == started
    assert again.agent.rec.jobs.assignments()[JOB].limits.pids_max == 16, "planned every tick"


def test_a_record_from_before_jobs_had_pids_loads_without_them() -> None:
    job = Job("j", JOB, "research", WorkloadClass.BATCH, 1000, 4001, 1.8e9, cpus=2.0,
              pids=16, limits_from=(("cpus", "the request"), ("pids", FROM_SLICE)))  # fmt: skip
    assert Job.from_record(JobRecord.from_json(job.record().to_json())) == job
    old = {k: v for k, v in job.record().to_json().items() if k not in ("pids", "limits_from")}
    loaded = Job.from_record(JobRecord.from_json(old))
    assert (loaded.cpus, loaded.pids, loaded.limits_from) == (2.0, None, ())
    assert loaded.assignment().limits.pids_max is None


def test_the_per_user_limits_are_checked_where_they_are_written() -> None:
    from nodeagent.policyfile.load import check_text
    from nodeagent.policyfile.yamlfile import PolicyError

    text = (
        "version: 1\ntenants: {a: {shares: 1}}\njobs:\n"
        "  per_user_limits: {pids_max: 0, memory_max: 4096, cpu_max: 0.001}\n"
    )
    with pytest.raises(PolicyError) as info:
        check_text(text, "p.yaml")
    assert [str(p) for p in info.value.problems] == [
        "p.yaml:4:31: jobs.per_user_limits.pids_max: 0 is outside 1..4194304: at least the one"
        " process a workload starts with, at most the kernel's PID_MAX_LIMIT",
        "p.yaml:4:46: jobs.per_user_limits.memory_max: 4096 bytes is below 1Mi; sizes are"
        " bytes unless they have a unit, such as 512Mi",
        "p.yaml:4:61: jobs.per_user_limits.cpu_max: 0.001 cores is less than the kernel's"
        " minimum quota of 1000us per 100000us period",
    ]
    unknown = text.replace("pids_max: 0, memory_max: 4096, cpu_max: 0.001", "tasks: 5")
    with pytest.raises(PolicyError) as info:
        check_text(unknown, "p.yaml")
    [problem] = [str(p) for p in info.value.problems]
    assert problem.startswith("p.yaml:4:21: unknown key 'tasks' in jobs.per_user_limits"), problem
    spec = check_text("version: 1\ntenants: {a: {shares: 1}}\n", "p.yaml").spec
    defaults = spec.jobs.per_user_limits
    assert (defaults.pids_max, defaults.memory_max, defaults.cpu_max) == (4096, None, None)
