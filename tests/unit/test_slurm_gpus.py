"""Issue 35: a Slurm job's GRES GPUs on this node are a hold (kind runtime, owner slurm:JOBID),
read from Slurm itself (`scontrol show job -d --oneliner`, never the job's environment), so its
own processes on them are no GPU violation, while one on another GPU, or outside the job, is.

The answers are Slurm's format as slurm_sprint_job_info prints it (22.05's src/api/job_info.c,
src/scontrol/info_job.c since; the detail from gres_ctld_job_build_details): scontrol itself is
a stand-in runner giving them; the real one answers in tests/kernel/test_slurm.py. The GPUs are
test_gpu_policies' fake ones, or a simulated node for the agent's real tick.
"""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from test_gpu_policies import G0, G1, state
from test_slurm import FILES, JOB_A, JOB_B, SCOPE, Clock, Squeue, listing, slurm_job, slurm_node

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import open_agent
from nodeagent.gpu.grants import NO_GPUS, GpuGrant
from nodeagent.gpu.gres import VIA, gres_uuids, hostlist_has, job_node_gres, slurm_gpus
from nodeagent.gpu.model import Device, GpuProcess, HoldKind, MigDevice
from nodeagent.meta import BadAnswer
from nodeagent.policy.gpu_checks import violations
from nodeagent.policyfile.model import PolicySpec, SlurmSettings
from nodeagent.runtimes.gpus import RuntimeGpus
from nodeagent.slurm import Answer, SlurmGpus, SlurmJobs, node_name

REPO = Path(__file__).resolve().parents[2]
NODE = "gpu01"
SETTINGS = SlurmSettings(timeout=2.0, retry_interval=30.0, node=NODE)


def record(
    job: str = "11",
    detail: str = "Nodes=gpu01 CPU_IDs=0-1 Mem=0 GRES=gpu:2(IDX:0-1)",
    *,
    name: str = "train",
    command: str = "/home/alice/train.sh",
    head: str = "",
    total: str | None = "gpu:2",
) -> str:
    """One record as `scontrol show job -d --oneliner` prints it (22.05: the detail entries
    after two spaces, as its `"  Nodes=..."` writes them)."""
    gres = "" if total is None else f"JOB_GRES={total}   {detail} "
    return (
        f"JobId={job} {head}JobName={name} UserId=alice(1001) GroupId=alice(1001) "
        "MCS_label=N/A Priority=4294901759 Nice=0 Account=physics QOS=normal "
        "JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
        "Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:05 TimeLimit=UNLIMITED "
        "TimeMin=N/A SubmitTime=2026-12-07T15:00:00 EligibleTime=2026-12-07T15:00:00 "
        "AccrueTime=Unknown StartTime=2026-12-07T15:00:00 EndTime=Unknown Deadline=N/A "
        "SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-07T15:00:00 Scheduler=Main "
        "Partition=debug AllocNode:Sid=login1:1234 ReqNodeList=(null) ExcNodeList=(null) "
        "NodeList=gpu01 BatchHost=gpu01 NumNodes=1 NumCPUs=2 NumTasks=1 CPUs/Task=1 "
        "ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=1,billing=2,gres/gpu=2 Socks/Node=* "
        f"NtasksPerN:B:S:C=0:0:*:* CoreSpec=* {gres}MinCPUsNode=1 MinMemoryNode=0 "
        "MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 "
        f"Licenses=(null) Network=(null) Command={command} WorkDir=/home/alice "
        "StdErr=/home/alice/slurm-11.out StdIn=/dev/null StdOut=/home/alice/slurm-11.out "
        "Power= TresPerNode=gres:gpu:2\n"
    )


def ids(text: str, job: str = "11", node: str = NODE) -> tuple[str, ...]:
    return slurm_gpus(text, job, node).ids


# --- what scontrol says the job holds here ----------------------------------------------------


