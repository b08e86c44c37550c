"""The daemon: wiring and lifecycle around the reconcile loop (nodeagent.reconcile).

`open_agent` does start-up's I/O (the GPU backend, the state file) and wires the parts;
`Agent` runs the loop: a tick, then a wait in which commands from the API, reloads,
resyncs and new cgroups (the fast path) are taken in turn; signals only set flags. The loop
is the only thread that changes state (docs/architecture.md, "Threads").
"""

from __future__ import annotations

import functools
import math
import os
import select
import signal
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, TypeVar

import structlog
from pydantic import ValidationError

from nodeagent import running, sdnotify, state
from nodeagent.act import Executor, Outcome
from nodeagent.api.server import ApiServer, Routes
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.commands import Commands
from nodeagent.discovery.registry import Registry
from nodeagent.errors import NodeagentError, one_line
from nodeagent.gpu.choice import open_backend
from nodeagent.gpualloc.service import GpuService, process_uids
from nodeagent.jobs import Jobs
from nodeagent.logs import audit_write
from nodeagent.policyfile.filewatch import FileWatch
from nodeagent.policyfile.load import digest, load_policy
from nodeagent.policyfile.model import AgentMode, AgentSettings, PolicySpec
from nodeagent.policyfile.source import PolicySource
from nodeagent.policyfile.yamlfile import PolicyError
from nodeagent.reconcile import Reconciler
from nodeagent.reloads import Reload
from nodeagent.report import TickRecord
from nodeagent.routes.agent import agent_routes
from nodeagent.routes.gpus import GpuRoutes
from nodeagent.runtimes.metadata import RuntimeMetadata
from nodeagent.sdbus import Systemd
from nodeagent.selfguard import SelfGuard
from nodeagent.sense.node import NodeSensor
from nodeagent.sense.sensor import Sensor
from nodeagent.slurm import SlurmJobs
from nodeagent.staleness import stale_window
from nodeagent.wakeup import Flag, Wakeup

if TYPE_CHECKING:
    from nodeagent.kube.node import KubernetesNode
    from nodeagent.metrics.server import MetricsServer

log = structlog.get_logger("nodeagent")


