"""Jobs that `nodeagent exec` starts: each in a cgroup of its own under the managed root.

The CLI forks the command's process, which waits on a pipe; it asks the daemon over the
API to start the job, naming that process. The daemon checks the request (a known tenant
and class, a free and safe name, a deadline in the future, positive work, and a pid that
is the caller's own child), makes the cgroup, writes the job's limits, moves the process
in, and records the job; only then does the CLI let the process exec the command. So the
command runs in its cgroup, under its limits, from its first instruction, and only the
daemon ever writes cgroup files.

A job is managed whether or not a rule matches its path: its tenant, class, deadline,
work and limits come from the request. Its record and cgroup go away when the cgroup
empties (the CLI says so when the command exits; the loop also sees cgroup.events
'populated 0'). Records are kept in the state file, so a restarted daemon keeps managing
the jobs that still run.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import structlog

from nodeagent.api.peer import Peer
from nodeagent.api.server import ApiBadRequest, ApiConflict, ApiForbidden, ApiNotFound
from nodeagent.cgroupfs.tree import AuditFn, CgroupTree, CgroupVanished
from nodeagent.cgroupfs.values import Attribute, CpuMax, MemoryLimit
from nodeagent.errors import NodeagentError, one_line
from nodeagent.gpu.model import Hold, format_cpulist
from nodeagent.policy.base import Assignment
from nodeagent.snapshot import NodeSnapshot
from nodeagent.spec.model import Limits, PolicySpec, WorkloadClass

log = structlog.get_logger("nodeagent.jobs")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@+-]{0,62}")
"""A job name is its cgroup's name: one path component, no '/', not '.', at most 63."""
_RESERVED_SUFFIXES = (".slice", ".scope", ".service", ".mount", ".socket")
MIN_MEMORY = 1 << 20