@pytest.mark.parametrize(
    ("gres", "held"),
    [
        ("gpu:2(IDX:0-1)", ("0", "1")),
        ("gpu:a100:2(IDX:0,2)", ("0", "2")),
        ("gpu:4(IDX:0-1,3,5)", ("0", "1", "3", "5")),  # ranges and single indices
        ("gpu:a100:1(IDX:0),gpu:v100:1(IDX:3)", ("0", "3")),  # several types
        ("gpu:1(IDX:2),shard:2(2/4,0/4)", ("2",)),  # another GRES beside: not a GPU of its own
        ("mps:100(IDX:0)", ()),  # MPS or shards alone: not read (docs/gpus.md)
        ("gpu(CNT:2)", ()),  # a GRES without device files: no index to hold
        ("", ()),  # none here (22.05 prints nothing)
        ("(null)", ()),
    ],
)
def test_the_gpus_a_job_holds_on_this_node(gres: str, held: tuple[str, ...]) -> None:
    text = record(detail=f"Nodes=gpu01 CPU_IDs=0-1 Mem=0 GRES={gres}")
    assert ids(text) == held
    grant = slurm_gpus(text, "11", NODE)
    assert grant == (GpuGrant(False, held, VIA) if held else NO_GPUS)


def test_a_job_not_running_has_no_detail_and_holds_nothing() -> None:
    assert job_node_gres(record(total=None), "11") == ()
    assert slurm_gpus(record(total=None), "11", NODE) == NO_GPUS


def test_only_this_nodes_entry_counts() -> None:
    detail = (
        "Nodes=gpu[01-02] CPU_IDs=0-1 Mem=0 GRES=gpu:2(IDX:0-1)   "
        "Nodes=gpu[08-10] CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:3)"
    )
    text = record(detail=detail, total="gpu:7")
    assert ids(text, node="gpu02") == ("0", "1")
    assert ids(text, node="gpu09") == ("3",)  # zero-padded as the range is
    for other in ("gpu9", "gpu03", "gpu1"):  # not this job's: the node's name is wrong
        with pytest.raises(BadAnswer, match=f"does not name '{other}': set agent.slurm.node"):
            ids(text, node=other)


def test_hostlists_read_as_slurm_writes_them() -> None:
    assert hostlist_has("a1,b[1-3,7],c[01-02]-x", "b7")
    assert hostlist_has("a1,b[1-3,7],c[01-02]-x", "c02-x")
    assert hostlist_has("rack[1-2]-n[001-004]", "rack2-n003")
    assert hostlist_has("n[8-10]", "n9") and hostlist_has("n[08-10]", "n09")
    assert not hostlist_has("n[08-10]", "n9")
    assert not hostlist_has("a1,b[1-3,7],c[01-02]-x", "b4")
    assert not hostlist_has("gpu.01", "gpu101")  # a name's dot is no pattern
    for bad in ("gpu[01-", "gpu[3-1]", "gpu[x]", "a,,b"):
        with pytest.raises(BadAnswer):
            hostlist_has(bad, "q")


def test_an_arrays_task_and_a_het_jobs_component_are_read_from_their_own_records() -> None:
    array = record("12", head="ArrayJobId=12 ArrayTaskId=2 ") + record(
        "13",
        "Nodes=gpu01 CPU_IDs=2 Mem=0 GRES=gpu:1(IDX:3)",
        head="ArrayJobId=12 ArrayTaskId=1 ",
        total="gpu:1",
    )
    assert ids(array, "12") == ("0", "1") and ids(array, "13") == ("3",)
    het = record("20", head="HetJobId=20 HetJobOffset=0 ") + record(
        "21", "Nodes=gpu01 CPU_IDs=2 Mem=0 GRES=gpu:1(IDX:2)", head="HetJobId=20 HetJobOffset=1 "
    )
    assert ids(het, "21") == ("2",)


