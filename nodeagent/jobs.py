"""Jobs that `nodeagent exec` starts: each in a cgroup of its own under the managed root.

The CLI forks the command's process, which waits on a pipe; it asks the daemon over the
API to start the job, naming that process. The daemon checks the request (a known tenant
and class, a free and safe name, a deadline in the future, positive work, and a pid that
is the caller's own child), makes the cgroup, has the job's limits written, moves the
process in, and records the job; only then does the CLI let the process exec the command.
So the command runs in its cgroup, under its limits, from its first instruction, and only
the daemon ever writes cgroup files.

The limits are not this module's: the job's cgroup is planned as the fast path plans any
new workload (policy.newcomer: StaticLimits on the job's assignment, its caps and the CPUs
it is pinned to) and written by the executor, audited and recorded as every write is, by
the `write_limits` the start is given; every tick's plan then holds them too.

A job is managed whether or not a rule matches its path: its tenant, class, deadline and
work come from the request. Its limits do too, but for a caller other than root each of
cpu.max, memory.max and pids.max is the tightest of the request's, the caller's own
cgroups' (the cgroup /proc says it runs in and every ancestor: its process leaves them
behind when it moves into the managed root, which has none) and the policy's
`jobs.per_user_limits` (pids 4096 by default): a user's job is never less bounded than
the user's session. Root's jobs take the request alone: root is the operator. The job
records where each limit came from. A deadline from a caller other than root is that
caller's word: taken only in a class whose `declared_deadlines` grants it, and marked as
declared (`Assignment.declared`), so that the policies defend it only where that says so.
Its record and cgroup go away when the cgroup empties (the CLI says so when the command
exits; the loop also sees cgroup.events 'populated 0'). Records are kept in the state
file, so a restarted daemon keeps managing the jobs that still run.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Protocol

import structlog
from pydantic import Field, ValidationError

from nodeagent.access import check_deadline, tenant_and_class
from nodeagent.api.bodies import (
    MAX_CPUS,
    MIN_MEMORY,
    Body,
    Classed,
    Cpus,
    Instant,
    Memory,
    Name,
    Pid,
    Pids,
    Text,
    Token,
    Work,
    check_future,
    check_name,
    problem,
)
from nodeagent.api.peer import Peer
from nodeagent.cgroupfs import parse as parse_file
from nodeagent.cgroupfs.paths import split_path
from nodeagent.cgroupfs.tree import AuditFn, CgroupTree, CgroupVanished
from nodeagent.cgroupfs.values import Attribute
from nodeagent.discovery.layouts import classify
from nodeagent.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NodeagentError,
    NotFound,
    Refused,
    UnsafePath,
    one_line,
)
from nodeagent.gpu.model import Hold
from nodeagent.gpu.procs import cgroup_of
from nodeagent.identity import WorkloadIdentity
from nodeagent.policy.base import Assignment
from nodeagent.policyfile.model import Limits, PolicySpec, WorkloadClass
from nodeagent.snapshot import NO_NEEDS, Needs, NodeSnapshot
from nodeagent.state import CapName, JobRecord

log = structlog.get_logger("nodeagent.jobs")

__all__ = ["MIN_MEMORY", "Job", "Jobs", "WriteLimits", "check_name"]

WriteLimits = Callable[[WorkloadIdentity, Assignment], Sequence[str]]
"""Plan a new job's cgroup with its assignment as the fast path plans a newcomer, and have
the executor write it; what of it is not in place, one line each (empty: all of it is)."""

Bounds = dict[CapName, tuple[float, str]]
"""The tightest value found of each cap, and where it comes from."""
FROM_REQUEST = "the request"
FROM_POLICY = "jobs.per_user_limits"


def _tighter(into: Bounds, offered: Mapping[CapName, tuple[float, str]]) -> None:
    """Take each cap `offered` that is tighter than what `into` holds; a tie keeps the
    source found first."""
    for name, (value, source) in offered.items():
        if name not in into or value < into[name][0]:
            into[name] = (value, source)


def _given(source: str, caps: Mapping[CapName, float | str | None]) -> Bounds:
    """`caps` that bound something, from `source`: None and 'max' bound nothing, nor do more
    CPUs than a job may ask for (MAX_CPUS: no node has them, and no record keeps them)."""
    return {
        name: (value, source)
        for name, value in caps.items()
        if isinstance(value, float | int) and not (name == "cpus" and value > MAX_CPUS)
    }


def cgroup_bounds(tree: CgroupTree, path: str) -> Bounds:
    """The tightest cpu.max (in cores), memory.max and pids.max of the cgroup `path` and of
    each of its ancestors up to the root, each with the cgroup that sets it: what bounds a
    process there, which a job started from there leaves behind. A file that is missing
    (its controller is off there) or 'max' bounds nothing (see `_given`). Raises
    UnsafePath for a path outside the tree, NodeagentError, CgroupVanished or ValueError
    where a file cannot be read or parsed."""
    parts = split_path(path)
    found: Bounds = {}
    for depth in range(len(parts), -1, -1):  # the caller's own cgroup first: it wins ties
        at = "/".join(parts[:depth])
        with tree.open(at) as d:
            cpu, memory, pids = (
                d.read_optional(a)
                for a in (Attribute.CPU_MAX, Attribute.MEMORY_MAX, Attribute.PIDS_MAX)
            )
        _tighter(
            found,
            _given(
                f"cgroup {at or '/'}",
                {
                    "cpus": None if cpu is None else parse_file.cpu_max(cpu).cores,
                    "memory": None if memory is None else parse_file.limit(memory),
                    "pids": None if pids is None else parse_file.pids_max(pids).limit,
                },
            ),
        )
    return found


@dataclass(frozen=True, slots=True)
class Job:
    name: str
    cgroup: str
    tenant: str
    workload_class: WorkloadClass
    uid: int
    pid: int
    submitted_at: float
    deadline: float | None = None
    work: float | None = None
    cpus: float | None = None
    memory: int | None = None
    gpus: tuple[str, ...] = field(default_factory=tuple)
    gpu_hold: str | None = None
    """The id of its GPU hold: what its end releases (None: it holds no GPUs)."""
    pinned_cpus: tuple[int, ...] = ()
    """The CPUs its cpuset.cpus holds, sorted: its GPUs' (gpu.pin_cpus), where its cgroup
    has the cpuset controller; none: not pinned."""
    pids: int | None = None
    limits_from: tuple[tuple[CapName, str], ...] = ()
    """Where each of cpus, memory and pids came from, sorted by name: the request, a cgroup
    of the caller's (`cgroup user.slice/user-1000.slice`) or jobs.per_user_limits."""

    def assignment(self) -> Assignment:
        caps = {"cpu_max": self.cpus, "memory_max": self.memory, "pids_max": self.pids}
        limits = Limits.model_validate({k: v for k, v in caps.items() if v is not None})
        return Assignment(
            f"exec:{self.name}",
            self.tenant,
            self.workload_class,
            limits,
            deadline=self.deadline,
            work=self.work,
            cpus=self.cpus,
            exec_job=True,
            cpuset=self.pinned_cpus,
            declared=(
                f"uid {self.uid} through nodeagent exec"
                if self.uid != 0 and self.deadline is not None
                else None
            ),
        )

    def to_json(self) -> dict[str, Any]:
        """The job as the API answers it: its state-file record's fields, today."""
        return self.record().to_json()

    def record(self) -> JobRecord:
        """The job as the state file keeps it."""
        return JobRecord(
            name=self.name, cgroup=self.cgroup, tenant=self.tenant,
            workload_class=self.workload_class, uid=self.uid, pid=self.pid,
            submitted_at=self.submitted_at, deadline=self.deadline, work=self.work,
            cpus=self.cpus, memory=self.memory, gpus=self.gpus, gpu_hold=self.gpu_hold,
            pinned_cpus=self.pinned_cpus, pids=self.pids, limits_from=dict(self.limits_from),
        )  # fmt: skip

    @classmethod
    def from_record(cls, r: JobRecord) -> Job:
        return cls(
            name=r.name, cgroup=r.cgroup, tenant=r.tenant, workload_class=r.workload_class,
            uid=r.uid, pid=r.pid, submitted_at=r.submitted_at, deadline=r.deadline,
            work=r.work, cpus=r.cpus, memory=r.memory, gpus=r.gpus, gpu_hold=r.gpu_hold,
            pinned_cpus=r.pinned_cpus, pids=r.pids,
            limits_from=tuple(sorted(r.limits_from.items())),
        )  # fmt: skip