def open_agent(
    spec: PolicySpec,
    tree: CgroupTree,
    *,
    proc_root: str = "/proc",
    dry_run: bool = False,
    config_path: str | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Agent:
    """An agent wired for this host: start-up's I/O (the GPU backend, opened once for the
    daemon's life, none on a host without GPUs; the state file restored) happens here, not
    in the constructors. `overrides`: command-line settings, which win over the file's."""
    overrides = dict(overrides or {})
    spec = with_overrides(spec, overrides)
    policy = PolicySource(spec)  # a reload replaces its spec; the parts below read it there
    registry = Registry(tree, spec.agent.managed_root)
    # rates over shorter windows than half a tick are noise (cpu.stat moves in scheduler ticks)
    sensor = Sensor(
        tree,
        NodeSensor(proc_root),
        min_window=spec.agent.interval / 2,
        verify_every=spec.agent.resync_interval,
    )
    executor = Executor(
        tree,
        audit_write,
        dry_run,
        Systemd(),  # systemd's D-Bus API, for the cgroups it owns; connected at the first write
        lambda: policy.spec.agent.systemd.without_bus,
        # the agent's cgroup and those above: never tightened (where it is read at most once
        # a second: a burst of newcomers costs one read)
        guard=SelfGuard(tree, proc_root, every=1.0),
    )
    gpus = GpuService(
        open_backend(spec.gpu.simulate, proc_root),
        lambda: policy.spec,
        tree.exists,
        lambda: registry.workloads.values(),  # noqa: PLW0108 - a resync replaces the dict
        # whose a workload is (a reservation binds only to its uid's own): the jobs' /proc
        functools.partial(process_uids, tree.root, proc_root=proc_root),
    )
    rec = Reconciler(
        policy,
        tree,
        proc_root=proc_root,
        dry_run=dry_run,
        registry=registry,
        sensor=sensor,
        executor=executor,
        # what the container runtimes say about their containers (names, images, labels)
        runtimes=RuntimeMetadata.from_settings(spec.agent.runtimes),
        slurm=SlurmJobs(),  # Slurm's accounts, asked only when discovery finds Slurm jobs
        kube=_kubernetes(spec),  # the kubelet's PodResources and the API server's watch
        gpus=gpus,
        jobs=Jobs(tree, audit_write, proc_root, on_end=gpus.release_job),
    )
    saved = _saved_state(spec, dry_run)
    if saved is not None:
        rec.restore(saved)
    rec.publish()  # what the API answers until the first tick: the restored jobs, say
    # for agent.reload_on_change: the policy file as it was last loaded
    watch = None if config_path is None else FileWatch(config_path)
    return Agent(rec, config_path=config_path, overrides=overrides, policy_file=watch)


def _saved_state(spec: PolicySpec, dry_run: bool) -> state.SavedState | None:
    """The state file's records; one this version cannot use (another version's, or a
    damaged one) is kept aside, not overwritten by the first save (issue 36 item 3)."""
    path = spec.agent.state_file
    try:
        return state.load(path, tenants=spec.tenants)
    except NodeagentError as e:
        if dry_run:  # writes nothing, so its saves replace nothing either
            log.error("state.unusable", error=str(e), action="starting with empty state")
            return None
        try:
            kept = state.keep_aside(path, time.time())
        except NodeagentError as moved:
            raise NodeagentError(f"{e}; and {moved}: refusing to start over it") from moved
        log.error(
            "state.unusable",
            error=str(e),
            kept=kept,
            action=f"starting with empty state; {kept[0] if kept else path} keeps what it"
            " recorded: `nodeagent release --all --state-file FILE`, run by the version that"
            " wrote it, hands back the caps and freezes it lists",
        )
        return None


def with_overrides(spec: PolicySpec, overrides: Mapping[str, object]) -> PolicySpec:
    """Command-line settings win over the file's, at start and on every reload."""
    if not overrides:
        return spec
    try:  # validated as the file's values are: a bad --state-file is refused the same way
        agent = AgentSettings.model_validate({**spec.agent.model_dump(), **overrides})
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        option = "--" + str(first["loc"][0]).replace("_", "-")
        message = str(first.get("ctx", {}).get("error", first["msg"]))
        raise NodeagentError(f"{option}: {message}") from None
    return spec.model_copy(update={"agent": agent})


class Agent:
    """The loop around a `Reconciler`: its waits, signals, reloads and the API's commands.
    The parts it reaches through (`jobs`, `gpus`, `usage`...) are the reconciler's."""

    def __init__(
        self,
        rec: Reconciler,
        *,
        config_path: str | None = None,
        overrides: Mapping[str, object] | None = None,
        policy_file: FileWatch | None = None,
    ) -> None:
        self.rec = rec
        self.config_path = config_path
        self.overrides = dict(overrides or {})
        self.policy_file = policy_file
        """The file `agent.reload_on_change` watches, as it was last loaded."""
        self.observers: list[Callable[[TickRecord | None], None]] = []
        """Told of every tick: its record, or None when it failed (the metrics)."""
        self.wakeup = Wakeup()
        """What the loop's wait wakes for: a signal, another thread's stop, besides inotify."""
        self.stop = Flag(self.wakeup)
        self.reload_requested = Flag(self.wakeup)
        self.commands = Commands(self.wakeup)  # the API handlers that change state post here
        self._stop_signal: int | None = None
        self.started = time.time()
        """When this daemon started (Unix time), for /v1/status."""
        self.policy_loaded = self.started
        """When the policy in force was loaded (Unix time): the start, or the last reload
        that applied."""
        self.reload_outcome: Reload | None = None
        """What the last reload did, its problems included (/v1/status); None before any."""
        self._digest: tuple[PolicySpec | None, str] = (None, "")

    def prepare(self) -> None:
        """Create and enable the managed subtree, then discover. Writes nothing in dry-run."""
        self.rec.prepare()

    def tick(self) -> TickRecord:
        return self.rec.tick()

    def fast_path(self, paths: list[str]) -> None:
        self.rec.fast_path(paths)

    @property
    def last_reload(self) -> tuple[bool, float]:
        """Whether the last reload applied the file, and when the policy in force was loaded,
        for the metrics: made from `reload_outcome` (the start-up load counts as a reload
        that applied) and `policy_loaded`, which hold them."""
        outcome = self.reload_outcome
        return (outcome is None or outcome.applied, self.policy_loaded)

    @property
    def policy_sha256(self) -> str:
        """The policy in force's digest (policyfile.load.digest), made once per policy."""
        spec, made = self._digest
        if spec is not self.rec.spec:
            spec = self.rec.spec
            self._digest = (spec, made := digest(spec))
        return made

    def save_state(self) -> None:
        """Save the usage history, the jobs, the holds and the carried state now."""
        self.rec.saver.save()

    def reload(self) -> Reload | None:
        """Re-read the policy file; on any problem keep running on the last good policy.
        SIGHUP, `agent.reload_on_change` and `POST /v1/reload` all come here, on the loop's
        thread: what it did is returned (the API answers with it) and kept for /v1/status
        and the metrics (`last_reload`). None without a policy file."""
        path = self.config_path
        if path is None:
            return None
        try:
            outcome = self._reload(path)
        except Exception as e:  # a bug or the runtimes' reopening: said, then raised as before
            self.reload_outcome = Reload(path, False, time.time(), (f"{path}: {one_line(e)}",))
            raise
        if outcome.applied:
            self.policy_loaded = outcome.at
        self.reload_outcome = outcome
        return outcome

    def _reload(self, path: str) -> Reload:
        try:
            spec = with_overrides(load_policy(path), self.overrides)
        except PolicyError as e:
            for problem in e.problems:
                log.error(
                    "policy.invalid", problem=str(problem), action="keeping the last good policy"
                )
            # str(e): every problem shown, and the count of those left out
            return Reload(path, False, time.time(), tuple(str(e).splitlines()))
        except NodeagentError as e:  # a command-line override the new file's values refuse
            log.error("policy.reload_failed", error=str(e))
            return Reload(path, False, time.time(), (f"{path}: {e}",))
        changed = needs_restart(self.rec.spec, spec)
        if changed:
            log.error(
                "policy.needs_restart",
                changed=changed,
                action="keeping the last good policy; restart nodeagent to apply these",
            )
            said = (
                f"{path}: {', '.join(changed)} {'is' if len(changed) == 1 else 'are'} read only"
                " at start: nothing of the file is applied; restart nodeagent to apply it"
                " (systemctl restart nodeagent)"
            )
            return Reload(path, False, time.time(), (said,))
        if spec.agent.runtimes != self.rec.spec.agent.runtimes:
            self.rec.runtimes.close()
            self.rec.runtimes = RuntimeMetadata.from_settings(spec.agent.runtimes)
        self.rec.reloaded(spec)
        log.info("policy.reloaded", file=path, rules=len(spec.rules))
        return Reload(path, True, time.time(), rules=len(spec.rules), tenants=len(spec.tenants))

    # --- the API -------------------------------------------------------------------------

    def routes(self) -> Routes:
        """The API's routes; reads answer on the API's threads from the view the loop last
        published (report.AgentView, and the GPU service's GpuView); whatever changes state
        is posted to the loop and runs on its thread, which publishes a new view after it."""
        gpus = GpuRoutes(self.rec.gpus, lambda: self.rec.spec, self.rec.fairness)
        routes: Routes = {
            **gpus.routes(),
            **agent_routes(self.rec, self.config_path, self),
        }
        return self.commands.serve(routes, then=self.rec.publish)

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
        # while the loop runs, `nodeagent release` is refused (nodeagent.running says why)
        mark = None if once or self.rec.dry_run else running.hold(self.rec.spec.agent.state_file)
        try:
            try:
                ok = self._loop(once, on_tick)
            finally:
                self.commands.unbind()
            return self._stopped(ok)
        finally:
            if mark is not None:
                os.close(mark)

    def _stopped(self, ok: bool) -> bool:
        """What a stop does after the loop: the last save is made before the mark goes."""
        if self._stop_signal is not None:
            log.info("stopping", signal=signal.Signals(self._stop_signal).name)
        sdnotify.stopping()
        if self.rec.kube is not None:
            self.rec.kube.close()
        if not self.rec.dry_run:
            self.save_state()
        return ok

    def _loop(self, once: bool, on_tick: Callable[[TickRecord], None] | None) -> bool:
        """`_ticks` with the watchdog's pinger beside it, when systemd expects pings."""
        watchdog_sec = sdnotify.watchdog_interval()
        pinger = None
        if watchdog_sec is not None and not once:
            pinger = sdnotify.Pinger(watchdog_sec, lambda: self.rec.spec.agent.interval)
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
        next_resync = time.monotonic() + self.rec.spec.agent.resync_interval
        ok = False
        while not self.stop.is_set():
            record = _guarded("tick.failed", self.tick)
            if record is None:  # what the failed tick did reap or start, the reads see
                self.rec.publish()
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
                    backend = self.rec.gpus.backend
                    log.info(  # the journal's line for "started and converged"
                        "agent.ready",
                        workloads=len(record.snapshot.workloads),
                        writes=sum(r.outcome is Outcome.WRITTEN for r in record.results),
                        tick_seconds=round(record.duration, 3),
                        gpus=len(backend.inventory()),
                        # why none (no driver, none given to the pod): said once, at start
                        **({} if backend.inventory() else {"no_gpus": backend.reason}),
                    )
                if pinger is not None:
                    pinger.beat()
            if once:
                break
            deadline = time.monotonic() + self.rec.spec.agent.interval
            while not self.stop.is_set():
                self.commands.run_pending()
                now = time.monotonic()
                if self._policy_file_changed() or self.reload_requested.is_set():
                    self.reload_requested.clear()
                    _guarded("policy.reload_failed", self.reload)
                if now >= next_resync:
                    _guarded("resync.failed", self.rec.registry.resync)
                    next_resync = now + self.rec.spec.agent.resync_interval
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    break
                wake = min(left, next_resync - now, self._lookups_wait())
                if _guarded("watch.failed", self._wait_for_cgroup_events, max(wake, 0.0)):
                    break
        return ok

    def _lookups_wait(self) -> float:
        """Seconds until newcomers left without their runtime's answer are due to be asked
        again; the ones due now are taken through the fast path first."""
        due = self.rec.lookups_due()
        if due is not None and due <= self.rec.runtimes.clock():
            _guarded("fastpath.failed", self.rec.retry_lookups)
            due = self.rec.lookups_due()
        return math.inf if due is None else max(0.0, due - self.rec.runtimes.clock())

    def _policy_file_changed(self) -> bool:
        """With `agent.reload_on_change`, whether the policy file is a new one since the
        last look (a ConfigMap's update swaps it in whole)."""
        watch = self.policy_file
        return self.rec.spec.agent.reload_on_change and watch is not None and watch.changed()

    def _wait_for_cgroup_events(self, timeout: float) -> bool:
        """Sleep until timeout, a wake-up (a signal, a stop from another thread), or until
        cgroups appear or go; a runtime's containers created meanwhile are asked about as they
        come. New workloads get their plan at once through the fast path;
        True only when events were lost (a resync), so that a full tick follows now."""
        fds = [self.wakeup.fileno()]
        inotify = self.rec.registry.fileno()
        if inotify is not None:
            fds.append(inotify)
        streams = _guarded("runtime.streams_failed", self.rec.runtimes.streams) or []
        readable, _, _ = select.select(fds + [s.fileno() for s in streams], [], [], timeout)
        if self.wakeup.fileno() in readable:
            self.wakeup.drain()  # the caller looks at the flags before it waits again
        for stream in streams:  # containers created: asked now, before their cgroups appear
            if stream.fileno() in readable:
                _guarded("runtime.created_failed", self.rec.runtimes.created, stream)
        if inotify is None or inotify not in readable:
            return False
        self.rec.registry.poll()
        new, self.rec.registry.new = self.rec.registry.new, []
        if new:
            _guarded("fastpath.failed", self.fast_path, new)
        resynced, self.rec.registry.resynced = self.rec.registry.resynced, False
        return resynced

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
RESTART_ONLY = (
    "agent.managed_root",
    "agent.socket",
    "agent.socket_group",
    "agent.metrics",
    "agent.mode",
    "gpu.simulate",
    "kubernetes.node_name",
    "kubernetes.pod_resources_socket",
    "kubernetes.pod_resources_timeout",
    "kubernetes.api_server",
    "publish.node_resource_topology",
)
"""What is used once, at start: the subtree made, the API and metrics sockets bound, the GPU
backend opened, the Kubernetes clients made (a NodeResourceTopology publisher needs the
API server's client, made only when it is on at start). A reload that changes any of these
would leave the daemon running on the old value while reporting the new one: it is refused
whole."""


def needs_restart(old: PolicySpec, new: PolicySpec) -> list[str]:
    """The fields of RESTART_ONLY that differ between `old` and `new`, by their dotted names."""
    return [f for f in RESTART_ONLY if _field(old, f) != _field(new, f)]


def _field(spec: PolicySpec, dotted: str) -> object:
    value: object = spec
    for name in dotted.split("."):
        value = getattr(value, name)
    return value


def _kubernetes(spec: PolicySpec) -> KubernetesNode | None:
    """The Kubernetes side in `agent.mode: kubernetes`; its libraries load only then."""
    if spec.agent.mode is not AgentMode.KUBERNETES:
        return None
    from nodeagent.kube.node import KubernetesNode  # noqa: PLC0415

    return KubernetesNode(spec)


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
    listen = agent.rec.spec.agent.metrics.listen
    if listen is None:
        return None
    # imported only when metrics are on: prometheus_client is slow to import on a cold disk
    from nodeagent.metrics.collector import TickCollector  # noqa: PLC0415
    from nodeagent.metrics.server import MetricsServer  # noqa: PLC0415

    collector = TickCollector(
        lambda: agent.rec.view.deadline_misses,
        reload=lambda: agent.last_reload,
        policy=lambda: agent.policy_sha256,
        interval=lambda: agent.rec.spec.agent.interval,
    )
    if agent.rec.gpus.backend.inventory():
        collector.watch_gpus(agent.rec.gpus.backend, lambda: agent.rec.gpus.view.ledger)
    settings = agent.rec.spec.agent.metrics
    server = MetricsServer.start(
        listen,
        collector,
        bearer_token_file=settings.bearer_token_file,
        socket_group=settings.socket_group,
        stale_after=lambda: stale_window(agent.rec.spec.agent.interval),
    )
    agent.observers.append(server.observe)  # the collector's, and /healthz's
    return server


def serve(agent: Agent) -> ApiServer:
    server = ApiServer(
        agent.rec.spec.agent.socket, agent.routes(), agent.rec.spec.agent.socket_group
    )
    server.start()
    return server