FORGED = "Nodes=gpu01 CPU_IDs=0 Mem=0 GRES=gpu:4(IDX:0-3)"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "0 records of job 11"),
        (record("12"), "0 records of job 11"),
        (record() + record(), "2 records of job 11"),
        ("slurm_load_jobs error: oops\n" + record(), "line 1 is not a job record"),
        # the job's user names it, and its command: a forged entry is refused, not read
        (record(name=f"x {FORGED}"), "'Nodes=gpu01' outside its GRES detail"),
        (record(name=f"x JOB_GRES=gpu:4 {FORGED}"), "2 JOB_GRES= fields"),
        (record(command=f"/bin/x {FORGED}"), "outside its GRES detail"),
        (record(total=None, command=f"x {FORGED}"), "outside its GRES detail"),
        # ... or a newline: a forged record of its own job is a second record
        (record(name=f"x\nJobId=11 JOB_GRES=gpu:4   {FORGED} MinCPUsNode=1"), "2 records"),
        (record(name="x\nStdOut=y"), "line 2 is not a job record"),
        # not Slurm's shape
        (record(detail="Nodes=gpu01 CPU_IDs=0-1 GRES=gpu:2(IDX:0-1)"), "not Nodes= CPU_IDs="),
        (record(detail="Nodes=gpu01 CPU_IDs=0-1 Mem=0 Gres=gpu:2(IDX:0-1)"), "GRES detail has"),
        (record(detail="Nodes= CPU_IDs=0-1 Mem=0 GRES=gpu:2(IDX:0-1)"), "names no nodes"),
        (record(detail="Nodes=gpu01 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1"), "is not name"),
        (record(detail="Nodes=gpu01 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1)x"), "no comma"),
        (record(detail="Nodes=gpu01 CPU_IDs=0 Mem=0 GRES=gpu:3(IDX:0-1)"), "count is not"),
        (record(detail="Nodes=gpu01 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:a-b)"), "not a list of"),
        (record(detail="Nodes=gpu01 CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:5000)"), "out of range"),
        (record(detail="Nodes=gpu01 CPU_IDs=0 Mem=0 GRES=gpu:3(IDX:3-1)"), "out of range"),
        (record(detail="Nodes=gpu[01 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1)"), "not a Slurm host"),
        ("JobId=11 JobName=x JOB_GRES=gpu:2   " + FORGED + "\n", "no MinCPUsNode= after"),
    ],
)
def test_an_answer_not_as_slurm_prints_it_is_refused_whole(text: str, why: str) -> None:
    with pytest.raises(BadAnswer) as info:
        slurm_gpus(text, "11", NODE)
    assert why in str(info.value)


# --- which GPU a GRES index is ------------------------------------------------------------------


def device(index: int, uuid: str, minor: int | None) -> Device:
    return Device(index, uuid, "fake", f"0000:0{index}:00.0", minor, 1 << 30, 0, (), None)


def test_gres_index_i_is_the_gpu_with_the_ith_lowest_minor() -> None:
    gpus = replace(state((), ()), devices=(device(0, G0, 1), device(1, G1, 0)))
    assert gres_uuids(GpuGrant(False, ("0",), VIA), gpus) == ((G1,), ())
    assert gres_uuids(GpuGrant(False, ("0", "1", "7"), VIA), gpus) == ((G0, G1), ("7",))
    unknown = replace(gpus, devices=(device(0, G0, None), device(1, G1, None)))
    assert gres_uuids(GpuGrant(False, ("0",), VIA), unknown) == ((G0,), ())  # NVML's order


def test_where_a_gpu_has_left_no_gres_index_is_mapped() -> None:
    """/dev/nvidia1 fell off the bus: index 1 would name /dev/nvidia2, another job's."""
    gpus = replace(state((), ()), devices=(device(0, G0, 0), device(1, G1, 2)))
    assert gres_uuids(GpuGrant(False, ("0", "1"), VIA), gpus) == ((), ("0", "1"))


def test_on_a_mig_node_no_gres_index_is_mapped() -> None:
    mig = MigDevice("MIG-a", G0, 0, "1g.10gb", 10 << 30)
    gpus = replace(state((), ()), devices=(replace(device(0, G0, 0), mig_devices=(mig,)),))
    assert gres_uuids(GpuGrant(False, ("0",), VIA), gpus) == ((), ("0",))


def test_this_nodes_slurm_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "node7.cluster.example")
    plain = SlurmSettings()
    assert node_name(plain, f"{SCOPE}/job_11") == "node7"
    assert node_name(plain, "system.slice/gpu01_slurmstepd.scope/job_11") == "gpu01"
    assert node_name(SETTINGS, "system.slice/other_slurmstepd.scope/job_11") == NODE


# --- asking scontrol ----------------------------------------------------------------------------


def scontrol(*answers: Answer | OSError | subprocess.TimeoutExpired) -> Squeue:
    """scontrol's answers, recorded as test_slurm records squeue's."""
    return Squeue(*answers)


