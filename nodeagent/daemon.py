"""The reconcile loop: sense -> snapshot -> policies -> plan -> act -> record.

Level-triggered: every tick recomputes the whole plan from the kernel's
current state, so a missed event or a restart costs at most one tick. inotify
only makes a tick come sooner when a cgroup appears or goes.
"""

from __future__ import annotations

import math
import operator
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING, TypeVar

import structlog
from pydantic import ValidationError

from nodeagent import sdnotify, state
from nodeagent.act import Executor, Outcome, WriteResult
from nodeagent.api.server import ApiServer, Request, Routes
from nodeagent.cgroupfs.subtree import ensure_managed_root, leave_managed_path
from nodeagent.cgroupfs.tree import CgroupTree, CgroupVanished
from nodeagent.changes import NoteLog, ProblemLog
from nodeagent.commands import Commands
from nodeagent.discovery.registry import Registry
from nodeagent.errors import BadRequest, NodeagentError, NotFound, one_line
from nodeagent.gpu.choice import open_backend
from nodeagent.gpu.model import GpuState, Hold, HoldKind
from nodeagent.gpualloc.service import GpuService, environment
from nodeagent.identity import WorkloadIdentity
from nodeagent.jobs import Jobs
from nodeagent.kube.pods import EMPTY, PodDirectory
from nodeagent.logs import audit_write
from nodeagent.originals import Originals
from nodeagent.ownership import WriteMode, parent_identity, write_mode
from nodeagent.policy import history
from nodeagent.policy.base import Assignment, Policy
from nodeagent.policy.classify import assign
from nodeagent.policy.fairshare import is_active
from nodeagent.policy.history import decay
from nodeagent.policy.newcomer import plan_newcomers
from nodeagent.policy.plan import DEFAULT_POLICIES, Plan, make_plan
from nodeagent.policy.weights import ancestors
from nodeagent.policyfile.filewatch import FileWatch
from nodeagent.policyfile.load import load_policy
from nodeagent.policyfile.model import AgentMode, AgentSettings, PolicySpec
from nodeagent.policyfile.yamlfile import PolicyError
from nodeagent.report import TickRecord, allocations, explain, find, identities
from nodeagent.routes.gpus import GpuRoutes
from nodeagent.runtimes.metadata import RuntimeMetadata
from nodeagent.sdbus import Systemd
from nodeagent.sense.node import NodeSensor
from nodeagent.sense.sensor import Sensor
from nodeagent.slurm import SlurmJobs
from nodeagent.snapshot import NO_NEEDS, Needs, NodeSnapshot, WorkloadState
from nodeagent.wakeup import Flag, Wakeup

if TYPE_CHECKING:
    from nodeagent.kube.node import KubernetesNode
    from nodeagent.metrics.server import MetricsServer

log = structlog.get_logger("nodeagent")

CONTROLLERS = ("cpu", "memory")
STATE_SAVE_INTERVAL = 10.0


