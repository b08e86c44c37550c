"""The agent's own routes: its status, its policy's reload, what it set and why, and the jobs
`exec` starts.

Reads answer from the view the loop last published (report.AgentView: the last tick's record
and the agent's figures as of it), which it replaces whole; the daemon posts whatever changes
state (every POST and DELETE) to the loop (nodeagent.commands), and publishes anew after it."""

from __future__ import annotations

import os
import time
from typing import Annotated, Protocol

from pydantic import Field

from nodeagent import __version__
from nodeagent.api import answers
from nodeagent.api.bodies import Body
from nodeagent.api.server import Checked, Request, Routes
from nodeagent.errors import BadRequest, Conflict, Forbidden, NotFound
from nodeagent.gpualloc.service import GpuView, environment
from nodeagent.jobs import FinishBody, StartBody
from nodeagent.policyfile.model import AgentMode
from nodeagent.reach import Reach
from nodeagent.reconcile import Reconciler
from nodeagent.reloads import Reload
from nodeagent.report import AgentView, TickRecord, allocations, explain, find, identities
from nodeagent.staleness import stale_window


class Lifecycle(Protocol):
    """What the status and reload routes need of the daemon around the reconciler: its
    `Agent`, which this layer does not import."""

    started: float
    policy_loaded: float
    reload_outcome: Reload | None

    @property
    def policy_sha256(self) -> str: ...

    def reload(self) -> Reload | None: ...


class _ReloadBody(Body):
    file: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    """The policy file the caller means (an absolute path): refused unless it is the one
    the daemon runs with, so that `nodeagent reload --config FILE` never reloads another."""


def _peer(p: Reach) -> answers.PeerState:
    return answers.PeerState(
        name=p.name, address=p.address, up=p.up, since=p.since, last_success=p.last_ok,
        error=p.error,
    )  # fmt: skip


def _reload_state(r: Reload | None) -> answers.ReloadState | None:
    if r is None:
        return None
    return answers.ReloadState(file=r.file, applied=r.applied, at=r.at, problems=list(r.problems))


def problems(
    status: answers.Status, interval: float, now: float, reload: Reload | None
) -> list[str]:
    """What an operator should look at now, one line each, from what the status holds: the
    services that do not answer, Slurm, a refused reload, and ticks that stopped. Not a
    runtime the node never had (the peers list only those that answered once, or whose
    socket is there: `runtimes` lists every configured one), and not the deadline misses,
    a count since the start that would keep `nodeagent status` failing for good after one."""
    out: list[str] = []
    down = {p.name for p in status.peers if not p.up}
    out += [f"{p.name} does not answer ({p.address}): {p.error}" for p in status.peers if not p.up]
    if status.slurm_problem is not None and "slurm" not in down:
        out.append(f"slurm: {status.slurm_problem}")
    if reload is not None and not reload.applied:
        out += [f"reload refused, the last good policy stays: {p}" for p in reload.problems]
    window = stale_window(interval)  # as /healthz's (nodeagent.metrics.server)
    last = status.tick_time if status.tick_time is not None else status.started
    if last is not None and now - last > window:
        since = "no tick has completed since the start" if status.tick is None else "no tick"
        out.append(
            f"{since} for {now - last:.0f} s (agent.interval {interval:g} s): ticks fail or"
            " hang; see tick.failed in the journal"
        )
    return out


