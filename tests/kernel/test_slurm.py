"""A real Slurm on the VM's real systemd: Debian 12's munge, slurmctld and slurmd (22.05) as
units of the test systemd (tests/kernel/systemd_host.py), CgroupPlugin=cgroup/v2, a one-node
cluster, accounting by account without slurmdbd (AccountingStorageType=accounting_storage/none:
`sbatch --account=A` still records A on the job).

A job submitted with `sbatch --account=A` is discovered in slurmstepd's scope
(system.slice/vm_slurmstepd.scope: Debian builds slurmd for several per host) with
tenant A (from squeue, never the job's environment), counted in the tenant split, and the audit
log shows nothing written inside slurmstepd.scope; opted in (agent.slurm.cpu_weight: write),
only the job's own cpu.weight. With slurmctld stopped, the one-line error names squeue and the
job is claimed by the rule that needs no account.

The node has four GRES GPUs (issue 35): `Gres=gpu:4`, gres.conf `Name=gpu File=/dev/nvidia[0-3]`,
whose device nodes are fake (char 195:N, no driver) and exist in systemd's mount namespace only:
an overlay on its /dev, its upper layer a tmpfs. A job given two reads, from the real
`scontrol show job -d`, into its hold (kind runtime, owner slurm:<id>) joined to its cgroup, with
simulated GPUs (the VM has none; the agent's own tick over such holds: tests/unit/
test_slurm_gpus.py): its own process on them is no violation; one on another GPU, or outside the
job, still is.

Slurm's configuration, state, logs and munge key are tmpfs mounts in systemd's mount namespace
only: nothing of Slurm runs, or is written, outside it. Its packages come from ./scripts/test
(scripts/lib.sh ensure_slurm), installed with every service start refused.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import remove_cgroup_tree
from helpers import spec, wait_for
from structlog.testing import capture_logs
from systemd_host import SystemdHost

from nodeagent.act import Outcome
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import Agent, open_agent
from nodeagent.discovery.layouts import classify
from nodeagent.gpu.model import Device, GpuProcess, GpuState, HoldKind, Topology
from nodeagent.policy.gpu_checks import violations
from nodeagent.policyfile.model import SlurmSettings
from nodeagent.report import TickRecord, allocations
from nodeagent.runtimes.gpus import RuntimeGpus
from nodeagent.sdbus import Systemd
from nodeagent.slurm import Answer, SlurmJobs, run_command

UNITS = ("munge.service", "slurmctld.service", "slurmd.service")
BINARIES = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch")
SCOPE_GLOB = "*slurmstepd.scope"
"""slurmstepd's scope in system.slice: `slurmstepd.scope`, or `<node>_slurmstepd.scope` where
slurmd is built for several per host, as Debian 12's is (`vm_slurmstepd.scope` in the VM)."""
UNKNOWN_JOB = "Invalid job id specified"
"""squeue's error (exit 1) for a job Slurm no longer knows: it ended and was purged."""
WAIT_S = 240.0  # TCG on a busy host: slurmd registers in tens of seconds
pytestmark = pytest.mark.timeout(600)  # the module's Slurm start waits up to 2 x WAIT_S
# glibc's getaddrinfo(AI_ADDRCONFIG), which Slurm uses, finds no IPv4 address where a host has
# only 127.0.0.1: the VM has nothing else. One documentation address on lo (RFC 5737).
EXTRA_ADDRESS = "192.0.2.1/32"
# Slurm's paths, as tmpfs mounts in systemd's mount namespace ($1: slurm's uid:gid, $2 munge's)
MOUNT = r"""
set -eu
for d in /etc/slurm /etc/munge /var/lib/slurm /var/log/slurm /var/lib/munge /var/log/munge; do
  mkdir -p "$d"
  mount -t tmpfs -o mode=0755 tmpfs "$d"
done
mkdir /var/lib/slurm/slurmctld /var/lib/slurm/slurmd
chown "$1" /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
chown "$2" /etc/munge /var/lib/munge /var/log/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown "$2" /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
# four fake GPUs' device nodes on an overlay of /dev, its upper layer a tmpfs (/dev's own mounts
# bound back on it); the VM's /dev is left as it was
mkdir /run/nodeagent-dev
mount -t tmpfs -o mode=0755 tmpfs /run/nodeagent-dev
mkdir /run/nodeagent-dev/upper /run/nodeagent-dev/work /run/nodeagent-dev/old
mount --rbind /dev /run/nodeagent-dev/old
mount -t overlay overlay \
  -o lowerdir=/dev,upperdir=/run/nodeagent-dev/upper,workdir=/run/nodeagent-dev/work /dev
for m in pts shm mqueue hugepages; do
  old="/run/nodeagent-dev/old/$m"
  if mountpoint -q "$old"; then mount --rbind "$old" "/dev/$m"; fi
done
for i in 0 1 2 3; do mknod -m 0666 "/dev/nvidia$i" c 195 "$i"; done
"""
CGROUP_CONF = (
    "CgroupPlugin=cgroup/v2\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n"
)
UNMOUNT = """
umount -R /dev
umount -R /run/nodeagent-dev/old
umount /run/nodeagent-dev
rmdir /run/nodeagent-dev
"""
GRES_CONF = "Name=gpu File=/dev/nvidia[0-3]\n"
GPUS = 4
DEVICES = tuple(
    Device(i, f"GPU-{i}{i}{i}{i}", "simulated GPU", f"0000:0{i}:00.0", i, 80 << 30, 0, (), None,
           simulated=True)
    for i in range(GPUS)
)  # fmt: skip
"""Simulated GPUs (the VM has none), their minor numbers 0-3 as /dev/nvidia[0-3]'s."""


