"""The agent's own routes: its status, what it set and why, and the jobs `exec` starts.

Reads answer from the last tick's record, which the loop replaces whole; the daemon posts
whatever changes state (every POST and DELETE) to the loop (nodeagent.commands)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from nodeagent.api import answers
from nodeagent.api.server import Request, Routes
from nodeagent.errors import BadRequest, NotFound
from nodeagent.gpualloc.service import environment
from nodeagent.policyfile.model import AgentMode
from nodeagent.reach import Reach
from nodeagent.reconcile import Reconciler
from nodeagent.report import TickRecord, allocations, explain, find, identities


def _peer(p: Reach) -> answers.PeerState:
    return answers.PeerState(
        name=p.name, address=p.address, up=p.up, since=p.since, last_success=p.last_ok,
        error=p.error,
    )  # fmt: skip


def agent_routes(
    rec: Reconciler, config_path: str | None, policy_sha256: Callable[[], str]
) -> Routes:
    """/v1/status, /v1/allocations, /v1/explain and /v1/jobs over `rec`."""

    def record() -> TickRecord:
        last = rec.last
        if last is None:
            raise NotFound("nodeagent has not completed a tick yet")
        return last

    def status(_: Request) -> answers.Status:
        last = rec.last
        return answers.Status(
            pid=os.getpid(),
            dry_run=rec.dry_run,
            policy_file=config_path,
            policy_sha256=policy_sha256(),
            cgroup_root=rec.tree.root,
            managed_root=rec.spec.agent.managed_root,
            tick=None if last is None else last.snapshot.seq,
            workloads=len(rec.registry.workloads),
            slurm_problem=rec.slurm.problem,
            deadline_misses=rec.notes.deadline_misses,
            runtimes={
                name: answers.RuntimeState.model_validate(state)
                for name, state in rec.runtimes.status().items()
            },
            peers=[_peer(p) for p in (() if last is None else last.peers)],
        )

    def allocs(_: Request) -> answers.Allocations:
        # report.py builds the rows as dicts (run --once and its tests read them so); the
        # model checks them here, so that a key renamed there fails the route's tests
        return answers.Allocations.model_validate(
            {**allocations(record()), "deadline_misses": rec.notes.deadline_misses}
        )

    def explain_one(request: Request) -> answers.Explanation:
        last = record()
        query = request.query.get("cgroup", "")
        found = find(identities(last), query, rec.tree.root)
        if len(found) != 1:
            what = "no workload" if not found else f"{len(found)} workloads"
            raise NotFound(
                f"{what} match {query!r} among the workloads a rule claims;"
                " see 'nodeagent allocations' and 'nodeagent workloads'"
            )
        return answers.Explanation.model_validate(explain(last, found[0]))

    def start_job(request: Request) -> answers.StartedJob:
        if rec.dry_run:
            raise BadRequest("this daemon runs with --dry-run: it starts no jobs")
        if rec.spec.agent.mode is AgentMode.KUBERNETES:
            raise BadRequest(
                "nodeagent exec is refused: agent.mode is kubernetes, where the kubelet runs"
                " the node's workloads and counts what they use; run it as a pod instead"
            )
        job = rec.jobs.start(request.body, request.peer, rec.spec, time.time(), rec.gpus.claim)
        rec.saver.save()  # a restart must know the job before its next periodic save
        mine = next((h for h in rec.gpus.ledger.holds() if h.id == job.gpu_hold), None)
        env = {} if mine is None else environment(mine)
        return answers.StartedJob.model_validate({**job.to_json(), "env": env})

    def finish_job(request: Request) -> answers.Job:
        job = rec.jobs.finish(request.body, request.peer)
        if job.deadline is not None and time.time() > job.deadline:
            rec.notes.missed(job.cgroup, job.deadline)
        return answers.Job.model_validate(job.to_json())

    def list_jobs(_: Request) -> answers.Jobs:
        return answers.Jobs.model_validate({"jobs": rec.jobs.dump()})

    return {
        "/v1/jobs": {"GET": list_jobs, "POST": start_job, "DELETE": finish_job},
        "/v1/status": {"GET": status},
        "/v1/allocations": {"GET": allocs},
        "/v1/explain": {"GET": explain_one},
    }