class StartBody(Classed):
    """POST /v1/jobs."""

    name: Name
    pid: Pid
    deadline: Instant | None = None
    work: Work | None = None
    cpus: Cpus | None = None
    memory: Memory | None = None
    pids: Pids | None = None
    gpu_request: Token | None = None


class FinishBody(Body):
    """DELETE /v1/jobs."""

    name: Text
    exit_status: Annotated[int, Field(ge=0, le=255)] | None = None


class Process(Protocol):
    """A process held by a pidfd, so that its pid cannot come to name another one unseen."""

    def alive(self) -> bool:
        """Not yet reaped: its pid still names it (a zombie's pid is not reused)."""
        ...

    def close(self) -> None: ...


class Pidfd:
    def __init__(self, pid: int) -> None:
        self.fd = os.pidfd_open(pid)

    def alive(self) -> bool:
        try:
            signal.pidfd_send_signal(self.fd, 0)
        except ProcessLookupError:
            return False
        return True

    def close(self) -> None:
        os.close(self.fd)


def _parent_and_uid(pid: int, proc_root: str) -> tuple[int, int]:
    """(PPid, real Uid) of a process, from /proc/<pid>/status."""
    ppid = uid = -1
    try:
        with open(
            os.path.join(proc_root, str(pid), "status"), encoding="ascii", errors="replace"
        ) as f:
            for line in f:
                if line.startswith("PPid:"):
                    ppid = int(line.split()[1])
                elif line.startswith("Uid:"):
                    uid = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return ppid, uid