def slurm_conf(node: str) -> str:
    """A one-node cluster; `node` is `slurmd -C`'s line for this machine."""
    name = socket.gethostname().split(".")[0]
    return f"""\
ClusterName=nodeagent-test
SlurmctldHost={name}(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
JobAcctGatherType=jobacct_gather/none
GresTypes=gpu
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
{node} NodeAddr=127.0.0.1 Gres=gpu:{GPUS} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SqueueFailed(AssertionError):
    """squeue did not answer (slurmctld down or starting): nothing is known of the job."""


class Slurm:
    """The cluster: its commands run in systemd's namespaces (munge's socket is in its /run)."""

    def __init__(self, host: SystemdHost) -> None:
        self.host = host

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.host.run(*argv, check=check)

    def squeue(self, argv: Sequence[str], timeout: float) -> Answer:
        """nodeagent.slurm's runner: the real squeue, entered into systemd's namespaces."""
        enter = ["nsenter", "-t", str(self.host.pid), "-p", "-m", "-C", "--"]
        return run_command([*enter, *argv], timeout)

    def sbatch(self, account: str, command: str, *options: str) -> str:
        done = self.run(
            "sbatch", "--parsable", f"--account={account}", "--chdir=/tmp",
            "--output=/dev/null", "--ntasks=1", "--cpus-per-task=1", *options, "--wrap", command,
        )  # fmt: skip
        return done.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        """The job's state as squeue shows it, '' once Slurm no longer lists it (ended and
        purged); SqueueFailed when squeue itself fails (slurmctld down or not up yet), which
        says nothing of the job."""
        done = self.run("squeue", "-h", "-t", "all", "-j", job, "-o", "%T", check=False)
        if done.returncode == 0:
            return done.stdout.strip()
        said = " ".join(done.stderr.split())
        if UNKNOWN_JOB in said:
            return ""
        raise SqueueFailed(f"squeue -j {job}: exited {done.returncode}: {said}")

    def shown(self, job: str) -> str:
        """The job's state for a message: squeue's, or how squeue failed."""
        try:
            return repr(self.state(job))
        except SqueueFailed as e:
            return str(e)

    def scope(self) -> Path:
        """slurmstepd's scope, which its first job makes: the one in system.slice."""
        (scope,) = self.host.outer("/system.slice").glob(SCOPE_GLOB)
        return scope

    def started(self, job: str) -> Path:
        """The job's cgroup, once it runs there (a task of its batch step holds a process:
        job_<id>/step_batch/user/task_0, slurmstepd itself in step_batch/slurm)."""

        def running() -> bool:
            with contextlib.suppress(OSError, ValueError):
                tasks = self.scope() / f"job_{job}" / "step_batch" / "user"
                return any(p.read_text().split() for p in tasks.rglob("cgroup.procs"))
            return False

        if not wait_for(running, WAIT_S, step=0.5):
            raise self.failure(f"job {job} never ran (squeue: {self.shown(job)})")
        return self.scope() / f"job_{job}"

    def cancel(self, *jobs: str) -> None:
        """Cancel the jobs and, once Slurm has ended them, remove what is left of their
        cgroups. In the test systemd's cgroup namespace slurmstepd cannot clean up as it does
        on a host: it moves itself to the namespace's root cgroup first, which is not the
        real root and has controllers on (EBUSY, "Unable to move pid ... to init root
        cgroup"), so the job's cgroup stays behind and the next test would find it."""
        self.run("scancel", *jobs, check=False)
        ended = ("", "CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        seen: dict[str, str] = {}  # each job's last state, or how squeue failed

        def done() -> bool:
            """Every job ended, as squeue says; a failing squeue (slurmctld restarting) says
            nothing of them, and the wait goes on. A job still running is cancelled again:
            a scancel slurmctld was not up to take was lost."""
            going = []
            for j in jobs:
                try:
                    state = self.state(j)
                except SqueueFailed as e:
                    seen[j] = str(e)
                    return False
                seen[j] = state or "not listed"
                if state not in ended:
                    going.append(j)
            if going:
                self.run("scancel", *going, check=False)
            return not going

        if not wait_for(done, WAIT_S, step=0.5):
            raise self.failure(f"jobs not ended {WAIT_S:.0f} s after scancel: {seen}")
        for job in jobs:
            with contextlib.suppress(ValueError):  # no scope: nothing to remove
                remove_cgroup_tree(self.scope() / f"job_{job}")

    def failure(self, reason: str) -> AssertionError:
        logs = self.run(
            "sh", "-c", "tail -n 15 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log",
            check=False,
        ).stdout  # fmt: skip
        where = subprocess.run(
            ["find", str(self.host.cgroup), "-maxdepth", "6", "-type", "d",
             "(", "-name", "job_*", "-o", "-name", "*slurm*", ")"],
            capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
        return AssertionError(
            f"{reason}\nSlurm's cgroups:\n{where}\n{logs}\n{self.host.journal_tail()}"
        )


@pytest.fixture(scope="module")
def slurm(systemd_host: SystemdHost) -> Iterator[Slurm]:
    host = systemd_host
    missing = [b for b in BINARIES if not Path(b).exists()]
    if missing:
        pytest.fail(
            f"Slurm is not installed ({', '.join(missing)} missing): ./scripts/test installs it",
            pytrace=False,
        )
    added = subprocess.run(["ip", "addr", "add", EXTRA_ADDRESS, "dev", "lo"], check=False)
    ids = [
        subprocess.run(["id", "-u", u], capture_output=True, text=True, check=True).stdout.strip()
        for u in ("slurm", "munge")
    ]
    host.run("sh", "-c", MOUNT, "mount", f"{ids[0]}:{ids[0]}", f"{ids[1]}:{ids[1]}")
    node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True)
    host.path("/etc/slurm/slurm.conf").write_text(slurm_conf(node.stdout.splitlines()[0]))
    host.path("/etc/slurm/cgroup.conf").write_text(CGROUP_CONF)
    host.path("/etc/slurm/gres.conf").write_text(GRES_CONF)
    for unit in UNITS:  # the packages' own units, installed as an operator does
        shutil.copy(f"/lib/systemd/system/{unit}", host.path(f"/etc/systemd/system/{unit}"))
    host.systemctl("daemon-reload")
    cluster = Slurm(host)
    try:
        for unit in UNITS:
            host.systemctl("start", unit)

        def idle() -> bool:
            return cluster.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() == "idle"

        if not wait_for(idle, WAIT_S, step=1.0):
            raise cluster.failure("the node never became idle in sinfo")
        yield cluster
    finally:
        cluster.run("scancel", "--full", "--user=root", check=False)
        for unit in reversed(UNITS):
            host.systemctl("stop", unit, check=False)
        host.run("sh", "-c", UNMOUNT, check=False)
        for unit in UNITS:
            host.path(f"/etc/systemd/system/{unit}").unlink(missing_ok=True)
        host.systemctl("daemon-reload", check=False)
        if added.returncode == 0:
            subprocess.run(["ip", "addr", "del", EXTRA_ADDRESS, "dev", "lo"], check=False)


RULES = [
    # Slurm records accounts in lower case: `sbatch --account=A` runs under account 'a'
    {"name": "slurm-a", "match": {"runtime": "slurm", "account": "a"}, "tenant": "A"},
    {"name": "slurm-b", "match": {"runtime": "slurm", "account": "b"}, "tenant": "B"},
    {"name": "slurm-other", "match": {"runtime": "slurm"}, "tenant": "other"},
]
TENANTS = {"A": {"shares": 3}, "B": {"shares": 1}, "other": {"shares": 1}}


def agent_for(host: SystemdHost, slurm: Slurm, tmp_path: Path, **settings: Any) -> Agent:
    policy = spec(
        "nodeagent.slice",
        tmp_path,
        agent={"resync_interval": 1, "replan_interval": 0, "slurm": {"timeout": 60, **settings}},
        fair_share={"active_threshold": 0},
        tenants=TENANTS,
        rules=RULES,
    )
    agent = open_agent(policy, CgroupTree(str(host.cgroup)))
    agent.rec.executor.units = Systemd(bus_address=host.system_bus_address, timeout=30)
    agent.rec.slurm = SlurmJobs(slurm.squeue)
    agent.prepare()
    return agent


def fair_share(shares: dict[str, float], usage: dict[str, float]) -> dict[str, float]:
    """Fair share's split as its design states it (docs/scheduling.md), worked
    out here on its own: each tenant's part is s*F over the sum of s*F, with s its share of
    the shares, u its part of the decayed usage and F = 2^(-u/s)."""
    total_usage = sum(usage.get(t, 0.0) for t in shares)
    s = {t: v / sum(shares.values()) for t, v in shares.items()}
    u = {t: usage.get(t, 0.0) / total_usage if total_usage else 0.0 for t in shares}
    weighted = {t: s[t] * 2 ** (-u[t] / s[t]) for t in shares}
    return {t: w / sum(weighted.values()) for t, w in weighted.items()}


def ticks(agent: Agent, n: int) -> tuple[list[TickRecord], list[MutableMapping[str, Any]]]:
    """n ticks a second apart; their records and the audit events of the cgroup writes."""
    records = []
    with capture_logs() as logs:
        for _ in range(n):
            records.append(agent.tick())
            time.sleep(1.0)
    return records, [e for e in logs if e["event"] == "cgroup.write"]


SETTINGS = frozenset(
    {
        "cgroup.freeze", "cgroup.subtree_control", "cgroup.max.depth", "cgroup.max.descendants",
        "cpu.weight", "cpu.max", "cpu.max.burst", "cpu.idle",
        "cpuset.cpus", "cpuset.mems", "cpuset.cpus.partition",
        "memory.min", "memory.low", "memory.high", "memory.max", "memory.swap.max",
        "memory.swap.high", "memory.zswap.max", "memory.oom.group",
        "io.weight", "io.max", "pids.max",
    }
)  # fmt: skip
"""The interface files a writer sets (not statistics, not cgroup.procs; not cpu.weight.nice,
which the kernel derives from cpu.weight)."""


def files(cgroup: Path) -> dict[str, str]:
    """Every setting below `cgroup` (its own included), with its value."""
    out = {}
    for path in sorted(cgroup.rglob("*")):
        if path.name in SETTINGS:
            with contextlib.suppress(OSError):
                out[str(path.relative_to(cgroup))] = path.read_text()
    return out


def inside(event: MutableMapping[str, Any], slurm: Slurm) -> bool:
    return str(event["path"]).startswith(f"{slurm.scope()}/")


def test_a_job_is_found_with_its_slurm_account_counted_and_left_alone(
    systemd_host: SystemdHost, slurm: Slurm, tmp_path: Path
) -> None:
    host = systemd_host
    busy = slurm.sbatch("A", "exec sh -c 'while :; do :; done'")
    idle = slurm.sbatch("B", "exec sleep 3600")
    try:
        job_a, job_b = slurm.started(busy), slurm.started(idle)
        before = files(slurm.scope())
        agent = agent_for(host, slurm, tmp_path)
        records, writes = ticks(agent, 4)
        last = records[-1]
        found = {i.path: i for i in agent.rec.registry.identities()}
        a_path, b_path = host.inner(job_a)[1:], host.inner(job_b)[1:]
        assert found[a_path].job_id == busy and found[b_path].job_id == idle
        rows = {r["cgroup"]: r for r in allocations(last)["allocations"]}
        assert (rows[a_path]["account"], rows[a_path]["tenant"]) == ("a", "A")
        assert (rows[b_path]["account"], rows[b_path]["tenant"]) == ("b", "B")
        assert rows[a_path]["write"] == "read-only"
        assert last.plan.tenant_usage["A"] > 0, "the busy job's CPU is counted for tenant A"
        (note,) = [n for n in last.plan.notes if n.kind == "hierarchy"]
        assert note.fields["planned"]["A"] > 0.5, note.message  # type: ignore[index]
        # the audit log: no write inside slurmstepd.scope, its files as slurmd left them
        assert [e for e in writes if inside(e, slurm)] == []
        assert files(slurm.scope()) == before
        refused = [r for rec in records for r in rec.results if r.path == a_path]
        assert refused and {r.outcome for r in refused} == {Outcome.READ_ONLY}
    finally:
        slurm.cancel(busy, idle)


def test_opted_in_only_the_jobs_own_cpu_weight_is_written(
    systemd_host: SystemdHost, slurm: Slurm, tmp_path: Path
) -> None:
    host = systemd_host
    busy = slurm.sbatch("A", "exec sh -c 'while :; do :; done'")
    other = slurm.sbatch("B", "exec sh -c 'while :; do :; done'")
    try:
        job_a, job_b = slurm.started(busy), slurm.started(other)
        before = files(slurm.scope())
        agent = agent_for(host, slurm, tmp_path, cpu_weight="write")
        records, writes = ticks(agent, 4)
        ours = sorted({str(e["path"]) for e in writes if inside(e, slurm)})
        assert ours == sorted([f"{job_a}/cpu.weight", f"{job_b}/cpu.weight"]), writes
        weights = {j: int((j / "cpu.weight").read_text()) for j in (job_a, job_b)}
        # The split fair share must plan, computed here from the policy's shares and the
        # usage the agent measured (its input): the jobs are the only workloads, one each.
        last = records[-1]
        assert sorted(a.tenant for a in last.assignments.values()) == ["A", "B"]
        usage = dict(last.plan.tenant_usage)
        want = fair_share({t: float(TENANTS[t]["shares"]) for t in ("A", "B")}, usage)
        (note,) = [n for n in last.plan.notes if n.kind == "hierarchy"]
        planned: dict[str, float] = note.fields["planned"]  # type: ignore[assignment]
        # the plan's split is fair share's, to the weights' 5% deadband (kept weights)
        assert planned == pytest.approx(want, abs=0.03), (planned, want, usage)
        # the files hold it: a ratio of two weights each within the deadband of its target
        ratio = weights[job_a] / weights[job_b]
        assert ratio == pytest.approx(want["A"] / want["B"], rel=0.12), (weights, want, usage)
        after = files(slurm.scope())
        changed = sorted(k for k in after if after[k] != before.get(k))
        rel = [str(j.relative_to(slurm.scope())) for j in (job_a, job_b)]
        assert changed == sorted(f"{r}/cpu.weight" for r in rel), "only the jobs' weights"
        mode = {c.path: c.write for c in records[-1].plan.cgroups}
        assert str(mode[host.inner(job_a)[1:]]) == "weight-only"
    finally:
        slurm.cancel(busy, other)


def test_slurm_not_answering_is_one_line_and_rules_without_accounts_still_claim_the_job(
    systemd_host: SystemdHost, slurm: Slurm, tmp_path: Path
) -> None:
    host = systemd_host
    job = slurm.sbatch("A", "exec sleep 3600")
    try:
        cgroup = slurm.started(job)
        host.systemctl("stop", "slurmctld.service")
        agent = agent_for(host, slurm, tmp_path, timeout=30)
        with capture_logs() as logs:
            record = agent.tick()
        (event,) = [e for e in logs if e["event"] == "slurm.unreachable"]
        said = str(event["error"])
        assert said.startswith(f"/usr/bin/squeue --jobs={job}: exited 1: "), said
        assert "\n" not in str(event["error"])
        assert record.assignments[host.inner(cgroup)[1:]].tenant == "other"
        assert agent.rec.slurm.problem == event["error"]
    finally:
        host.systemctl("start", "slurmctld.service", check=False)
        slurm.cancel(job)


def test_a_jobs_gres_gpus_are_its_hold_and_only_a_process_nobody_granted_is_a_violation(
    systemd_host: SystemdHost, slurm: Slurm
) -> None:
    """Issue 35: the real `scontrol show job -d` read into the job's hold, joined to the job's
    cgroup as discovery reads it; this node's entry found by the name slurmd gave its scope."""
    host = systemd_host
    began = time.monotonic()
    job = slurm.sbatch("A", "exec sleep 3600", "--gres=gpu:2")
    try:
        path = host.inner(slurm.started(job))[1:]
        line = slurm.run("scontrol", "show", "job", "-d", "--oneliner", job).stdout
        print(f"\nscontrol show job -d --oneliner {job}:\n{line}")
        assert "GRES=gpu:2(IDX:0-1)" in line.split(), line  # a fresh node: its first two
        identity = classify(path, "nodeagent.slice")
        assert identity is not None and identity.job_id == job
        task = f"{path}/step_batch/user/task_0"
        processes = (
            GpuProcess(301, DEVICES[1].uuid, None, task),  # on a GPU it was given
            GpuProcess(302, DEVICES[3].uuid, None, task),  # on one it was not
            GpuProcess(303, DEVICES[0].uuid, None, "system.slice/munge.service"),  # no job's
        )
        state = GpuState(DEVICES, Topology(), (), processes, (), "simulated", True)
        giver = SlurmJobs(slurm.squeue).gpus(SlurmSettings(timeout=60))
        gpus = RuntimeGpus()
        holds = gpus.holds(giver, state, [identity], {}, ())
        assert [(h.owner, h.kind, h.uuids, h.indices, h.cgroup) for h in holds] == [
            (f"slurm:{job}", HoldKind.RUNTIME, (DEVICES[0].uuid, DEVICES[1].uuid), (0, 1), path)
        ]
        judged = replace(state, holds=holds)
        assert [(p.pid, kind) for p, kind, _ in violations(judged)] == [
            (302, "wrong-gpu"),
            (303, "unassigned"),
        ]
        gpus.holds(giver, state, [identity], {}, ())
        assert gpus.asked == 1  # kept for the job's life
    finally:
        slurm.cancel(job)
    print(f"GRES test: {time.monotonic() - began:.1f} s")