def test_scontrol_is_asked_for_the_job_and_read_for_this_node() -> None:
    run = scontrol(listing(record().rstrip("\n")))
    assert SlurmGpus(SETTINGS, run).gpus(slurm_job("11")) == GpuGrant(False, ("0", "1"), VIA)
    assert run.calls == [["/usr/bin/scontrol", "show", "job", "--details", "--oneliner", "11"]]
    gone = scontrol(Answer(1, "", "slurm_load_jobs error: Invalid job id specified\n"))
    assert SlurmGpus(SETTINGS, gone).gpus(slurm_job("11")) is None


JOBS = [slurm_job("11"), slurm_job("12")]
PROCESSES = (
    GpuProcess(10, G0, None, f"{JOB_A}/step_batch/user/task_0"),  # on the GPU it was given
    GpuProcess(11, G1, None, f"{JOB_A}/step_0/user/task_0"),  # on one it was not
    GpuProcess(12, G0, None, f"{JOB_B}/step_0/user/task_0"),  # a job given no GPU
    GpuProcess(13, G1, None, "system.slice/stray.service"),  # no job at all
)


def answers() -> Squeue:
    """Job 11 holds GRES 0 on this node, job 12 none."""
    by_job = {
        "11": record("11", "Nodes=gpu01 CPU_IDs=0-1 Mem=0 GRES=gpu:1(IDX:0)", total="gpu:1"),
        "12": record("12", total=None),
    }

    class Scontrol(Squeue):
        def __call__(self, argv: Any, timeout: float) -> Answer:
            super().__call__(argv, timeout)
            return Answer(0, by_job[argv[-1]], "")

    return Scontrol(listing())


def test_a_jobs_own_gpu_is_held_and_only_a_process_nobody_granted_is_a_violation() -> None:
    run, gpus = answers(), RuntimeGpus()
    giver = SlurmGpus(SETTINGS, run)
    classes = {JOB_A: "training"}
    holds = gpus.holds(giver, state(PROCESSES, ()), JOBS, classes, ())
    assert [(h.owner, h.kind, h.uuids, h.indices, h.cgroup, h.workload_class) for h in holds] == [
        ("slurm:11", HoldKind.RUNTIME, (G0,), (0,), JOB_A, "training")
    ]
    judged = [(p.pid, kind) for p, kind, _ in violations(state(PROCESSES, holds))]
    assert judged == [(11, "wrong-gpu"), (12, "unassigned"), (13, "unassigned")]
    # asked once each for their lives; forgotten with the cgroup, asked again after
    for _ in range(3):
        gpus.holds(giver, state(PROCESSES, ()), JOBS, {}, ())
    assert sorted(c[-1] for c in run.calls) == ["11", "12"]
    gpus.holds(giver, state(PROCESSES, ()), JOBS[1:], {}, ())
    gpus.holds(giver, state(PROCESSES, ()), JOBS, {}, ())
    assert sorted(c[-1] for c in run.calls) == ["11", "11", "12"]


def test_nothing_is_asked_without_a_gpu_process_of_a_job() -> None:
    run = answers()
    assert RuntimeGpus().holds(SlurmGpus(SETTINGS, run), state((), ()), JOBS, {}, ()) == ()
    stray = (PROCESSES[3],)
    assert RuntimeGpus().holds(SlurmGpus(SETTINGS, run), state(stray, ()), JOBS, {}, ()) == ()
    assert run.calls == []


def test_scontrol_not_answering_holds_nothing_says_so_once_and_is_asked_again_later() -> None:
    clock = Clock()
    run = scontrol(subprocess.TimeoutExpired("scontrol", 2.0))
    gpus, giver = RuntimeGpus(clock), SlurmGpus(SETTINGS, run)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert gpus.holds(giver, state(PROCESSES, ()), JOBS, {}, ()) == ()
            clock.now += 10
        assert len(run.calls) == 1  # left alone agent.slurm.retry_interval
        clock.now += SETTINGS.retry_interval
        run.answers = [listing(record().rstrip("\n"))]
        holds = gpus.holds(giver, state(PROCESSES[:1], ()), JOBS, {}, ())
    assert [h.owner for h in holds] == ["slurm:11"]
    assert [e["event"] for e in logs] == ["runtime.gpus_unavailable", "runtime.gpus_available"]
    assert logs[0]["error"] == "/usr/bin/scontrol show job -d 11: no answer in 2 s"
    assert logs[0]["runtime"] == "slurm"


