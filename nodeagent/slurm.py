"""Slurm's own record of the jobs on this node: each job's account, asked of squeue.

A Slurm job's tenant follows its account, and the account comes from Slurm alone, never
from the job's environment or files, which its user controls. Discovery finds the jobs by
their cgroups (system.slice/slurmstepd.scope/job_<id>); this adapter adds the account:

- one query (``squeue --jobs=<ids>``) for all the jobs not known yet, with a deadline;
- answers kept by job id for the job's life (Slurm takes a new account for pending jobs
  only), and forgotten with the job's cgroup;
- a job Slurm does not list (its cgroup outlived it, or it is not this cluster's) is asked
  about again after `agent.slurm.retry_interval`;
- Slurm not answering (squeue missing, timed out, failing) is one line naming the command
  and why, logged once per outage; the jobs keep their path identity, so the rules that
  need no account still claim them, and Slurm is asked again after `retry_interval`.

And the GPUs (GRES) Slurm gave a job on this node, asked of `scontrol show job -d` only for a
job with a GPU process no hold covers (SlurmGpus, a Giver of nodeagent.runtimes.gpus), with the
same deadline, retry and runner. Never from the job's environment (CUDA_VISIBLE_DEVICES,
SLURM_JOB_GPUS): its user sets that.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import structlog

from nodeagent.errors import NodeagentError
from nodeagent.gpu.grants import GpuGrant
from nodeagent.gpu.gres import gres_uuids, slurm_gpus
from nodeagent.gpu.model import GpuState
from nodeagent.identity import Runtime, WorkloadIdentity
from nodeagent.meta import Unavailable
from nodeagent.policyfile.model import SlurmSettings
from nodeagent.reach import Reachability

log = structlog.get_logger("nodeagent.slurm")

FORMAT = "%A|%a"
"""Job id (each array task its own), then the account: last, so that whatever it holds
cannot shift the id."""
NO_ACCOUNT = "(null)"
"""What squeue prints for a job without an account (accounting off, none given)."""
_JOB_ID = re.compile(r"[0-9]{1,20}", re.ASCII)
_UNKNOWN_JOB = "Invalid job id specified"
"""squeue's answer (exit 1) when the only job asked about is not Slurm's."""
OUTPUT_MAX = 4 << 20


_SCOPE = re.compile(r"system\.slice/([^/]+)_slurmstepd\.scope/", re.ASCII)
"""A slurmd built for several per host names its scope after its node."""


class SlurmUnavailable(NodeagentError):
    """Slurm did not answer: one line naming the command and what failed."""


@dataclass(frozen=True, slots=True)
class Answer:
    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str], float], Answer]


def run_command(argv: Sequence[str], timeout: float) -> Answer:
    """Run argv with a deadline (subprocess.TimeoutExpired past it, the child killed);
    OSError when it cannot start."""
    done = subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    return Answer(done.returncode, done.stdout[:OUTPUT_MAX], done.stderr[:OUTPUT_MAX])


def parse_jobs(text: str, command: str) -> dict[str, str | None]:
    """squeue's lines in FORMAT: each job's account (None: it has none), by job id;
    SlurmUnavailable naming the first line that is not one."""
    out: dict[str, str | None] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        job, sep, account = line.partition("|")
        if not sep or not _JOB_ID.fullmatch(job):
            shown = " ".join(line.split())[:120]
            raise SlurmUnavailable(f"{command}: line {n} is not job|account: {shown!r}")
        out[job] = None if account in ("", NO_ACCOUNT) else account
    return out


def ask(
    run: Runner, argv: Sequence[str], command: str, timeout: float, unknown: bool
) -> str | None:
    """What a Slurm command printed; None when it said the one job asked about is not Slurm's
    (`unknown`: one job was asked about). SlurmUnavailable, naming `command` and what failed,
    when it does not answer."""
    try:
        answer = run(argv, timeout)
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"{command}: no answer in {timeout:g} s") from None
    except OSError as e:
        raise SlurmUnavailable(f"{command}: {e.strerror or e}") from None
    if answer.returncode == 0:
        return answer.stdout
    said = " ".join(answer.stderr.split())[:200] or "no message"
    if _UNKNOWN_JOB in said and unknown:
        return None
    raise SlurmUnavailable(f"{command}: exited {answer.returncode}: {said}")


def node_name(settings: SlurmSettings, cgroup: str) -> str:
    """This node's name as Slurm knows it: `agent.slurm.node`, else the one slurmd named its
    scope after (`<node>_slurmstepd.scope`, where slurmd is built for several per host), else
    the host's short name, which slurmd takes unless started with -N."""
    if settings.node:
        return settings.node
    m = _SCOPE.match(cgroup + "/")
    return m.group(1) if m else socket.gethostname().split(".")[0]