class Agent:
    policies: tuple[Policy, ...] = DEFAULT_POLICIES
    """The policies a full tick runs, in order; what they need read every tick and when
    their plan is stale they say themselves (`Policy.needs`, `Policy.stale`): the loop
    knows none of them by name."""

    def __init__(
        self,
        spec: PolicySpec,
        tree: CgroupTree,
        *,
        proc_root: str = "/proc",
        dry_run: bool = False,
        config_path: str | None = None,
        overrides: Mapping[str, object] | None = None,
    ) -> None:
        self.overrides = dict(overrides or {})
        spec = self._with_overrides(spec)
        self.spec = spec
        self.tree = tree
        self.dry_run = dry_run
        self.config_path = config_path
        # for agent.reload_on_change: the policy file as it was last loaded
        self.policy_file = None if config_path is None else FileWatch(config_path)
        self.proc_root = proc_root
        self.registry = Registry(tree, spec.agent.managed_root)
        # what the container runtimes say about their containers (names, images, labels, pods)
        self.runtimes = RuntimeMetadata.from_settings(spec.agent.runtimes)
        # rates over shorter windows than half a tick are noise (cpu.stat moves in scheduler ticks)
        self.sensor = Sensor(
            tree,
            NodeSensor(proc_root),
            min_window=spec.agent.interval / 2,
            verify_every=spec.agent.resync_interval,
        )
        # Slurm's accounts for its jobs; asked only when discovery finds Slurm jobs
        self.slurm = SlurmJobs()
        # systemd's D-Bus API, for the cgroups it owns; connected at the first write there
        self.systemd = Systemd()
        self.executor = Executor(
            tree,
            audit_write,
            dry_run,
            self.systemd,
            lambda: self.spec.agent.systemd.without_bus,
        )
        # one GPU backend for the daemon's life; none on a host without GPUs
        self.gpus = GpuService(
            open_backend(spec.gpu.simulate, proc_root),
            lambda: self.spec,
            self._exists,
            lambda: self.registry.workloads.values(),  # noqa: PLW0108 - a resync replaces the dict
        )
        # Kubernetes mode: the kubelet's PodResources and the API server's watch
        self.kube = _kubernetes(spec)
        self.jobs = Jobs(tree, audit_write, proc_root, on_end=self.gpus.release_job)
        self.carry: dict[str, Mapping[str, object]] = {}
        """The policies' state for their next tick, by policy name."""
        self.originals = Originals()
        """What the agent changed and the values before, for `nodeagent release`."""
        self.usage: dict[str, float] = self._restore()
        self.last: TickRecord | None = None
        self.problems = ProblemLog()
        self.notes = NoteLog()
        self.observers: list[Callable[[TickRecord | None], None]] = []
        """Told of every tick: its record, or None when it failed (the metrics)."""
        self._lock = threading.Lock()
        # one save at a time: a save started later must also be renamed into place later
        # (the loop saves, and so do callers while no loop runs)
        self._save_lock = threading.Lock()
        self._saved_at = 0.0
        self._save_logged = -math.inf
        self._read_all = True
        """Read every file of every workload next tick (at start, after a reload)."""
        self._plan_key: object = None
        self._replan_at = 0.0
        self._fast_results: list[WriteResult] = []
        """The fast path's writes since the last tick, reported with the next one."""
        self._held_back: set[str] = set()
        """Workloads whose memory.max waits for their usage to fit: read it every tick."""
        self._retry: frozenset[str] = frozenset()
        """Workloads with a failed write last tick: written again even on an unchanged plan."""
        self._forget_derived()
        self.wakeup = Wakeup()
        """What the loop's wait wakes for: a signal, another thread's stop, besides inotify."""
        self.stop = Flag(self.wakeup)
        self.reload_requested = Flag(self.wakeup)
        self.commands = Commands(self.wakeup)  # the API handlers that change state post here
        self._stop_signal: int | None = None
        self.last_reload = (True, time.time())
        """Whether the last reload applied the file, and when the policy in force was loaded
        (for the metrics; the start-up load counts as a reload that applied)."""

    def _forget_derived(self) -> None:
        """Empty the caches of what each tick derives from the last (what to read, who is
        claimed, what was sensed, the last plan's assignments)."""
        self._needs_key: object = None
        self._needs_value: dict[str, Needs] = {}
        self._refused: set[tuple[str, str]] = set()
        """(cgroup, what a rule refused) said already."""
        self._claimed_key: object = None
        self._claimed_value: tuple[
            dict[str, Assignment],
            list[WorkloadIdentity],
            list[WorkloadIdentity],
            dict[str, WriteMode],
        ] = ({}, [], [], {})
        self._sensed_value: tuple[
            PolicySpec | None,
            tuple[WorkloadState, ...],
            tuple[frozenset[str], frozenset[str], bool],
        ] = (None, (), (frozenset(), frozenset(), False))
        self._assigned: tuple[object, dict[str, Assignment]] = (None, {})
        """The last plan's assignments, for as long as it is made again (same cgroups)."""

    def _with_overrides(self, spec: PolicySpec) -> PolicySpec:
        """Command-line settings win over the file's, at start and on every reload."""
        if not self.overrides:
            return spec
        try:  # validated as the file's values are: a bad --state-file is refused the same way
            agent = AgentSettings.model_validate({**spec.agent.model_dump(), **self.overrides})
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            option = "--" + str(first["loc"][0]).replace("_", "-")
            message = str(first.get("ctx", {}).get("error", first["msg"]))
            raise NodeagentError(f"{option}: {message}") from None
        return spec.model_copy(update={"agent": agent})

    def _pods(self) -> PodDirectory:
        """The API server's view of this node's pods (Kubernetes mode, when watched)."""
        return EMPTY if self.kube is None else self.kube.pods()

    def _levels(self, managed: list[WorkloadIdentity]) -> list[WorkloadIdentity]:
        """The parents of the claimed workloads, up to (not including) the root, for the
        hierarchy of fair share."""
        if not self.spec.fair_share.hierarchy:
            return []
        claimed = {i.path for i in managed}
        found = {a for i in managed for a in ancestors(i.path) if a not in claimed}
        root = self.spec.agent.managed_root
        return [parent_identity(p, root) for p in sorted(found)]

    def _fairness(self, tenant: str) -> float:
        """How far a tenant is ahead of its share: decayed usage per share (lower first)."""
        share = self.spec.tenants[tenant].shares if tenant in self.spec.tenants else 1.0
        return self.usage.get(tenant, 0.0) / share

    def _exists(self, cgroup: str) -> bool:
        try:
            with self.tree.open(cgroup):
                return True
        except (CgroupVanished, NodeagentError):
            return False

    def _restore(self) -> dict[str, float]:
        """The saved usage history, decayed by the time away (only tenants still in the
        policy are kept, so a removed tenant's history is not carried and re-saved forever);
        and the jobs that still run and the policies' carried state."""
        try:
            saved = state.load(self.spec.agent.state_file, tenants=self.spec.tenants)
        except NodeagentError as e:
            log.error("state.unusable", error=str(e), action="starting with empty usage history")
            return {}
        if saved is None:
            return {}
        self.jobs.load(saved.jobs, self.spec.agent.managed_root)
        self.gpus.ledger.load(saved.gpus, self._kept_hold, time.monotonic(), time.time())
        self.gpus.ledger.load_history(saved.gpu_history)
        self.carry = {k: dict(v) for k, v in saved.carry.items()}
        self.originals = Originals.load(saved.originals)
        self.originals.forget([p for p, _, _ in self.originals.items() if not self._exists(p)])
        elapsed = time.time() - saved.saved_at
        return decay(saved.tenant_usage, elapsed, self.spec.fair_share.half_life)

    def _kept_hold(self, hold: Hold) -> Hold | None:
        """A saved hold is kept if it is a reservation, or the hold of a job still running
        (the job names it by id, or, in a file from before holds had ids, by its name and
        GPUs: the job then adopts it)."""
        if hold.kind is HoldKind.RESERVATION:
            return hold
        for job in self.jobs.running():
            if job.gpu_hold is not None:
                if job.gpu_hold == hold.id and job.uid == hold.uid:
                    return hold
            elif job.name == hold.owner and job.gpus == hold.uuids:
                self.jobs.adopt(job.name, hold.id)
                return replace(hold, uid=job.uid, tenant=job.tenant)
        return None

    def prepare(self) -> None:
        """Create and enable the managed subtree, then discover. Writes nothing in dry-run."""
        if not self.dry_run:
            root = self.spec.agent.managed_root
            leave_managed_path(self.tree, root, self.proc_root, audit_write)
            ensure_managed_root(self.tree, root, CONTROLLERS, audit_write)
        self.registry.resync()
        if self.kube is not None:
            self.kube.start()

    def tick(self) -> TickRecord:
        started = time.monotonic()
        self.registry.poll()
        self.registry.new.clear()  # this tick plans them in full
        jobs = self.jobs.assignments()  # exec's jobs, managed whatever the rules say
        for path in jobs.keys() - self.registry.workloads.keys():
            self.registry.track(path)  # started since inotify last spoke
        # only workloads a rule or exec claims are sensed: the rest are left alone
        identities = self.runtimes.attach(
            self.slurm.enrich(self.registry.identities(), self.spec.agent.slurm)
        )
        assignments, managed, levels, modes = self._claimed(identities, jobs)
        snapshot = self.sensor.snapshot(
            managed,
            time.time(),
            started,
            needs=self._needs(assignments, managed),
            levels=levels,
            full=self._read_all,
        )
        self._read_all = False
        for path in snapshot.vanished:  # inotify may have missed it (a failed watch)
            self.registry.forget(path)
        if not self.dry_run:
            self.jobs.reap(snapshot)
        kube = self.kube
        pods = None
        if kube is not None:
            spec = self.spec

            def pods(state: GpuState) -> tuple[Hold, ...]:
                classes = {p: str(a.workload_class) for p, a in assignments.items()}
                return kube.gpu_holds(state, spec, identities, classes)

        snapshot = replace(
            snapshot,
            gpus=self.gpus.sense(time.monotonic(), pods),
            local_seconds=_local_seconds(snapshot.wall_time),
        )
        if kube is not None:
            kube.publish(snapshot.gpus, self.spec)
        plan, same = self._plan(snapshot, assignments, started)
        # an unchanged plan was applied already: only what was read afresh can differ, and
        # what failed to be written last time is tried again
        only = self.sensor.fresh | self._retry if same else None
        applied = self.executor.apply(plan, snapshot, only)
        self._record_originals(applied, plan, snapshot.vanished)
        results = (*self._fast_results, *applied)  # the fast path's since the last tick too
        self._fast_results = []
        self._held_back = {r.path for r in results if r.outcome is Outcome.UNREACHABLE}
        self._retry = frozenset(r.path for r in results if r.outcome is Outcome.FAILED)
        # what this plan wrote is known from now on (a newcomer the fast path wrote is read
        # in full when first sensed, and may be gone from this plan)
        written = [r for r in applied if r.outcome is Outcome.WRITTEN]
        if written:
            targets = {c.path: c.targets for c in plan.cgroups}
            for r in written:
                self.sensor.learn(r.path, r.attribute, targets[r.path][r.attribute].value)
        self.gpus.executor.apply(plan, snapshot, self.dry_run)
        self.usage = dict(plan.tenant_usage)
        self.carry = dict(plan.carry)
        self.problems.update(snapshot, plan, results)
        self.notes.update(plan.notes)
        record = TickRecord(
            snapshot, plan, results, time.monotonic() - started, self.dry_run, assignments, modes
        )
        with self._lock:
            self.last = record
        if not self.dry_run and time.monotonic() - self._saved_at >= STATE_SAVE_INTERVAL:
            self.save_state()
        return record

    def _claimed(
        self, identities: list[WorkloadIdentity], jobs: Mapping[str, Assignment]
    ) -> tuple[
        dict[str, Assignment], list[WorkloadIdentity], list[WorkloadIdentity], dict[str, WriteMode]
    ]:
        """Who the rules and the jobs claim, their parents and write modes: worked out again
        only when the workloads, the jobs or the policy change (a steady tick skips it)."""
        pods = self._pods()
        key = (tuple(identities), tuple(jobs.items()), id(self.spec), pods.version)
        if key != self._claimed_key:
            assignments = {**assign(identities, self.spec, pods), **jobs}
            self._say_refused(assignments)
            managed = [i for i in identities if i.path in assignments]
            modes = {i.path: write_mode(i, self.spec.agent) for i in managed}
            self._claimed_value = (assignments, managed, self._levels(managed), modes)
            self._claimed_key = key
        return self._claimed_value

    def _say_refused(self, assignments: Mapping[str, Assignment]) -> None:
        """A label or annotation that asked for what its rule does not allow: said once per
        cgroup and value (and shown by workloads, allocations and explain)."""
        now = {(path, x) for path, a in assignments.items() for x in a.refused}
        for path, refused in sorted(now - self._refused):
            log.warning(
                "rule.value_refused",
                cgroup=path,
                rule=assignments[path].rule,
                refused=refused,
                action="the rule's own tenant, class or deadline applies",
            )
        # remembered while the cgroup is claimed: a tick whose runtime answer came late (the
        # value unread, so nothing refused) does not make the next one say it again
        self._refused = {(p, x) for p, x in self._refused | now if p in assignments}

    def _needs(
        self, assignments: Mapping[str, Assignment], managed: list[WorkloadIdentity]
    ) -> dict[str, Needs]:
        """What each workload's lean read adds to its usage: what the policies in use
        declare they need of it (`Policy.needs`), what the job reaper needs (exec's jobs'
        cgroup.events), and memory.current while the executor holds a memory.max back
        until usage fits."""
        key = (id(assignments), frozenset(self._held_back))
        if key == self._needs_key:
            return self._needs_value
        spec, policies = self.spec, self.policies
        out = {}
        for i in managed:
            a = assignments[i.path]
            need = self.jobs.needs(a)
            if i.path in self._held_back:
                need |= Needs(memory=True)
            for policy in policies:
                need |= policy.needs(a, spec)
            if need != NO_NEEDS:
                out[i.path] = need
        self._needs_key, self._needs_value = key, out
        return out

    def _plan(
        self, snapshot: NodeSnapshot, assignments: Mapping[str, Assignment], now: float
    ) -> tuple[Plan, bool]:
        """A new plan when something it depends on changed, or `agent.replan_interval`
        has passed; otherwise the last one again, with the usage history advanced. What
        a plan depends on: which workloads there are and which are busy, what could not
        be read, the GPUs' holders, each tenant's part of the usage history (to the percent),
        and anything that moves every tick: a memory.max waiting for usage to fit, or what a
        policy says makes its plan stale (`Policy.stale`, `Policy.stale_sensed`: deadline
        jobs, a protected cgroup under pressure, the protection controller at work)."""
        spec = self.spec
        paths, active, stirred = self._sensed(snapshot.workloads)
        gpus = snapshot.gpus
        key = (
            paths,
            active,
            frozenset(s.path for s in snapshot.skipped),
            frozenset(w.path for w in snapshot.levels),
            None
            if gpus is None
            else (gpus.holds, tuple((p.pid, p.device_uuid) for p in gpus.processes)),
            _usage_shares(self.usage),
        )
        last = self.last
        moving = (
            bool(self._held_back)  # memory.max waits for usage: try it again each tick
            or stirred
            or self._stale(assignments)
        )
        if last is not None and key == self._plan_key and now < self._replan_at and not moving:
            if self._assigned[0] is not last.plan.cgroups:  # kept by every plan made again
                self._assigned = (last.plan.cgroups, last.plan.assignments())
            usage = history.advance(
                self.usage, snapshot, self._assigned[1], spec.fair_share.half_life
            )
            again = replace(
                last.plan, seq=snapshot.seq, wall_time=snapshot.wall_time, tenant_usage=usage
            )
            return again, True
        self._plan_key, self._replan_at = key, now + spec.agent.replan_interval
        plan = make_plan(
            snapshot,
            spec,
            self.usage,
            self.policies,
            assignments=assignments,
            carried=self.carry,
        )
        return plan, False

    def _sensed(
        self, workloads: tuple[WorkloadState, ...]
    ) -> tuple[frozenset[str], frozenset[str], bool]:
        """What the plan's key and its staleness take from the workloads: their paths, the
        active ones, and whether a policy finds them stale (`Policy.stale_sensed`: one
        stalls); worked out again only when a workload's state is a new object (the sensor
        keeps an unchanged one) or the policy changed."""
        last_spec, last, value = self._sensed_value
        if (
            last_spec is self.spec
            and len(last) == len(workloads)
            and all(map(operator.is_, last, workloads))
        ):
            return value
        spec = self.spec
        value = (
            frozenset(w.path for w in workloads),
            frozenset(w.path for w in workloads if is_active(w, spec.fair_share)),
            any(p.stale_sensed(workloads, spec) for p in self.policies),
        )
        self._sensed_value = (spec, workloads, value)
        return value

    def _stale(self, assignments: Mapping[str, Assignment]) -> bool:
        """A policy says its carried state or the workloads it plans need a new plan next
        tick (the protection controller at work, deadline jobs)."""
        carry = self.carry
        return any(p.stale(carry.get(p.name, {}), assignments) for p in self.policies)

    def save_state(self) -> None:
        """Save the usage history, the jobs, the holds and the carried state. Never raises:
        a failure of any kind is logged, at most once per interval (a full disk, or a value
        the file cannot hold, is not logged at every tick and every exec), and retried at
        the next interval, not at the next tick: the attempt counts as the save."""
        with self._save_lock:
            self._save_state()

    def _save_state(self) -> None:
        now = time.monotonic()
        self._saved_at = now
        try:
            wall = time.time()
            ledger = self.gpus.ledger
            saved = state.SavedState(
                wall,
                self.usage,
                self.jobs.dump(),
                self.carry,
                ledger.dump(now, wall),
                ledger.history(),
                self.originals.dump(),
            )
            state.save(self.spec.agent.state_file, saved)
        except Exception as e:  # saving must never take the loop, or an API call, down
            if now - self._save_logged >= STATE_SAVE_INTERVAL:
                self._save_logged = now
                log.error("state.save_failed", file=self.spec.agent.state_file, error=one_line(e))
        else:
            self._save_logged = -math.inf

    def reload(self) -> None:
        """Re-read the policy file; on any problem keep running on the last good policy."""
        if self.config_path is None:
            return
        self.last_reload = (False, self.last_reload[1])  # failed, unless it gets to the end
        try:
            spec = self._with_overrides(load_policy(self.config_path))
        except PolicyError as e:
            for problem in e.problems:
                log.error(
                    "policy.invalid", problem=str(problem), action="keeping the last good policy"
                )
            return
        fixed = ("managed_root", "socket", "socket_group", "metrics")
        changed = [k for k in fixed if getattr(spec.agent, k) != getattr(self.spec.agent, k)]
        if spec.gpu.simulate != self.spec.gpu.simulate:
            changed.append("gpu.simulate")
        if spec.agent.mode != self.spec.agent.mode:
            changed.append("agent.mode")
        if spec.kubernetes.model_dump(include=_KUBE_FIXED) != self.spec.kubernetes.model_dump(
            include=_KUBE_FIXED
        ):
            changed.append("kubernetes (sockets, node name, API server)")
        if changed:
            log.error(
                "policy.needs_restart",
                changed=changed,
                action="keeping the last good policy; restart nodeagent to apply these",
            )
            return
        if spec.agent.runtimes != self.spec.agent.runtimes:
            self.runtimes.close()
            self.runtimes = RuntimeMetadata.from_settings(spec.agent.runtimes)
        self.spec = spec
        self.sensor.min_window = spec.agent.interval / 2
        self.sensor.verify_every = spec.agent.resync_interval
        self._read_all, self._replan_at = True, 0.0
        log.info("policy.reloaded", file=self.config_path, rules=len(spec.rules))
        self.last_reload = (True, time.time())

    # --- the API's view -------------------------------------------------------------------

    def _record(self) -> TickRecord:
        with self._lock:
            record = self.last
        if record is None:
            raise NotFound("nodeagent has not completed a tick yet")
        return record

    def routes(self) -> Routes:
        def status(_: Request) -> object:
            with self._lock:
                record = self.last
            return {
                "pid": os.getpid(),
                "dry_run": self.dry_run,
                "policy_file": self.config_path,
                "cgroup_root": self.tree.root,
                "managed_root": self.spec.agent.managed_root,
                "tick": None if record is None else record.snapshot.seq,
                "workloads": len(self.registry.workloads),
                "slurm_problem": self.slurm.problem,
                "deadline_misses": self.notes.deadline_misses,
                "runtimes": self.runtimes.status(),
            }

        def allocs(_: Request) -> object:
            return {**allocations(self._record()), "deadline_misses": self.notes.deadline_misses}

        def explain_one(request: Request) -> object:
            record = self._record()
            query = request.query.get("cgroup", "")
            found = find(identities(record), query, self.tree.root)
            if len(found) != 1:
                what = "no workload" if not found else f"{len(found)} workloads"
                raise NotFound(
                    f"{what} match {query!r} among the workloads a rule claims;"
                    " see 'nodeagent allocations' and 'nodeagent workloads'"
                )
            return explain(record, found[0])

        def start_job(request: Request) -> object:
            if self.dry_run:
                raise BadRequest("this daemon runs with --dry-run: it starts no jobs")
            job = self.jobs.start(
                request.body, request.peer, self.spec, time.time(), self.gpus.claim
            )
            self.save_state()  # a restart must know the job before its next periodic save
            mine = next((h for h in self.gpus.ledger.holds() if h.id == job.gpu_hold), None)
            return {**job.to_json(), "env": {} if mine is None else environment(mine)}

        def finish_job(request: Request) -> object:
            job = self.jobs.finish(request.body, request.peer)
            if job.deadline is not None and time.time() > job.deadline:
                self.notes.missed(job.cgroup, job.deadline)
            return job.to_json()

        def list_jobs(_: Request) -> object:
            return {"jobs": self.jobs.dump()}

        routes: Routes = {
            **GpuRoutes(self.gpus, lambda: self.spec, self._fairness).routes(),
            "/v1/jobs": {"GET": list_jobs, "POST": start_job, "DELETE": finish_job},
            "/v1/status": {"GET": status},
            "/v1/allocations": {"GET": allocs},
            "/v1/explain": {"GET": explain_one},
        }
        # reads answer from the API's threads; whatever changes state runs on the loop's
        return {
            path: {m: h if m == "GET" else self.commands.posted(h) for m, h in methods.items()}
            for path, methods in routes.items()
        }

    # --- the loop -------------------------------------------------------------------------

    def run(
        self,
        once: bool = False,
        on_tick: Callable[[TickRecord], None] | None = None,
    ) -> bool:
        """Tick until self.stop is set. Errors are logged and the loop goes on. Under a
        systemd watchdog a `sdnotify.Pinger` pings it for as long as the loop is healthy,
        whatever `agent.interval` is and however long a tick takes; so systemd restarts an
        agent that hangs or whose ticks keep failing, never one that is merely slow or
        waiting for its next tick. Returns whether the last tick succeeded (for --once, the
        exit status)."""
        if not once:
            self.commands.bind()
        try:
            ok = self._loop(once, on_tick)
        finally:
            self.commands.unbind()
        if self._stop_signal is not None:
            log.info("stopping", signal=signal.Signals(self._stop_signal).name)
        sdnotify.stopping()
        if self.kube is not None:
            self.kube.close()
        if not self.dry_run:
            self.save_state()
        return ok

    def _loop(self, once: bool, on_tick: Callable[[TickRecord], None] | None) -> bool:
        """`_ticks` with the watchdog's pinger beside it, when systemd expects pings."""
        watchdog_sec = sdnotify.watchdog_interval()
        pinger = None
        if watchdog_sec is not None and not once:
            pinger = sdnotify.Pinger(watchdog_sec, lambda: self.spec.agent.interval)
        try:
            return self._ticks(once, on_tick, pinger)
        finally:
            if pinger is not None:
                pinger.close()

    def _ticks(
        self,
        once: bool,
        on_tick: Callable[[TickRecord], None] | None,
        pinger: sdnotify.Pinger | None,
    ) -> bool:
        """The ticks and the waits between them; commands from the API run in the waits."""
        next_resync = time.monotonic() + self.spec.agent.resync_interval
        ok = False
        while not self.stop.is_set():
            record = _guarded("tick.failed", self.tick)
            for observe in self.observers:
                _guarded("observer.failed", observe, record)
            ok = record is not None
            if record is not None:
                log.debug("tick", seq=record.snapshot.seq, seconds=round(record.duration, 4))
                sdnotify.status(
                    f"tick {record.snapshot.seq}: {len(record.snapshot.workloads)} workloads"
                )
                if on_tick is not None:
                    on_tick(record)
                if record.snapshot.seq == 1:
                    sdnotify.ready()
                if pinger is not None:
                    pinger.beat()
            if once:
                break
            deadline = time.monotonic() + self.spec.agent.interval
            while not self.stop.is_set():
                self.commands.run_pending()
                now = time.monotonic()
                if self._policy_file_changed() or self.reload_requested.is_set():
                    self.reload_requested.clear()
                    _guarded("policy.reload_failed", self.reload)
                if now >= next_resync:
                    _guarded("resync.failed", self.registry.resync)
                    next_resync = now + self.spec.agent.resync_interval
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    break
                wake = min(left, next_resync - now)
                if _guarded("watch.failed", self._wait_for_cgroup_events, max(wake, 0.0)):
                    break
        return ok

    def _record_originals(
        self, results: Sequence[WriteResult], plan: Plan, vanished: Iterable[str] = ()
    ) -> None:
        """Note the writes just made with what they replaced, right after the executor made
        them (before GPUs, observers or anything else that may hang); a first change of an
        attribute goes to the state's journal at once (nodeagent.state), so that release
        finds it after a crash. tuned records an old value before it sets the new one: here a
        kill between a write and this append loses that one original, which the next agent
        then takes to be what the agent had set."""
        modes = {c.path: c.write for c in plan.cgroups}
        root = self.spec.agent.managed_root
        for r in results:
            if r.outcome is Outcome.WRITTEN:
                via = modes.get(r.path) or write_mode(
                    parent_identity(r.path, root), self.spec.agent
                )
                self.originals.note(r.path, r.attribute, r.old, r.new, via)
        self.originals.forget(vanished)
        if not self.dry_run:
            self._journal_originals()

    def _journal_originals(self) -> None:
        """The fresh originals onto the journal; under the save's lock, so that a save from
        an API thread (which holds them all and removes the journal) cannot come between."""
        with self._save_lock:
            fresh = self.originals.take_fresh()
            try:
                state.append_originals(
                    self.spec.agent.state_file,
                    [(p, str(a), o.to_json()) for p, a, o in fresh],
                )
            except OSError:
                self._save_state()  # the whole file holds them, or logs why not (once)

    def _policy_file_changed(self) -> bool:
        """With `agent.reload_on_change`, whether the policy file is a new one since the
        last look (a ConfigMap's update swaps it in whole)."""
        watch = self.policy_file
        return self.spec.agent.reload_on_change and watch is not None and watch.changed()

    def _wait_for_cgroup_events(self, timeout: float) -> bool:
        """Sleep until timeout, a wake-up (a signal, a stop from another thread), or until
        cgroups appear or go. New workloads get their plan at once through the fast path;
        True only when events were lost (a resync), so that a full tick follows now."""
        fds = [self.wakeup.fileno()]
        inotify = self.registry.fileno()
        if inotify is not None:
            fds.append(inotify)
        readable, _, _ = select.select(fds, [], [], timeout)
        if self.wakeup.fileno() in readable:
            self.wakeup.drain()  # the caller looks at the flags before it waits again
        if inotify is None or inotify not in readable:
            return False
        self.registry.poll()
        new, self.registry.new = self.registry.new, []
        if new:
            _guarded("fastpath.failed", self.fast_path, new)
        resynced, self.registry.resynced = self.registry.resynced, False
        return resynced

    def fast_path(self, paths: list[str]) -> None:
        """Apply new workloads' own caps and their tenant's weight now, before the next
        full tick (policy.newcomer explains what it sets)."""
        found = self.slurm.enrich(
            (self.registry.workloads[p] for p in paths if p in self.registry.workloads),
            self.spec.agent.slurm,
        )
        # the runtime's answer is part of the fast path: a rule on labels applies at once
        identities = self.runtimes.attach(found, complete=False, new=True)
        jobs = self.jobs.assignments()
        assignments = {**assign(identities, self.spec, self._pods()), **jobs}
        last = self.last
        node = last.snapshot.node if last is not None else self.sensor.node.read()
        plan, snapshot = plan_newcomers(
            identities, assignments, self.spec, previous=None if last is None else last.plan,
            node=node, wall_time=time.time(),
        )  # fmt: skip
        results = self.executor.apply(plan, snapshot)
        self._record_originals(results, plan)
        self._fast_results.extend(results)  # reported with the next tick's
        for r in results:
            if r.outcome is Outcome.FAILED:
                log.warning("fastpath.write_failed", cgroup=r.path, attribute=str(r.attribute),
                            detail=r.detail)  # fmt: skip

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop the loop, SIGHUP reloads the policy. Call this before prepare(),
        so that an early `systemctl reload` does not kill the agent. The handlers only set a
        flag, which the loop's wait wakes for (nodeagent.wakeup says why nothing more)."""

        def on_stop(signum: int, _: FrameType | None) -> None:
            self._stop_signal = signum
            self.stop.set()

        def on_hup(_signum: int, _frame: FrameType | None) -> None:
            self.reload_requested.set()

        self.wakeup.on_signals()
        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)