def check_name(name: str) -> str:
    """The name, or a one-line reason it cannot name a cgroup."""
    if not NAME.fullmatch(name) or name.endswith(_RESERVED_SUFFIXES):
        raise ApiBadRequest(
            f"job name {name!r} is not a safe cgroup name: use 1 to 63 letters, digits and"
            " '_.@+-', starting with a letter or digit, not ending in a systemd unit suffix"
        )
    return name


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

    def assignment(self) -> Assignment:
        limits = Limits.model_validate(
            {
                k: v
                for k, v in {"cpu_max": self.cpus, "memory_max": self.memory}.items()
                if v is not None
            }
        )
        return Assignment(
            f"exec:{self.name}",
            self.tenant,
            self.workload_class,
            limits,
            deadline=self.deadline,
            work=self.work,
            cpus=self.cpus,
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["workload_class"] = str(self.workload_class)
        data["gpus"] = list(self.gpus)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Job:
        return cls(
            name=check_name(str(data["name"])),
            cgroup=str(data["cgroup"]),
            tenant=str(data["tenant"]),
            workload_class=WorkloadClass(data["workload_class"]),
            uid=int(data["uid"]),
            pid=int(data["pid"]),
            submitted_at=float(data["submitted_at"]),
            deadline=None if data.get("deadline") is None else float(data["deadline"]),
            work=None if data.get("work") is None else float(data["work"]),
            cpus=None if data.get("cpus") is None else float(data["cpus"]),
            memory=None if data.get("memory") is None else int(data["memory"]),
            gpus=tuple(str(g) for g in data.get("gpus") or ()),
        )


def _number(body: Mapping[str, Any], key: str, *, positive: bool = True) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ApiBadRequest(f"{key} must be a number, got {value!r}")
    if positive and value <= 0:
        raise ApiBadRequest(f"{key} must be positive, got {value:g}")
    return float(value)


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
        """Called once when a job is gone (its GPUs go back)."""
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    # --- the API's side ---------------------------------------------------------------

    def start(
        self,
        body: Mapping[str, Any],
        peer: Peer,
        spec: PolicySpec,
        now: float,
        claim_gpus: Callable[[object, str, str], Hold] | None = None,
    ) -> Job:
        """Check a request, make the job's cgroup with its limits, move its process in.
        With `gpu_request` in the body, `claim_gpus` turns that grant into the job's own."""
        job = self._check(body, peer, spec, now)
        with self._lock:
            if job.name in self._jobs:
                raise ApiConflict(f"job name {job.name!r} is taken by a running job; pick another")
            hold = None
            if body.get("gpu_request") is not None:
                if claim_gpus is None:
                    raise ApiBadRequest("this daemon has no GPUs to give")
                hold = claim_gpus(body["gpu_request"], job.name, job.cgroup)
                job = replace(job, gpus=hold.uuids)
            try:
                self._make_cgroup(job, spec, hold)
            except BaseException:
                if hold is not None:
                    self.on_end(job)
                raise
            self._jobs[job.name] = job
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
        )
        return job

    def finish(self, body: Mapping[str, Any], peer: Peer) -> Job:
        """The CLI's word that the command exited; the cgroup goes when it is empty."""
        name = str(body.get("name", ""))
        with self._lock:
            job = self._jobs.get(name)
            if job is None:
                raise ApiNotFound(f"no running job named {name!r}")
            if peer.uid not in (0, job.uid):
                raise ApiForbidden(f"job {name!r} belongs to uid {job.uid}")
        self._remove_if_empty(job, body.get("exit_status"))
        return job

    def _check(self, body: Mapping[str, Any], peer: Peer, spec: PolicySpec, now: float) -> Job:
        name = check_name(str(body.get("name", "")))
        tenant = body.get("tenant") or spec.jobs.default_tenant
        if tenant is None:
            raise ApiBadRequest(
                "no tenant: pass --tenant, or name a default in the policy (jobs.default_tenant)"
            )
        if tenant not in spec.tenants:
            close = difflib.get_close_matches(str(tenant), list(spec.tenants), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ApiBadRequest(
                f"unknown tenant {tenant!r}{hint} (tenants: {', '.join(sorted(spec.tenants))})"
            )
        raw_class = body.get("class") or str(spec.jobs.default_class)
        try:
            cls = WorkloadClass(raw_class)
        except ValueError:
            names = ", ".join(c.value for c in WorkloadClass)
            raise ApiBadRequest(f"unknown class {raw_class!r} (classes: {names})") from None
        deadline, work = _number(body, "deadline"), _number(body, "work")
        if (deadline is None) != (work is None):
            raise ApiBadRequest("a deadline needs the work it is for, and work needs a deadline")
        if deadline is not None and deadline <= now:
            raise ApiBadRequest(f"the deadline is {now - deadline:.0f} s in the past")
        cpus, memory = _number(body, "cpus"), _number(body, "memory")
        if memory is not None and memory < MIN_MEMORY:
            raise ApiBadRequest(f"memory {memory:.0f} bytes is below 1Mi")
        pid = body.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
            raise ApiBadRequest(f"pid must be a process id, got {pid!r}")
        ppid, uid = _parent_and_uid(pid, self.proc_root)
        if ppid != peer.pid or uid != peer.uid:
            raise ApiForbidden(
                f"process {pid} is not a child of the calling process {peer.pid} (uid {peer.uid})"
            )
        return Job(
            name=name,
            cgroup=f"{spec.agent.managed_root}/{name}",
            tenant=str(tenant),
            workload_class=cls,
            uid=peer.uid,
            pid=pid,
            submitted_at=now,
            deadline=deadline,
            work=work,
            cpus=cpus,
            memory=None if memory is None else int(memory),
        )

    def _make_cgroup(self, job: Job, spec: PolicySpec, hold: Hold | None) -> None:
        try:
            if not self.tree.mkdir(job.cgroup):
                raise ApiConflict(f"job name {job.name!r} is taken: cgroup {job.cgroup} exists")
        except NodeagentError as e:
            if isinstance(e, ApiConflict):
                raise
            raise ApiBadRequest(f"cannot make the job's cgroup: {e}") from e
        self.audit(self.tree.path_of(job.cgroup), "mkdir", None, "cgroup", f"job {job.name}")
        try:
            with self.tree.open(job.cgroup) as d:
                limits = job.assignment().limits
                if limits.cpu_max is not None and limits.cpu_max != "max":
                    value = CpuMax.from_cores(float(limits.cpu_max)).render()
                    self._write(d, Attribute.CPU_MAX, value, job)
                if job.memory is not None:
                    page = os.sysconf("SC_PAGE_SIZE")
                    value = MemoryLimit.aligned(job.memory, page).render()
                    self._write(d, Attribute.MEMORY_MAX, value, job)
                if hold is not None and spec.gpu.pin_cpus and hold.cpus and d.has("cpuset.cpus"):
                    self._write(d, "cpuset.cpus", format_cpulist(hold.cpus), job)
                d.write("cgroup.procs", str(job.pid))
                self.audit(
                    self.tree.path_of(job.cgroup) + "/cgroup.procs",
                    "cgroup.procs",
                    None,
                    str(job.pid),
                    f"job {job.name}: its process, before it runs the command",
                )
        except (NodeagentError, CgroupVanished) as e:
            self._rmdir(job)
            raise ApiBadRequest(f"cannot start job {job.name!r}: {one_line(e)}") from e

    def _write(self, d: Any, attribute: str, value: str, job: Job) -> None:
        old = d.read(attribute).strip()
        d.write(attribute, value)
        self.audit(
            self.tree.path_of(job.cgroup) + "/" + attribute,
            attribute,
            old,
            value,
            f"job {job.name}: its limits, before it runs",
        )

    # --- the loop's side --------------------------------------------------------------

    def assignments(self) -> dict[str, Assignment]:
        with self._lock:
            return {j.cgroup: j.assignment() for j in self._jobs.values()}

    def get(self, cgroup: str) -> Job | None:
        with self._lock:
            return next((j for j in self._jobs.values() if j.cgroup == cgroup), None)

    def reap(self, snapshot: NodeSnapshot) -> list[Job]:
        """Forget jobs whose cgroup is gone or empty, removing the empty cgroups."""
        states = {w.path: w for w in snapshot.workloads}
        with self._lock:
            jobs = list(self._jobs.values())
        gone = []
        for job in jobs:
            w = states.get(job.cgroup)
            if job.cgroup in snapshot.vanished or (w is not None and w.sample.populated is False):
                self._remove_if_empty(job, None)
                gone.append(job)
        return gone

    def _remove_if_empty(self, job: Job, exit_status: object) -> None:
        try:
            with self.tree.open(job.cgroup) as d:
                if d.read("cgroup.procs").split():
                    return  # something it started still runs: the loop removes it later
        except CgroupVanished:
            pass
        except NodeagentError as e:
            log.warning("job.check_failed", job=job.name, cgroup=job.cgroup, error=str(e))
            return
        self._rmdir(job)
        with self._lock:
            known = self._jobs.pop(job.name, None) is not None
        if known:
            self.on_end(job)
            log.info("job.finished", job=job.name, cgroup=job.cgroup, exit_status=exit_status)

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
        with self._lock:
            return [j.to_json() for j in self._jobs.values()]

    def load(self, records: Iterable[Mapping[str, Any]], managed_root: str) -> None:
        """Restore the jobs of a previous run whose cgroups still exist."""
        for record in records:
            try:
                job = Job.from_json(record)
            except (KeyError, TypeError, ValueError, NodeagentError) as e:
                log.warning("state.job_dropped", error=one_line(e))
                continue
            if job.cgroup != f"{managed_root}/{job.name}":
                continue  # the managed root moved: not ours any more
            try:
                with self.tree.open(job.cgroup):
                    pass
            except (CgroupVanished, NodeagentError):
                continue
            with self._lock:
                self._jobs[job.name] = job