@dataclass(frozen=True, slots=True)
class SlurmGpus:
    """Slurm as a Giver (nodeagent.runtimes.gpus): the GRES GPUs of a job on this node, read
    from `scontrol show job -d --oneliner <id>` (nodeagent.gpu.gres), within `timeout`."""

    settings: SlurmSettings
    run: Runner = run_command
    runtime: str = "slurm"

    @property
    def where(self) -> str:
        return self.settings.scontrol

    @property
    def retry_s(self) -> float:
        return self.settings.retry_interval

    def key(self, identity: WorkloadIdentity) -> str | None:
        return identity.job_id if identity.runtime is Runtime.SLURM else None

    def owner(self, identity: WorkloadIdentity) -> str:
        return f"slurm:{identity.job_id}"

    def gpus(self, identity: WorkloadIdentity) -> GpuGrant | None:
        job = identity.job_id
        if job is None or not _JOB_ID.fullmatch(job):
            return None
        argv = [self.settings.scontrol, "show", "job", "--details", "--oneliner", job]
        command = f"{self.settings.scontrol} show job -d {job}"
        try:
            text = ask(self.run, argv, command, self.settings.timeout, unknown=True)
        except SlurmUnavailable as e:
            raise Unavailable(str(e)) from None
        if text is None:
            return None
        return slurm_gpus(text, job, node_name(self.settings, identity.path))

    def uuids(self, grant: GpuGrant, state: GpuState) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return gres_uuids(grant, state)


class SlurmJobs:
    """The accounts of the Slurm jobs discovery found, cached by job id."""

    def __init__(
        self,
        run: Runner = run_command,
        clock: Callable[[], float] = time.monotonic,
        *,
        logs: bool = True,
    ) -> None:
        """`logs`: log when Slurm stops and starts answering (the daemon); a command that
        says so itself passes False."""
        self._run = run
        self._logs = logs
        self._clock = clock
        self._known: dict[str, str | None] = {}
        """Each job's account (None: it has none), by job id."""
        self._unlisted: dict[str, float] = {}
        """Jobs Slurm did not list, with when to ask again."""
        self._retry_at = -float("inf")
        self.problem: str | None = None
        """What failed, while Slurm does not answer."""
        self.reach = Reachability()
        """How its last squeue went (the metrics and /v1/status)."""

    def enrich(
        self, identities: Iterable[WorkloadIdentity], settings: SlurmSettings
    ) -> list[WorkloadIdentity]:
        """`identities` with each Slurm job's account, where Slurm has told it."""
        found = list(identities)
        jobs = {i.job_id for i in found if i.runtime is Runtime.SLURM and i.job_id is not None}
        self._forget_all_but(jobs)
        if not jobs:
            return found
        now = self._clock()
        wanted = sorted(
            (j for j in jobs if j not in self._known and self._unlisted.get(j, now) <= now),
            key=int,
        )
        if wanted and now >= self._retry_at:
            self._ask(wanted, settings, now)
        out = []
        for i in found:
            account = None if i.job_id is None else self._known.get(i.job_id)
            out.append(i if account == i.account else replace(i, account=account))
        return out

    def _ask(self, wanted: list[str], settings: SlurmSettings, now: float) -> None:
        try:
            listed = self._query(wanted, settings)
        except SlurmUnavailable as e:
            self.reach.failed("slurm", settings.squeue, str(e))
            self._retry_at = now + settings.retry_interval
            if self.problem is None and self._logs:
                log.warning(
                    "slurm.unreachable",
                    error=str(e),
                    action="Slurm's jobs are claimed by the rules that need no account;"
                    f" asking again in {settings.retry_interval:g} s",
                )
            self.problem = str(e)
            return
        self.reach.ok("slurm", settings.squeue)
        if self.problem is not None and self._logs:
            log.info("slurm.reachable", was=self.problem)
        self.problem = None
        self._retry_at = -float("inf")
        for job_id in wanted:
            if job_id in listed:
                self._known[job_id] = listed[job_id]
                self._unlisted.pop(job_id, None)
            else:
                self._unlisted[job_id] = now + settings.retry_interval

    def _query(self, wanted: list[str], settings: SlurmSettings) -> dict[str, str | None]:
        """What squeue says of the `wanted` jobs; SlurmUnavailable, naming the command and
        what failed, when it does not answer."""
        ids = ",".join(wanted)
        argv = [
            settings.squeue,
            "--noheader",
            "--states=all",
            f"--jobs={ids}",
            f"--format={FORMAT}",
        ]
        command = f"{settings.squeue} --jobs={ids if len(ids) <= 80 else ids[:77] + '...'}"
        answer = ask(self._run, argv, command, settings.timeout, unknown=len(wanted) == 1)
        return {} if answer is None else parse_jobs(answer, command)

    def gpus(self, settings: SlurmSettings) -> SlurmGpus:
        """Slurm as the giver of its jobs' GPUs, asked with these settings and this runner."""
        return SlurmGpus(settings, self._run)

    def _forget_all_but(self, live: set[str]) -> None:
        """Jobs whose cgroups are gone: a job id Slurm gives again is another job."""
        for cache in (self._known, self._unlisted):
            for job_id in [j for j in cache if j not in live]:
                del cache[job_id]
