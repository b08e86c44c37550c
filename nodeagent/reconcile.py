"""One tick: sense -> snapshot -> plan -> act -> record, and the fast path between ticks.

Level-triggered: every tick recomputes the whole plan from the kernel's current state, so a
missed event or a restart costs at most one tick. What a tick leaves the next is data, in
one place (`Feedback`): the usage history, the policies' carried state, what the executor
held back or failed to write, whether to read every file again. The caches of what a tick
derives from the last (who is claimed, what to read, the plan) are keyed on their inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import structlog

from nodeagent.act import Executor, Outcome, WriteResult, not_in_place
from nodeagent.cgroupfs.subtree import ensure_managed_root, leave_managed_path
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute
from nodeagent.changes import NoteLog, ProblemLog
from nodeagent.discovery.registry import Registry
from nodeagent.gpu.model import GpuState, Hold, HoldKind
from nodeagent.gpualloc.service import GpuDecisions, GpuReading, GpuService
from nodeagent.identity import WorkloadIdentity
from nodeagent.jobs import Job, Jobs
from nodeagent.kube.pods import EMPTY, PodDirectory
from nodeagent.logs import audit_write
from nodeagent.originals import Originals
from nodeagent.ownership import WriteMode, parent_identity, write_mode
from nodeagent.persistence import StateSaver
from nodeagent.policy.base import Assignment, Policy
from nodeagent.policy.classify import assign
from nodeagent.policy.history import decay
from nodeagent.policy.newcomer import Siblings, plan_newcomers
from nodeagent.policy.plan import DEFAULT_POLICIES, Plan
from nodeagent.policy.plancache import PlanCache, PlanInputs
from nodeagent.policy.weights import ancestors
from nodeagent.policyfile.model import PolicySpec
from nodeagent.policyfile.source import PolicySource
from nodeagent.reach import Reach
from nodeagent.release import Releaser, in_release_order
from nodeagent.report import AgentView, TickRecord
from nodeagent.runtimes.docker import DockerAdapter
from nodeagent.runtimes.gpus import DockerGpus, RuntimeGpus
from nodeagent.runtimes.metadata import RuntimeMetadata
from nodeagent.sense.sensor import Sensor
from nodeagent.slurm import SlurmJobs
from nodeagent.snapshot import NO_NEEDS, Needs, NodeSnapshot
from nodeagent.state import SavedState

if TYPE_CHECKING:
    from nodeagent.kube.node import KubernetesNode

log = structlog.get_logger("nodeagent")

CONTROLLERS = ("cpu", "memory")
OPTIONAL_CONTROLLERS = ("pids",)
"""Enabled down to the managed root where the host offers them (jobs' pids.max)."""


@dataclass(frozen=True, slots=True)
class Feedback:
    """What a tick leaves the next one."""

    usage: Mapping[str, float] = field(default_factory=dict)
    """The decayed usage history, per tenant."""
    carry: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    """The policies' state for their next tick, by policy name."""
    held_back: frozenset[str] = frozenset()
    """Workloads whose memory.max waits for their usage to fit: read it every tick."""
    retry: frozenset[str] = frozenset()
    """Workloads with a failed write: written again even on an unchanged plan."""
    read_all: bool = True
    """Read every file of every workload (at start, after a reload)."""


class Claimed(NamedTuple):
    """Who the rules and the jobs claim (`Reconciler.claimed`), kept while nothing it is
    made of changes."""

    assignments: dict[str, Assignment]
    managed: list[WorkloadIdentity]
    levels: list[WorkloadIdentity]
    """The claimed workloads' parents (the hierarchy of fair share)."""
    modes: dict[str, WriteMode]
    unclaimed: frozenset[str]
    """The workloads found that neither claims, nor are a claimed one's parent."""


@dataclass(frozen=True, slots=True)
class Sensed:
    """What a tick's sense found: the snapshot, the GPUs, who is claimed and how each is
    written, and what discovery lost or no longer sees claimed."""

    snapshot: NodeSnapshot
    """The workloads and the node as read; its GPUs are decide's (`Decided.snapshot`)."""
    gpus: GpuReading
    assignments: Mapping[str, Assignment]
    modes: Mapping[str, WriteMode]
    gone: tuple[str, ...]
    """Cgroups discovery saw removed since the last tick."""
    unclaimed: frozenset[str]
    """Workloads found that no rule, job or hierarchy claims (what the agent set on them
    goes back)."""


@dataclass(frozen=True, slots=True)
class Decided:
    """What a tick's decide made of it: the snapshot the policies saw (the GPUs with the
    holds as decided), the GPU ledger's decisions, the plan, whether it is the last one
    unchanged, and the jobs that ended."""

    snapshot: NodeSnapshot
    gpus: GpuDecisions
    plan: Plan
    same: bool
    ended: tuple[Job, ...]


class Reconciler:
    """The tick and the fast path, over the collaborators the daemon wires in; with no
    I/O of its own until it is asked to act."""

    def __init__(
        self,
        policy: PolicySource,
        tree: CgroupTree,
        *,
        proc_root: str,
        dry_run: bool,
        registry: Registry,
        sensor: Sensor,
        executor: Executor,
        runtimes: RuntimeMetadata,
        slurm: SlurmJobs,
        kube: KubernetesNode | None,
        gpus: GpuService,
        jobs: Jobs,
        policies: tuple[Policy, ...] = DEFAULT_POLICIES,
    ) -> None:
        self.policy = policy
        """The policy in force, shared with the parts that read it (a reload replaces it)."""
        self.tree = tree
        self.proc_root = proc_root
        self.dry_run = dry_run
        self.registry = registry
        self.sensor = sensor
        self.executor = executor
        self.runtimes = runtimes
        self.runtime_gpus = RuntimeGpus()
        """The GPUs dockerd gave its containers (`docker run --gpus`), as holds."""
        self.slurm_gpus = RuntimeGpus()
        """The GPUs (GRES) Slurm gave its jobs on this node, as holds."""
        self.slurm = slurm
        self.kube = kube
        self.gpus = gpus
        self.jobs = jobs
        self.saver = StateSaver(policy, self.gather)
        self.policies = policies
        """The policies a full tick runs, in order; what they need read every tick and what
        they read of the tick's inputs they declare themselves (`Policy.needs`,
        `Policy.reads`): the loop knows none of them by name."""
        self.feedback = Feedback()
        self.originals = Originals()
        """What the agent changed and the values before, for `nodeagent release`."""
        self._hand_back_failed: set[tuple[str, Attribute]] = set()
        """What could not be handed back, logged once (hand_back)."""
        self.last: TickRecord | None = None
        """The last tick's record (replaced whole: readers on other threads take it as is)."""
        self.view = AgentView(None, 0, None, 0, {}, ())
        """What the API reads; `publish` replaces it (open_agent does, once restored)."""
        self.problems = ProblemLog()
        self.notes = NoteLog()
        self.plans = PlanCache()
        self._fast_results: list[WriteResult] = []
        """The fast path's writes since the last tick, reported with the next one."""
        self._siblings: Siblings | None = None
        """The last tick's weights by parent and tenant, made at its first newcomer."""
        self._lookups: dict[str, float] = {}
        """Newcomers the fast path took without the runtime's answer, and when (on the
        runtimes' clock) it can be asked again: they go through the fast path again then,
        unless a tick (which asks for them itself) comes first."""
        self.forget_derived()

    @property
    def spec(self) -> PolicySpec:
        return self.policy.spec

    @spec.setter
    def spec(self, spec: PolicySpec) -> None:
        self.policy.spec = spec

    def forget_derived(self) -> None:
        """Empty the caches of what each tick derives from the last (what to read, who is
        claimed, the refusals said)."""
        self._needs_key: object = None
        self._needs_value: dict[str, Needs] = {}
        self._refused: set[tuple[str, str]] = set()
        """(cgroup, what a rule refused) said already."""
        self._claimed_key: object = None
        self._claimed_value = Claimed({}, [], [], {}, frozenset())

    # --- what the state file keeps ------------------------------------------------------

    def restore(self, saved: SavedState) -> None:
        """The saved usage history, decayed by the time away (only tenants still in the
        policy are kept, so a removed tenant's history is not carried and re-saved forever);
        and the jobs that still run, their GPU holds and the policies' carried state."""
        self.jobs.load(saved.jobs, self.spec.agent.managed_root)
        self.gpus.ledger.load(saved.gpus, self._kept_hold, time.monotonic(), time.time())
        self.gpus.ledger.load_history(saved.gpu_history)
        self.originals = Originals.load(saved.originals)
        self.originals.forget([p for p, _, _ in self.originals.items() if not self.tree.exists(p)])
        elapsed = time.time() - saved.saved_at
        usage = decay(saved.tenant_usage, elapsed, self.spec.fair_share.half_life)
        carry = {k: dict(v) for k, v in saved.carry.items()}
        self.feedback = replace(self.feedback, usage=usage, carry=carry)

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

    def gather(self, now: float, wall: float) -> SavedState:
        """What a save writes: taken at `now` (monotonic) and `wall`."""
        ledger = self.gpus.ledger
        return SavedState(
            wall,
            self.feedback.usage,
            self.jobs.dump(),
            self.feedback.carry,
            ledger.dump(now, wall),
            ledger.history(),
            self.originals.dump(),
        )

    # --- the tick -----------------------------------------------------------------------

    def prepare(self) -> None:
        """Create and enable the managed subtree, then discover. Writes nothing in dry-run."""
        if not self.dry_run:
            root = self.spec.agent.managed_root
            leave_managed_path(self.tree, root, self.proc_root, audit_write)
            ensure_managed_root(self.tree, root, CONTROLLERS, audit_write, OPTIONAL_CONTROLLERS)
        self.registry.resync()
        if self.kube is not None:
            self.kube.start()

    def tick(self) -> TickRecord:
        """One tick, as four calls: what is there, what to do about it, doing it, and what
        it leaves the API and the next tick (docs/architecture.md, "One tick")."""
        started = time.monotonic()
        sensed = self.sense(started)
        decided = self.decide(sensed, started)
        applied = self.act(sensed, decided)
        return self.record(sensed, decided, applied, started)

    def sense(self, started: float) -> Sensed:
        """What is there: the workloads discovery knows (and the jobs, tracked even before
        inotify says), who the rules claim, and their files and the GPUs, read. Nothing
        outside the agent changes; only the sensors' own memory does (the registry's lists,
        the runtimes' and Slurm's answers, the sensor's kept reads)."""
        fed = self.feedback
        self.registry.poll()
        self.registry.new.clear()  # this tick plans them in full
        gone, self.registry.gone = self.registry.gone, []
        jobs = self.jobs.assignments()  # exec's jobs, managed whatever the rules say
        for path in jobs.keys() - self.registry.workloads.keys():
            self.registry.track(path)  # started since inotify last spoke
        # only workloads a rule or exec claims are sensed: the rest are left alone
        identities = self.runtimes.attach(
            self.slurm.enrich(self.registry.identities(), self.spec.agent.slurm)
        )
        claimed = self.claimed(identities, jobs)
        assignments, managed, levels = claimed.assignments, claimed.managed, claimed.levels
        snapshot = self.sensor.snapshot(
            managed,
            time.time(),
            started,
            needs=self.needs(assignments, managed, fed.held_back),
            levels=levels,
            full=fed.read_all,
        )
        for path in snapshot.vanished:  # inotify may have missed it (a failed watch)
            self.registry.forget(path)
        gpus = self.gpus.read(self._outside(assignments, identities))
        return Sensed(snapshot, gpus, assignments, claimed.modes, tuple(gone), claimed.unclaimed)

    def decide(self, sensed: Sensed, started: float) -> Decided:
        """What to do about it, with no I/O: the GPU ledger's binds, drops, lapses and grants
        (the GPUs as they decide them go into the snapshot the policies see), the jobs that
        ended, and the plan (every policy's decisions, merged; an unchanged one reused,
        policy.plancache). `started`, the tick's monotonic start, is its clock."""
        fed, last = self.feedback, self.last
        gpus = self.gpus.decide(sensed.gpus, self.spec.gpu, started)
        snapshot = sensed.snapshot
        if gpus.state is not snapshot.gpus:  # no GPUs: neither is anything
            snapshot = replace(snapshot, gpus=gpus.state)
        given = PlanInputs(
            snapshot,
            self.spec,
            fed.usage,
            fed.carry,
            sensed.assignments,
            None if last is None else last.plan,
            held_back=bool(fed.held_back),
        )
        plan, same = self.plans.plan(given, self.policies, started)
        return Decided(snapshot, gpus, plan, same, tuple(self.jobs.ended(snapshot)))

    def act(self, sensed: Sensed, decided: Decided) -> tuple[WriteResult, ...]:
        """Every effect of the tick, in one place: the GPU ledger's decisions made so (on
        the ledger they were decided on), the ended jobs reaped (their GPUs go back, for the
        next tick's grants), the cgroup writes and, at once, what they replaced (tuned's
        "old value recorded": journalled, or the whole state saved when due, before any
        later step may hang or fail), what is no longer claimed handed back, then the GPUs
        published to the API server and their power limits. Dry-run reaps and hands back
        nothing (its executors write nothing either)."""
        snapshot, plan = decided.snapshot, decided.plan
        self.gpus.apply(decided.gpus)
        if not self.dry_run:
            self.jobs.reap(decided.ended)
        # an unchanged plan was applied already: only what was read afresh can differ, and
        # what failed to be written last time is tried again
        only = self.sensor.fresh | self.feedback.retry if decided.same else None
        applied = tuple(self.executor.apply(plan, snapshot, only))
        self.originals.forget_below(p for p in sensed.gone if not self.tree.exists(p))
        self.record_originals(applied, plan, snapshot.vanished, tick=True)
        if not self.dry_run:
            self.hand_back(set(sensed.unclaimed))
        if self.kube is not None:
            self.kube.publish(snapshot.gpus, self.spec)
        self.gpus.executor.apply(plan, snapshot, self.dry_run)
        return applied

    def record(
        self, sensed: Sensed, decided: Decided, applied: Sequence[WriteResult], started: float
    ) -> TickRecord:
        """What the tick leaves: what the sensor now knows it wrote, the next tick's
        feedback, the problems and notes, and the frozen record and view the API reads."""
        snapshot, plan = decided.snapshot, decided.plan
        results = (*self._fast_results, *applied)  # the fast path's since the last tick too
        self._fast_results = []
        # what this plan wrote is known from now on (a newcomer the fast path wrote is read
        # in full when first sensed, and may be gone from this plan)
        written = [r for r in applied if r.outcome is Outcome.WRITTEN]
        if written:
            targets = {c.path: c.targets for c in plan.cgroups}
            for r in written:
                if r.path in targets:  # not a thaw outside the workloads (not sensed)
                    self.sensor.learn(r.path, r.attribute, targets[r.path][r.attribute].value)
        self.feedback = Feedback(
            usage=dict(plan.tenant_usage),
            carry=dict(plan.carry),
            held_back=frozenset(r.path for r in results if r.outcome is Outcome.UNREACHABLE),
            retry=frozenset(r.path for r in results if r.outcome is Outcome.FAILED),
            read_all=False,
        )
        self.problems.update(snapshot, plan, results)
        self.notes.update(plan.notes)
        self.last = TickRecord(
            snapshot, plan, results, time.monotonic() - started, self.dry_run,
            sensed.assignments, sensed.modes, self.peers(),
        )  # fmt: skip
        self._siblings = None
        self._lookups.clear()  # this tick asked the runtimes for whom it could
        self.publish()
        return self.last

    def publish(self) -> AgentView:
        """A new view for the API's reads (report.AgentView, and the GPU service's), made
        on the loop's thread after each tick and each command, and at start once the state
        is restored (its jobs and GPU holds), and swapped in whole."""
        self.gpus.publish()
        self.view = AgentView(
            self.last,
            len(self.registry.workloads),
            self.slurm.problem,
            self.notes.deadline_misses,
            self.runtimes.status(),
            tuple(self.jobs.dump()),
        )
        return self.view

    def _outside(
        self, assignments: Mapping[str, Assignment], identities: Sequence[WorkloadIdentity]
    ) -> Callable[[GpuState], tuple[Hold, ...]]:
        """This tick's holds outside the ledger, asked once the GPUs are read (only a node
        with GPUs asks)."""
        kube, spec = self.kube, self.spec

        def outside(state: GpuState) -> tuple[Hold, ...]:
            """The pods' (the kubelet's device plugin), the Docker containers' given GPUs
            (`--gpus`) and the Slurm jobs' (GRES), each where it applies; each asks only about
            what those before it do not cover."""
            docker = self.runtimes.adapters.get("docker")
            dockerd = DockerGpus(docker) if isinstance(docker, DockerAdapter) else None
            slurm = self.slurm.gpus(spec.agent.slurm)
            classes = {p: str(a.workload_class) for p, a in assignments.items()}
            pods = () if kube is None else kube.gpu_holds(state, spec, identities, classes)
            held = (*state.holds, *pods)
            containers = self.runtime_gpus.holds(dockerd, state, identities, classes, held)
            held += containers
            jobs = self.slurm_gpus.holds(slurm, state, identities, classes, held)
            return pods + containers + jobs

        return outside

    def peers(self) -> tuple[Reach, ...]:
        """Every service the agent asks, as it last answered (`reach`)."""
        kube = () if self.kube is None else self.kube.peers()
        return (
            *self.runtimes.reach.now(), *self.slurm.reach.now(), *self.executor.reach.now(),
            *kube,
        )  # fmt: skip

    def claimed(
        self, identities: list[WorkloadIdentity], jobs: Mapping[str, Assignment]
    ) -> Claimed:
        """Who the rules and the jobs claim, their parents and write modes: worked out again
        only when the workloads, the jobs or the policy change (a steady tick skips it)."""
        pods = self.pods()
        key = (tuple(identities), tuple(jobs.items()), id(self.spec), pods.version)
        if key != self._claimed_key:
            assignments = {**assign(identities, self.spec, pods), **jobs}
            self._say_refused(assignments)
            managed = [i for i in identities if i.path in assignments]
            modes = {i.path: write_mode(i, self.spec.agent) for i in managed}
            levels = self._levels(managed)
            unclaimed = {i.path for i in identities} - {*assignments, *(i.path for i in levels)}
            self._claimed_value = Claimed(assignments, managed, levels, modes, frozenset(unclaimed))
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

    def needs(
        self,
        assignments: Mapping[str, Assignment],
        managed: list[WorkloadIdentity],
        held_back: frozenset[str] = frozenset(),
    ) -> dict[str, Needs]:
        """What each workload's lean read adds to its usage: what the policies in use
        declare they need of it (`Policy.needs`), what the job reaper needs (exec's jobs'
        cgroup.events), and memory.current while the executor holds a memory.max back
        until usage fits (`held_back`)."""
        key = (id(assignments), held_back)
        if key == self._needs_key:
            return self._needs_value
        spec, policies = self.spec, self.policies
        out = {}
        for i in managed:
            a = assignments[i.path]
            need = self.jobs.needs(a)
            if i.path in held_back:
                need |= Needs(memory=True)
            for policy in policies:
                need |= policy.needs(a, spec)
            if need != NO_NEEDS:
                out[i.path] = need
        self._needs_key, self._needs_value = key, out
        return out

    def pods(self) -> PodDirectory:
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

    def fairness(self, tenant: str) -> float:
        """How far a tenant is ahead of its share: decayed usage per share (lower first)."""
        share = self.spec.tenants[tenant].shares if tenant in self.spec.tenants else 1.0
        return self.feedback.usage.get(tenant, 0.0) / share

    # --- what was written ---------------------------------------------------------------

    def record_originals(
        self,
        results: Sequence[WriteResult],
        plan: Plan,
        vanished: Iterable[str] = (),
        tick: bool = False,
    ) -> None:
        """Note the writes just made with what they replaced, right after the executor made
        them (in the tick's act, before its GPU calls, observers or anything else that may
        hang); a first change of an
        attribute goes to the state's journal at once (nodeagent.state), so that release
        finds it after a crash. tuned records an old value before it sets the new one: here a
        kill between a write and this append loses that one original, which the next agent
        then takes to be what the agent had set. A tick whose whole save is due saves here
        instead of journalling: the save holds them all (a first tick's thousands of first
        changes were journalled line by line, then saved whole at its end); the fast path
        only journals, so that no whole save delays the next newcomer."""
        written = [r for r in results if r.outcome is Outcome.WRITTEN]
        modes = {c.path: c.write for c in plan.cgroups} if written else {}  # none on idle ticks
        root = self.spec.agent.managed_root
        for r in written:
            via = modes.get(r.path) or write_mode(parent_identity(r.path, root), self.spec.agent)
            self.originals.note(r.path, r.attribute, r.old, r.new, via)
        self.originals.forget(vanished)
        if self.dry_run:
            return
        if tick and self.saver.due():
            self.saver.save()  # what is saved is as of the last tick, these originals included
        else:
            self.saver.journal(self._fresh_originals)

    def hand_back(self, unclaimed_paths: set[str]) -> None:
        """What the agent set on a workload it finds but no longer claims (a reload's rules
        no longer match it, its label changed) is handed back at once, as `nodeagent
        release` hands it back at a stop: the original, where the attribute still holds what
        the agent set, the way it was written (through systemd for its units), an audit
        event each; a value someone changed since is theirs and is left. One the agent does
        not see this tick keeps its values and its record: a scan that missed it (a budget,
        an unreadable directory) would otherwise undo and redo its caps tick after tick; a
        level no longer weighted is handed back by release. One that fails is kept and tried
        again each tick (and by release at the stop); its failure is logged once."""
        unclaimed = self.originals.items(among=unclaimed_paths)
        if not unclaimed:
            return
        releaser = Releaser(self.tree, self.executor.units, self.executor.audit)
        for path, attribute, original in in_release_order(unclaimed):
            handed = releaser.one(path, attribute, original)
            if handed.outcome != "failed":
                self.originals.drop(path, attribute)
                self._hand_back_failed.discard((path, attribute))
            elif (path, attribute) not in self._hand_back_failed:
                self._hand_back_failed.add((path, attribute))
                log.warning(
                    "release.failed",
                    cgroup=path,
                    attribute=str(attribute),
                    problem=handed.detail,
                    why="no rule claims it any more; tried again each tick and at the stop",
                )

    def _fresh_originals(self) -> list[tuple[str, str, Mapping[str, str]]]:
        return [(p, str(a), o.to_json()) for p, a, o in self.originals.take_fresh()]

    # --- between ticks ------------------------------------------------------------------

    def fast_path(self, paths: list[str]) -> None:
        """Apply new workloads' own caps and their tenant's weight now, before the next
        full tick (policy.newcomer explains what it sets)."""
        found = self.slurm.enrich(
            (self.registry.workloads[p] for p in paths if p in self.registry.workloads),
            self.spec.agent.slurm,
        )
        # the runtime's answer is part of the fast path: a rule on labels applies at once
        identities = self.runtimes.attach(found, complete=False, new=True)
        for identity in identities:
            at = self.runtimes.retry_at(identity)
            if at is not None:
                self._lookups[identity.path] = at
        jobs = self.jobs.assignments()
        assignments = {**assign(identities, self.spec, self.pods()), **jobs}
        plan, results = self._newcomers(identities, assignments)
        self.record_originals(results, plan)
        for r in results:
            if r.outcome is Outcome.FAILED:
                log.warning("fastpath.write_failed", cgroup=r.path, attribute=str(r.attribute),
                            detail=r.detail)  # fmt: skip

    def lookups_due(self) -> float | None:
        """When the first newcomer left without its runtime's answer is due again (on the
        runtimes' clock), or None."""
        return min(self._lookups.values(), default=None)

    def retry_lookups(self) -> None:
        """The newcomers whose runtime lookup is due again, through the fast path again: a
        rule on their labels applies now, not at the next tick (an interval away) or later."""
        now = self.runtimes.clock()
        due = [path for path, at in self._lookups.items() if at <= now]
        for path in due:
            del self._lookups[path]
        due = [path for path in due if path in self.registry.workloads]  # not gone since
        if due:
            self.fast_path(due)

    def new_job(self, identity: WorkloadIdentity, assignment: Assignment) -> list[str]:
        """A new job's cgroup planned as the fast path plans a newcomer and written by the
        executor (audited), before its process moves in (Jobs' `write_limits`); what of it
        is not in place. Its limits are the job's own terms, not a change the agent made to
        a workload it found: they are not originals for `release` to hand back (a stop
        leaves running jobs running, under the limits they were started with)."""
        plan, results = self._newcomers([identity], {identity.path: assignment})
        return not_in_place(plan, results)

    def _newcomers(
        self, identities: Sequence[WorkloadIdentity], assignments: Mapping[str, Assignment]
    ) -> tuple[Plan, list[WriteResult]]:
        """New cgroups' plan (policy.newcomer) applied by the executor; the results are
        reported with the next tick's."""
        last = self.last
        node = last.snapshot.node if last is not None else self.sensor.node.read()
        if last is not None and self._siblings is None:
            self._siblings = Siblings.of(last.plan)
        plan, snapshot = plan_newcomers(
            identities, assignments, self.spec, siblings=self._siblings, node=node,
            wall_time=time.time(),
        )  # fmt: skip
        results = self.executor.apply(plan, snapshot)
        self._fast_results.extend(results)
        return plan, results

    def reloaded(self, spec: PolicySpec) -> None:
        """A new policy from the next tick on: every file read again, and a new plan."""
        if spec.agent.slurm != self.spec.agent.slurm:
            # the jobs' GRES grants were read with the old node name or scontrol: ask again
            self.slurm_gpus = RuntimeGpus()
        self.spec = spec
        self.sensor.min_window = spec.agent.interval / 2
        self.sensor.verify_every = spec.agent.resync_interval
        self.feedback = replace(self.feedback, read_all=True)
        self.plans.expire()
        # the claims' key holds the policy by id: a new policy object may take the freed
        # one's id, so what was derived from the old one goes with it
        self.forget_derived()