class Jobs:
    """The jobs `nodeagent exec` started; shared by the API threads and the loop."""

    def __init__(
        self,
        tree: CgroupTree,
        audit: AuditFn,
        proc_root: str = "/proc",
        on_end: Callable[[Job], None] = lambda _: None,
    ) -> None:
        self.tree = tree
        self.audit = audit
        self.proc_root = proc_root
        self.on_end = on_end
        """Called exactly once when a job is gone (its GPUs go back)."""
        self.open_process: Callable[[int], Process] = Pidfd
        self._jobs: dict[str, Job] = {}
        self._said: set[tuple[int, str]] = set()
        """(uid, problem kind) already logged: a caller's cgroups that could not be read."""

    # --- the API's side ---------------------------------------------------------------

    def start(
        self,
        request: StartBody,
        peer: Peer,
        spec: PolicySpec,
        now: float,
        *,
        write_limits: WriteLimits,
        claim_gpus: Callable[[str, Job], Hold] | None = None,
    ) -> Job:
        """Check a request, make the job's cgroup with its limits (`write_limits`: through
        the executor), move its process in. With `gpu_request` in the body, `claim_gpus`
        turns that grant into the job's own."""
        job, process = self._check(request, peer, spec, now)
        try:
            self._admit(job, spec)
            hold = None
            if request.gpu_request is not None:
                if claim_gpus is None:
                    raise BadRequest("this daemon has no GPUs to give")
                hold = claim_gpus(request.gpu_request, job)
                job = replace(job, gpus=hold.uuids, gpu_hold=hold.id)
            try:
                job = self._make_cgroup(job, spec, hold, process, write_limits)
            except BaseException:
                if hold is not None:
                    self.on_end(job)
                raise
            self._jobs[job.name] = job
        finally:
            process.close()
        log.info(
            "job.started",
            job=job.name,
            cgroup=job.cgroup,
            tenant=job.tenant,
            workload_class=str(job.workload_class),
            deadline=job.deadline,
            work=job.work,
            pid=job.pid,
            uid=job.uid,
            cpus=job.cpus,
            memory=job.memory,
            pids=job.pids,
            limits_from=dict(job.limits_from),
        )
        return job

    def _admit(self, job: Job, spec: PolicySpec) -> None:
        """A free name, and room under the caller's cap (root has none)."""
        if job.name in self._jobs:
            raise Conflict(f"job name {job.name!r} is taken by a running job; pick another")
        most = spec.jobs.max_per_user
        if job.uid != 0 and sum(j.uid == job.uid for j in self._jobs.values()) >= most:
            raise Conflict(
                f"uid {job.uid} runs {most} jobs already, the most jobs.max_per_user allows"
            )

    def finish(self, request: FinishBody, peer: Peer) -> Job:
        """The CLI's word that the command exited; the cgroup goes when it is empty."""
        job = self._jobs.get(request.name)
        if job is None:
            raise NotFound(f"no running job named {request.name!r}")
        if peer.uid not in (0, job.uid):
            raise Forbidden(f"job {request.name!r} belongs to uid {job.uid}")
        self._remove_if_empty(job, request.exit_status)
        return job

    def _check(
        self, body: StartBody, peer: Peer, spec: PolicySpec, now: float
    ) -> tuple[Job, Process]:
        """The job a request describes, and its process held by a pidfd (the caller closes
        it), or the one-line reason it is refused."""
        tenant, cls = tenant_and_class(spec, peer, body.tenant, body.workload_class)
        deadline, work = body.deadline, body.work
        if (deadline is None) != (work is None):
            raise BadRequest("a deadline needs the work it is for, and work needs a deadline")
        check_future(deadline, now)
        if deadline is not None:
            check_deadline(spec, peer, cls)
        pid = body.pid
        refused = Forbidden(
            f"process {pid} is not a child of the calling process {peer.pid} (uid {peer.uid})"
        )
        try:
            process = self.open_process(pid)
        except OSError:
            raise refused from None
        # read while the pidfd holds the process: alive after the read, the read was of it
        ppid, uid = _parent_and_uid(pid, self.proc_root)
        if ppid != peer.pid or uid != peer.uid or not process.alive():
            process.close()
            raise refused
        try:
            bounds = self._bounds(body, peer, spec)
        except BaseException:
            process.close()
            raise
        got = {name: value for name, (value, _) in bounds.items()}
        cpus, memory, pids = got.get("cpus"), got.get("memory"), got.get("pids")
        job = Job(
            name=body.name,
            cgroup=f"{spec.agent.managed_root}/{body.name}",
            tenant=tenant,
            workload_class=cls,
            uid=peer.uid,
            pid=pid,
            submitted_at=now,
            deadline=deadline,
            work=work,
            cpus=None if cpus is None else float(cpus),
            memory=None if memory is None else int(memory),
            pids=None if pids is None else int(pids),
            limits_from=tuple(sorted((name, source) for name, (_, source) in bounds.items())),
        )
        return job, process

    def _bounds(self, body: StartBody, peer: Peer, spec: PolicySpec) -> Bounds:
        """The job's caps, each the tightest of the request's and, for a caller other than
        root, its own cgroups' and jobs.per_user_limits'; refused where the caller's cgroups
        leave too little for any job."""
        found: Bounds = {}
        _tighter(
            found,
            _given(FROM_REQUEST, {"cpus": body.cpus, "memory": body.memory, "pids": body.pids}),
        )
        if peer.uid == 0:
            return found  # root is the operator: what it asks for is the whole of it
        _tighter(found, self._caller_bounds(peer))
        per_user = spec.jobs.per_user_limits
        _tighter(
            found,
            _given(
                FROM_POLICY,
                {
                    "cpus": per_user.cpu_max,
                    "memory": per_user.memory_max,
                    "pids": per_user.pids_max,
                },
            ),
        )
        memory, pids = found.get("memory"), found.get("pids")
        for cap, least, what in ((memory, MIN_MEMORY, "bytes of memory"), (pids, 1, "tasks")):
            if cap is not None and cap[0] < least:
                raise Forbidden(
                    f"uid {peer.uid}: {cap[1]} allows {int(cap[0])} {what}, too few for a job"
                    f" (at least {least})"
                )
        return found

    def _caller_bounds(self, peer: Peer) -> Bounds:
        """`cgroup_bounds` of the cgroup the caller runs in; none where /proc does not say
        which, that cgroup is outside the agent's cgroup root (another cgroup namespace's)
        or cannot be read: the job is then bounded by its request and the policy alone,
        logged once per uid and kind of problem."""
        cgroup = cgroup_of(peer.pid, self.proc_root)
        try:
            if cgroup is None:
                raise NodeagentError(f"no cgroup v2 line in {self.proc_root}/{peer.pid}/cgroup")
            return cgroup_bounds(self.tree, cgroup)
        except UnsafePath as e:
            kind, problem = "outside", one_line(e)
        except (NodeagentError, CgroupVanished, ValueError) as e:
            kind, problem = "unreadable", one_line(e)
        if (peer.uid, kind) not in self._said:
            self._said.add((peer.uid, kind))
            log.warning(
                "job.caller_limits_unknown",
                uid=peer.uid,
                cgroup=cgroup,
                problem=problem,
                action="its jobs are bounded by their request and jobs.per_user_limits only",
            )
        return {}

    def _make_cgroup(
        self,
        job: Job,
        spec: PolicySpec,
        hold: Hold | None,
        process: Process,
        write_limits: WriteLimits,
    ) -> Job:
        """Make the job's cgroup, have its limits written, then move its process in; the job
        as recorded (with the CPUs it is pinned to). Refused, its cgroup removed, if any
        of it fails: the command never runs outside its cgroup or without its limits."""
        try:
            if not self.tree.mkdir(job.cgroup):
                raise Conflict(f"job name {job.name!r} is taken: cgroup {job.cgroup} exists")
        except NodeagentError as e:
            if isinstance(e, Conflict):
                raise
            raise BadRequest(f"cannot make the job's cgroup: {e}") from e
        self.audit(self.tree.path_of(job.cgroup), "mkdir", None, "cgroup", f"job {job.name}")
        try:
            with self.tree.open(job.cgroup) as d:
                pin = hold is not None and spec.gpu.pin_cpus and d.has("cpuset.cpus")
            if pin and hold is not None:
                job = replace(job, pinned_cpus=tuple(sorted(set(hold.cpus))))
            identity = classify(job.cgroup, spec.agent.managed_root)
            if identity is None:  # cannot be: a checked name right under the managed root
                raise BadRequest(f"cgroup {job.cgroup} is not a job's")
            missed = write_limits(identity, job.assignment())
            if missed:
                raise BadRequest(
                    f"cannot start job {job.name!r}: its limits are not in place: "
                    + "; ".join(missed)
                )
            with self.tree.open(job.cgroup) as d:
                if not process.alive():
                    raise Forbidden(f"process {job.pid} ended before it could be moved")
                d.write("cgroup.procs", str(job.pid))
                if not process.alive():
                    # It was reaped around the write: the pid may have named another process
                    # by then. Whatever went in is put back at the root, and the job refused.
                    self._evict(job)
                    raise Forbidden(f"process {job.pid} ended while it was being moved")
                self.audit(
                    self.tree.path_of(job.cgroup) + "/cgroup.procs",
                    "cgroup.procs",
                    None,
                    str(job.pid),
                    f"job {job.name}: its process, before it runs the command",
                )
        except BaseException as e:
            self._rmdir(job)
            if isinstance(e, Refused) or not isinstance(e, NodeagentError | CgroupVanished):
                raise
            raise BadRequest(f"cannot start job {job.name!r}: {one_line(e)}") from e
        return job

    def _evict(self, job: Job) -> None:
        """Move every process in a refused job's cgroup to the cgroup root."""
        with self.tree.open(job.cgroup) as d:
            strays = d.read("cgroup.procs").split()
        with self.tree.open("") as root:
            for pid in strays:
                root.write("cgroup.procs", pid)
                self.audit(
                    os.path.join(self.tree.root, "cgroup.procs"),
                    "cgroup.procs",
                    None,
                    pid,
                    f"job {job.name} refused: pid {pid} went into its cgroup after its"
                    f" process {job.pid} ended",
                )
        log.warning("job.pid_reused", job=job.name, pid=job.pid, moved_to_root=strays)

    # --- the loop's side --------------------------------------------------------------

    def assignments(self) -> dict[str, Assignment]:
        return {j.cgroup: j.assignment() for j in self._jobs.values()}

    def get(self, cgroup: str) -> Job | None:
        return next((j for j in self._jobs.values() if j.cgroup == cgroup), None)

    def running(self) -> list[Job]:
        return list(self._jobs.values())

    @staticmethod
    def needs(assignment: Assignment) -> Needs:
        """What `reap` reads of a workload every tick: a job's cgroup.events, so that its
        cgroup is removed as soon as it is empty."""
        return Needs(events=True) if assignment.exec_job else NO_NEEDS

    def ended(self, snapshot: NodeSnapshot) -> list[Job]:
        """The jobs whose cgroup the snapshot found gone or empty (no I/O: the tick decides
        with it, and `reap` acts on it)."""
        running = self.running()
        if not running:
            return []  # the usual node: no exec jobs, nothing to look up
        states = {w.path: w for w in snapshot.workloads}
        return [
            job
            for job in running
            if job.cgroup in snapshot.vanished
            or ((w := states.get(job.cgroup)) is not None and w.sample.populated is False)
        ]

    def reap(self, ended: Iterable[Job]) -> list[Job]:
        """Forget the `ended` jobs, removing their empty cgroups; those gone."""
        return [job for job in ended if self._remove_if_empty(job, None)]

    def _remove_if_empty(self, job: Job, exit_status: object) -> bool:
        """Remove `job` if it is still the record of its name (not a successor of the same
        name started since it was looked up) and its cgroup is empty; whether it did. The
        check, the rmdir and the removal are one step on the loop's thread (the only one that
        touches the jobs: `finish` is a command the loop runs), so on_end runs once."""
        if self._jobs.get(job.name) is not job:
            return False
        try:
            with self.tree.open(job.cgroup) as d:
                if d.read("cgroup.procs").split():
                    return False  # something it started still runs: removed later
        except CgroupVanished:
            pass
        except NodeagentError as e:
            log.warning("job.check_failed", job=job.name, cgroup=job.cgroup, error=str(e))
            return False
        self._rmdir(job)
        del self._jobs[job.name]
        self.on_end(job)
        log.info("job.finished", job=job.name, cgroup=job.cgroup, exit_status=exit_status)
        return True

    def _rmdir(self, job: Job) -> None:
        try:
            with self.tree.open(job.cgroup.rsplit("/", 1)[0]) as parent:
                os.rmdir(job.name, dir_fd=parent.fd)
        except FileNotFoundError:
            return
        except (OSError, NodeagentError) as e:
            log.warning("job.rmdir_failed", job=job.name, cgroup=job.cgroup, error=one_line(e))
            return
        self.audit(self.tree.path_of(job.cgroup), "rmdir", "cgroup", "-", f"job {job.name} ended")

    # --- the state file ---------------------------------------------------------------

    def dump(self) -> list[dict[str, Any]]:
        """The jobs as the state file keeps them (JobRecord's JSON)."""
        return [j.record().to_json() for j in self._jobs.values()]

    def load(self, records: Iterable[Mapping[str, Any]], managed_root: str) -> None:
        """Restore the jobs of a previous run whose cgroups still exist; a malformed record
        is dropped with a warning, the others kept."""
        for i, record in enumerate(records):
            try:
                job = Job.from_record(JobRecord.from_json(record))
            except ValidationError as e:
                log.warning("state.job_dropped", record=i, error=problem(e))
                continue
            if job.cgroup != f"{managed_root}/{job.name}":
                continue  # the managed root moved: not ours any more
            try:
                with self.tree.open(job.cgroup):
                    pass
            except (CgroupVanished, NodeagentError):
                continue
            self._jobs.setdefault(job.name, job)

    def adopt(self, name: str, hold_id: str) -> None:
        """Record the hold of a job restored from a file written before holds had ids."""
        job = self._jobs.get(name)
        if job is not None and job.gpu_hold is None:
            self._jobs[name] = replace(job, gpu_hold=hold_id)