def test_a_malformed_answer_is_refused_for_that_job_said_once_not_asked_again() -> None:
    run = scontrol(Answer(0, record(name=f"x {FORGED}"), ""))
    gpus, giver = RuntimeGpus(), SlurmGpus(SETTINGS, run)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert gpus.holds(giver, state(PROCESSES[:1], ()), JOBS, {}, ()) == ()
    assert [e["event"] for e in logs] == ["runtime.gpus_refused"]
    assert "slurm's answer for slurm:11 was refused: " in logs[0]["message"]
    assert len(run.calls) == 1


# --- the agent's real tick ----------------------------------------------------------------------


def test_the_agents_tick_holds_a_slurm_jobs_gres_and_judges_only_the_others(
    tmp_path: Path,
) -> None:
    root = slurm_node(tmp_path)
    (root / "system.slice/stray.service").mkdir()
    for name, text in FILES.items():
        (root / "system.slice/stray.service" / name).write_text(text)
    description = yaml.safe_load((REPO / "config/gpus/4x-a100-two-nvlink-pairs.yaml").read_text())
    description["processes"] = [
        {"pid": 201, "gpu": 1, "memory": "1Gi", "cgroup": f"{JOB_A}/step_batch/user/task_0"},
        {"pid": 202, "gpu": 3, "memory": "1Gi", "cgroup": f"{JOB_A}/step_batch/user/task_0"},
        {"pid": 203, "gpu": 0, "memory": "1Gi", "cgroup": f"{JOB_B}/step_0/user/task_0"},
        {"pid": 204, "gpu": 2, "memory": "1Gi", "cgroup": "system.slice/stray.service"},
    ]
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(description))
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"state_file": str(tmp_path / "state.json"), "slurm": {"node": NODE}},
            "gpu": {"simulate": str(tmp_path / "node.yaml"), "on_violation": "freeze"},
            "tenants": {"hpc": {"shares": 1}},
            "rules": [{"name": "slurm", "match": {"runtime": "slurm"}, "tenant": "hpc"}],
        }
    )
    by_job = {
        "11": record("11", "Nodes=gpu01 CPU_IDs=0-1 Mem=0 GRES=gpu:2(IDX:1-2)"),
        "12": record("12", "Nodes=gpu01 CPU_IDs=2 Mem=0 GRES=", total=""),
    }
    calls: list[str] = []

    def slurm(argv: Any, timeout: float) -> Answer:
        if argv[0].endswith("squeue"):
            return listing("11|physics", "12|bio")
        calls.append(argv[-1])
        return Answer(0, by_job[argv[-1]], "")

    agent = open_agent(spec, CgroupTree(str(root)), dry_run=True)
    agent.rec.slurm = SlurmJobs(slurm)
    agent.rec.registry.resync()
    record_ = agent.tick()
    assert record_.snapshot.gpus is not None
    gpu = [d.uuid for d in record_.snapshot.gpus.devices]
    assert [(h.owner, h.kind, h.uuids, h.cgroup) for h in record_.snapshot.gpus.holds] == [
        ("slurm:11", HoldKind.RUNTIME, tuple(sorted(gpu[1:3])), JOB_A)
    ]
    found = {
        n.fields["pid"]: (n.status, n.path) for n in record_.plan.notes if n.kind == "gpu-violation"
    }
    assert found == {
        202: ("wrong-gpu", JOB_A),
        203: ("unassigned", JOB_B),
        204: ("unassigned", None),  # no workload of the agent's
    }
    agent.tick()
    assert sorted(calls) == ["11", "12"]  # kept for the jobs' lives
    # a reload that changes how Slurm is asked (its node name, scontrol) asks again
    slurm_settings = spec.agent.slurm.model_copy(update={"timeout": 9.0})
    agent.rec.reloaded(
        spec.model_copy(update={"agent": spec.agent.model_copy(update={"slurm": slurm_settings})})
    )
    agent.tick()
    assert sorted(calls) == ["11", "11", "12", "12"]
    assert agent.rec.gpus.ledger.holds() == ()