T = TypeVar("T")
_KUBE_FIXED = {"node_name", "pod_resources_socket", "pod_resources_timeout", "api_server"}


def _kubernetes(spec: PolicySpec) -> KubernetesNode | None:
    """The Kubernetes side in `agent.mode: kubernetes`; its libraries load only then."""
    if spec.agent.mode is not AgentMode.KUBERNETES:
        return None
    from nodeagent.kube.node import KubernetesNode  # noqa: PLC0415

    return KubernetesNode(spec)


def _usage_shares(usage: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    """Each tenant's part of the decayed usage, to the percent: fair share re-plans when
    it moves, and not for every last core-second."""
    total = sum(usage.values())
    return tuple(sorted((t, round(u / total, 2) if total else 0.0) for t, u in usage.items()))


def _local_seconds(wall: float) -> float:
    """Seconds since local midnight, for the policies' daily windows."""
    t = time.localtime(wall)
    return t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec + wall % 1


def _guarded(event: str, fn: Callable[..., T], *args: object) -> T | None:
    """Run one step of the loop; an error is logged, never fatal: the next tick retries."""
    try:
        return fn(*args)
    except NodeagentError as e:
        log.error(event, error=str(e))
    except Exception as e:  # a bug or an unexpected kernel answer: keep the loop alive
        log.exception(event, error=f"{type(e).__name__}: {e}")
    return None


def serve_metrics(agent: Agent) -> MetricsServer | None:
    """The Prometheus endpoint, when `agent.metrics.listen` is set."""
    listen = agent.spec.agent.metrics.listen
    if listen is None:
        return None
    # imported only when metrics are on: prometheus_client is slow to import on a cold disk
    from nodeagent.metrics.collector import TickCollector  # noqa: PLC0415
    from nodeagent.metrics.server import MetricsServer, stale_window  # noqa: PLC0415

    collector = TickCollector(
        lambda: agent.notes.deadline_misses,
        reload=lambda: agent.last_reload,
        interval=lambda: agent.spec.agent.interval,
    )
    if agent.gpus.backend.inventory():
        collector.watch_gpus(agent.gpus.backend)
    settings = agent.spec.agent.metrics
    server = MetricsServer.start(
        listen,
        collector,
        bearer_token_file=settings.bearer_token_file,
        socket_group=settings.socket_group,
        stale_after=lambda: stale_window(agent.spec.agent.interval),
    )
    agent.observers.append(server.observe)  # the collector's, and /healthz's
    return server


def serve(agent: Agent) -> ApiServer:
    server = ApiServer(agent.spec.agent.socket, agent.routes(), agent.spec.agent.socket_group)
    server.start()
    return server