def agent_routes(rec: Reconciler, config_path: str | None, agent: Lifecycle) -> Routes:
    """/v1/status, /v1/reload, /v1/allocations, /v1/explain and /v1/jobs over `rec` and the
    daemon around it (`agent`)."""

    def record(view: AgentView) -> TickRecord:
        if view.record is None:
            raise NotFound("nodeagent has not completed a tick yet")
        return view.record

    def status(_: Request) -> answers.Status:
        view = rec.view  # one view for the whole answer: the loop swaps it whole
        last = view.record
        reload = agent.reload_outcome
        answer = answers.Status(
            pid=os.getpid(),
            dry_run=rec.dry_run,
            policy_file=config_path,
            policy_sha256=agent.policy_sha256,
            cgroup_root=rec.tree.root,
            managed_root=rec.spec.agent.managed_root,
            tick=None if last is None else last.snapshot.seq,
            workloads=view.workloads,
            slurm_problem=view.slurm_problem,
            deadline_misses=view.deadline_misses,
            runtimes={
                name: answers.RuntimeState.model_validate(state)
                for name, state in view.runtimes.items()
            },
            peers=[_peer(p) for p in (() if last is None else last.peers)],
            version=__version__,
            started=agent.started,
            tick_time=None if last is None else last.snapshot.wall_time,
            policy_loaded=agent.policy_loaded,
            last_reload=_reload_state(reload),
        )
        found = problems(answer, rec.spec.agent.interval, time.time(), reload)
        return answer.model_copy(update={"problems": found})

    def reload(request: Request, body: _ReloadBody) -> answers.Reloaded:
        """On the loop's thread (posted, as every POST): the file read and applied or
        refused there, as SIGHUP's reload is."""
        if request.peer.uid != 0:
            raise Forbidden(
                "only root may reload the daemon's policy (sudo nodeagent reload, or"
                " systemctl reload nodeagent)"
            )
        if config_path is None:
            raise BadRequest("this daemon runs without a policy file (--config): nothing to reload")
        if body.file is not None and os.path.realpath(body.file) != os.path.realpath(config_path):
            raise BadRequest(
                f"this daemon runs with {config_path}, not {body.file}: reload its own file,"
                f" or restart it with --config {body.file}"
            )
        done = agent.reload()
        if done is None:  # no file after all: said above
            raise BadRequest("this daemon runs without a policy file (--config): nothing to reload")
        if not done.applied:
            # one problem a line: the CLI prints them as they are (ApiRefused.lines)
            raise Conflict("\n".join(done.problems))
        return answers.Reloaded(
            file=done.file,
            policy_sha256=agent.policy_sha256,
            rules=done.rules or 0,
            tenants=done.tenants or 0,
            at=done.at,
        )

    def allocs(_: Request) -> answers.Allocations:
        # report.py builds the rows as dicts (run --once and its tests read them so); the
        # model checks them here, so that a key renamed there fails the route's tests
        view = rec.view
        return answers.Allocations.model_validate(
            {**allocations(record(view)), "deadline_misses": view.deadline_misses}
        )

    def explain_one(request: Request) -> answers.Explanation:
        last = record(rec.view)
        query = request.query.get("cgroup", "")
        found = find(identities(last), query, rec.tree.root)
        if len(found) != 1:
            what = "no workload" if not found else f"{len(found)} workloads"
            raise NotFound(
                f"{what} match {query!r} among the workloads a rule claims;"
                " see 'nodeagent allocations' and 'nodeagent workloads'"
            )
        return answers.Explanation.model_validate(
            {**explain(last, found[0]), "gpus": _gpu_use(rec.gpus.view, found[0].path)}
        )

    def start_job(request: Request, body: StartBody) -> answers.StartedJob:
        if rec.dry_run:
            raise BadRequest("this daemon runs with --dry-run: it starts no jobs")
        if rec.spec.agent.mode is AgentMode.KUBERNETES:
            raise BadRequest(
                "nodeagent exec is refused: agent.mode is kubernetes, where the kubelet runs"
                " the node's workloads and counts what they use; run it as a pod instead"
            )
        job = rec.jobs.start(
            body,
            request.peer,
            rec.spec,
            time.time(),
            write_limits=rec.new_job,
            claim_gpus=rec.gpus.claim,
        )
        rec.saver.save()  # a restart must know the job before its next periodic save
        mine = next((h for h in rec.gpus.ledger.holds() if h.id == job.gpu_hold), None)
        env = {} if mine is None else environment(mine)
        return answers.StartedJob.model_validate({**job.to_json(), "env": env})

    def finish_job(request: Request, body: FinishBody) -> answers.Job:
        job = rec.jobs.finish(body, request.peer)
        if job.deadline is not None and time.time() > job.deadline:
            rec.notes.missed(job.cgroup, job.deadline)
        return answers.Job.model_validate(job.to_json())

    def list_jobs(_: Request) -> answers.Jobs:
        return answers.Jobs.model_validate({"jobs": list(rec.view.jobs)})

    return {
        "/v1/jobs": {
            "GET": list_jobs,
            "POST": Checked(StartBody, start_job),
            "DELETE": Checked(FinishBody, finish_job),
        },
        "/v1/status": {"GET": status},
        "/v1/reload": {"POST": Checked(_ReloadBody, reload)},
        "/v1/allocations": {"GET": allocs},
        "/v1/explain": {"GET": explain_one},
    }


def _gpu_use(view: GpuView, path: str) -> dict[str, object] | None:
    """The GPUs the workload at `path` holds, when each is expected back, and the head of the
    queue they are kept for, if they are (times on the wall clock)."""
    holds = [h for h in view.holds() if h.cgroup == path]
    if not holds:
        return None
    offset = time.time() - time.monotonic()
    ends = [h.expected_end for h in holds]
    end = None if None in ends else max(e for e in ends if e is not None) + offset
    head = view.ledger.reserved
    kept = head is not None and any(set(h.uuids) & set(head.uuids) for h in holds)
    return {
        "indices": sorted({i for h in holds for i in h.indices}),
        "expected_end": end,
        "kept_for": head.owner if head is not None and kept else None,
        "kept_from": head.start + offset if head is not None and kept and head.start else None,
    }
