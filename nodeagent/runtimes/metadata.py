"""The sensing side of runtime metadata: ask, cache, follow events, freeze into identities.

Each tick (and the fast path, for a new cgroup) hands the discovered identities to `attach`,
which returns them with `meta` (what the runtime said) or `meta_problem` (why it said nothing).
An identity whose answer has not changed is the same object as last time, so the daemon's
"did anything change" checks stay cheap.

- Answers are cached by runtime and container id (pods by UID) until the cgroup goes; a rename
  seen in the runtime's events (polled at most once a second, answering at once) asks again.
- A runtime that does not answer about a container but answers its ping is not down: it holds
  that container (dockerd its inspect, podman the whole container, while starting it), and the
  container alone is asked again LATE_S later, twice as late each time up to RETRY_S, not said
  in the log (podman holds each container it starts for 350 to 700 ms in the VM: issue 16).
- A runtime that does not answer (no socket, refused, timed out, reset mid-answer) is down: said
  once in the log, asked again every RETRY_S seconds, and meanwhile its new containers keep
  their path identity only. What it said before stays (a running container's labels do not
  change). When it answers again that is said once too, and everything it said is asked again,
  since its events were missed.
- An answer outside the bounds of `model` (10,000 labels, a 1 MiB value, invalid UTF-8) is
  refused for that container alone, said once, and not asked again while the container lives.
- A runtime that does not know a container yet (the cgroup is made before the runtime's own
  bookkeeping is done) is asked again on the next tick, up to UNKNOWN_TRIES times.
- All lookups of one `attach` share a budget of LOOKUP_BUDGET_S seconds: what is left over waits
  for the next tick, so a thousand new containers cannot stall one.
- A container below a user's manager (user.slice/user-N.slice/user@N.service/...) is user N's
  to make, its cgroup's name and so its id included (ids are world-readable in /proc/*/cgroup):
  it is asked of user N's own podman (`USER_PODMAN`) where `podman_per_user` says so, else of
  nothing, and never of root's runtimes or podman's store (issue 34).
- A runtime that streams the containers it creates (dockerd's `create` events) is followed by
  the loop (`streams`, `created`): each new container is known at its creation, before its
  start makes its cgroup, so the cgroup's fast path finds the answer there (issue 16: dockerd's
  answer during a start is what the fast path waited for). dockerd's event carries the name,
  image and labels: kept as the answer, and asked once more by the next tick (not the fast
  path), since the event hides labels named `image` or `name`; an event that says too little is
  asked about at once, while the runtime holds nothing. What was had so is kept
  PREFETCH_KEEP_S seconds for its cgroup to appear. A stream that breaks is opened again
  RETRY_S later; without one, lookups are as above.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import structlog

from nodeagent.discovery.layouts import delegated_uid
from nodeagent.errors import one_line
from nodeagent.identity import Kind, Runtime, WorkloadIdentity
from nodeagent.meta import BadAnswer, ContainerMeta, Unavailable
from nodeagent.policyfile.model import RuntimeSettings
from nodeagent.reach import Reachability
from nodeagent.runtimes.base import Adapter, Creations

log = structlog.get_logger("nodeagent.runtimes")

RETRY_S = 5.0
LATE_S = 0.25
EVENTS_EVERY_S = 1.0
PROBE_S = 10.0
"""How often a runtime without events (CRI: its metadata never changes) is asked whether
it answers, while the agent knows containers of its: so that a containerd restarted under
pods that go on shows as down and back (nodeagent_peer_up), not up on its last answer."""
LOOKUP_BUDGET_S = 1.0
UNKNOWN_TRIES = 10
PREFETCH_KEEP_S = 60.0
_CRI = ("containerd", "crio")
USER_PODMAN = "/run/user/{uid}/podman/podman.sock"
"""Where user N's rootless podman serves its API (`podman system service`, systemd --user's
podman.socket)."""


def adapters(settings: RuntimeSettings) -> dict[str, Adapter]:
    """One adapter per runtime whose socket is set."""
    from nodeagent.runtimes.cri import CriAdapter  # noqa: PLC0415
    from nodeagent.runtimes.docker import DockerAdapter  # noqa: PLC0415
    from nodeagent.runtimes.podman import PodmanAdapter  # noqa: PLC0415

    out: dict[str, Adapter] = {}
    t = settings.timeout
    if settings.docker is not None:
        out["docker"] = DockerAdapter(settings.docker, t)
    if settings.podman is not None:
        out["podman"] = PodmanAdapter(settings.podman, t, settings.podman_storage)
    for runtime in _CRI:
        socket = getattr(settings, runtime)
        if socket is not None:
            out[runtime] = CriAdapter(runtime, socket, t)
    return out


def _user_podman(uid: int, timeout: float) -> Adapter:
    """User `uid`'s podman: its API socket only, never a store on disk (a user's store is the
    user's own file to write, and the API answers with labels besides)."""
    from nodeagent.runtimes.podman import PodmanAdapter  # noqa: PLC0415

    return PodmanAdapter(USER_PODMAN.format(uid=uid), timeout, None)


@dataclass(frozen=True, slots=True)
class _Entry:
    meta: ContainerMeta | None
    problem: str | None
    ask_at: float | None = None
    """When to ask again (None: never, while the cgroup lives)."""
    tries: int = 1
    late: int | None = None
    """Lookups in a row that the runtime, answering otherwise, did not answer in time."""
    prefetched: float | None = None
    """When it was had at the container's creation, before its cgroup appeared."""
    confirm: bool = False
    """Told by the runtime's create event: to be asked once more, by a tick (not the fast
    path), since the event may hide what the answer would show."""


def _fresh(entry: _Entry, now: float) -> bool:
    """Asked at the container's creation, recently enough to stand for its cgroup's lookup."""
    return entry.prefetched is not None and now - entry.prefetched < PREFETCH_KEEP_S


@dataclass(slots=True)
class _Down:
    reason: str
    since: float
    retry_at: float


_BY_RUNTIME: Mapping[Runtime, str] = {
    Runtime.DOCKER: "docker",
    Runtime.PODMAN: "podman",
    Runtime.CONTAINERD: "containerd",
    Runtime.CRIO: "crio",
}


class RuntimeMetadata:
    def __init__(
        self,
        by_name: Mapping[str, Adapter],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        budget: float = LOOKUP_BUDGET_S,
        say: bool = True,
    ) -> None:
        self.adapters = dict(by_name)
        self.clock, self.wall = clock, wall
        self.budget = budget
        self.say = say
        """Log the runtimes' state changes (the daemon); a CLI shows them per row instead."""
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._down: dict[str, _Down] = {}
        self._events: dict[str, tuple[float, float]] = {}
        """Per runtime: the wall time its events were read up to, and when (monotonic)."""
        self._probed: dict[str, float] = {}
        """Per runtime without events: when it was last asked whether it answers."""
        self._attached: dict[str, tuple[WorkloadIdentity, WorkloadIdentity]] = {}
        """Per workload: the identity last given, and what `attach` made of it."""
        self._refused: set[tuple[str, str]] = set()
        self._streams: dict[str, Creations] = {}
        self._stream_at: dict[str, float] = {}
        """Per runtime without a stream: when to try to open one (inf: it has none)."""
        self.lookups = 0
        """Calls made to runtimes (for the tests and the benchmark)."""
        self.prefetched = 0
        """Containers known at their creation (for the tests and the benchmark)."""
        self.told = 0
        """Of those, the ones the creation's event described, asked nothing."""
        self.user_podman: Callable[[int], Adapter] | None = None
        """User N's own podman, for the containers below user@N.service (None: not asked)."""
        self.reach = Reachability(wall)
        """How each runtime's last exchange went (the metrics and /v1/status)."""

    @classmethod
    def from_settings(cls, settings: RuntimeSettings, **options: Any) -> RuntimeMetadata:
        made = cls(adapters(settings), **options)
        if settings.podman_per_user:
            made.user_podman = functools.partial(_user_podman, timeout=settings.timeout)
        return made

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        for a in self.adapters.values():
            a.close()

    # -- who answers for whom ----------------------------------------------------------------

    def _adapter(self, identity: WorkloadIdentity) -> tuple[str, str] | None:
        """(runtime, what to ask it for), or None for what no runtime knows (services, jobs)
        or no runtime may say (a user's containers, without `user_podman`)."""
        if identity.kind is not Kind.CONTAINER and identity.kind is not Kind.POD:
            return None  # a service, a job, a slice: no runtime's, wherever it is
        uid = delegated_uid(identity.path)
        if uid is not None:
            return self._users(uid, identity)
        if identity.kind is Kind.CONTAINER and identity.container_id is not None:
            runtime = _BY_RUNTIME.get(identity.runtime)
            return None if runtime is None else (runtime, identity.container_id)
        if identity.kind is Kind.POD and identity.pod_uid is not None:
            for runtime in _CRI:  # the pod's own cgroup: whichever CRI runtime this node has
                a = self.adapters.get(runtime)
                if a is not None and os.path.exists(a.socket):
                    return runtime, "pod:" + identity.pod_uid
            return "containerd", "pod:" + identity.pod_uid
        return None

    def _users(self, uid: int, identity: WorkloadIdentity) -> tuple[str, str] | None:
        """User `uid`'s own podman for its podman container: the one runtime that owns that
        subtree. Its own adapter, made at the first such container, so that its answers,
        its being down and its events are its own, never root's podman's."""
        if (
            self.user_podman is None
            or identity.kind is not Kind.CONTAINER
            or identity.runtime is not Runtime.PODMAN
            or identity.container_id is None
        ):
            return None
        runtime = f"podman@{uid}"
        if runtime not in self.adapters:
            self.adapters[runtime] = self.user_podman(uid)
        return runtime, identity.container_id

    def _not_asked(self, identity: WorkloadIdentity) -> WorkloadIdentity:
        """A workload no runtime was asked about: as it came, but a user's container says why
        it has no name (once the same object each tick, as `_identity` keeps it)."""
        if identity.kind is not Kind.CONTAINER:
            return identity
        uid = delegated_uid(identity.path)
        if uid is None:
            return identity
        mine = (
            "agent.runtimes.podman_per_user is off"
            if self.user_podman is None
            else "only its podman containers are asked of its own podman"
        )
        why = (
            f"a container of user {uid} (below user@{uid}.service): root's runtimes are not"
            f" asked about it, and {mine}; rules that need metadata skip it"
        )
        return self._identity(identity, _Entry(None, why))

    def status(self) -> dict[str, dict[str, object]]:
        """Each runtime's state, for `workloads --json` and the API."""
        out: dict[str, dict[str, object]] = {}
        for runtime, a in self.adapters.items():
            down = self._down.get(runtime)
            out[runtime] = {
                "socket": a.socket,
                "answering": down is None,
                "problem": None if down is None else down.reason,
            }
        return out

    # -- the work ----------------------------------------------------------------------------

    def attach(
        self, identities: Iterable[WorkloadIdentity], complete: bool = True, new: bool = False
    ) -> list[WorkloadIdentity]:
        """The identities with what their runtimes say. `complete`: these are all the node's
        workloads, so the cache forgets the others. `new`: cgroups discovery has just seen
        appear (the fast path), asked about again even when known (a container restarted
        under the same id)."""
        now = self.clock()
        budget_end = now + self.budget
        self._follow_events(now)
        out: list[WorkloadIdentity] = []
        live: set[tuple[str, str]] = set()
        for identity in identities:
            if identity.kind is not Kind.CONTAINER and identity.kind is not Kind.POD:
                out.append(identity)  # a service, a job, a slice: no runtime's, as it came
                continue
            target = self._adapter(identity)
            if target is None:
                out.append(self._not_asked(identity))
                continue
            live.add(target)
            entry = self._entries.get(target)
            stale = (
                new and entry is not None and target not in self._refused and not _fresh(entry, now)
            )
            confirm = complete and not new and entry is not None and entry.confirm
            if (
                entry is None
                or stale
                or confirm
                or (entry.ask_at is not None and now >= entry.ask_at)
            ):
                entry = self._ask(target, entry, budget_end)
            out.append(self._identity(identity, entry))
        if complete:  # a container asked at its creation may not have its cgroup yet
            for key, entry in list(self._entries.items()):
                if key not in live and not _fresh(entry, now):
                    del self._entries[key]
            self._refused &= live
            paths = {i.path for i in out}
            for path in [p for p in self._attached if p not in paths]:
                del self._attached[path]
        return out

    def streams(self) -> list[Creations]:
        """The runtimes' streams of creations, for the loop to wait on; one is opened where
        it is due (each open costs at most one deadline, at most every RETRY_S a runtime)."""
        now = self.clock()
        for runtime, adapter in self.adapters.items():
            if runtime in self._streams or runtime in self._down:
                continue
            if now < self._stream_at.get(runtime, -math.inf):
                continue
            try:
                stream = adapter.creations()
            except (Unavailable, BadAnswer) as e:
                self._stream_at[runtime] = now + RETRY_S  # no socket is a host without it
                log.debug("runtime.events_unopened", runtime=runtime, reason=one_line(e))
                if isinstance(e, Unavailable) and (
                    self.reach.known(runtime) or os.path.exists(adapter.socket)
                ):  # a runtime this node never had is not listed as down
                    self.reach.failed(runtime, adapter.socket, one_line(e))
                continue
            if stream is None:  # none to follow (CRI): nothing was asked
                self._stream_at[runtime] = math.inf
            else:
                self.reach.ok(runtime, adapter.socket)
                self._streams[runtime] = stream
        return list(self._streams.values())

    def created(self, stream: Creations) -> None:
        """Keep what `stream` says of the containers created, and ask at once about those it
        says too little of (within one budget; what it leaves is asked when its cgroup
        appears, as without a stream)."""
        runtime = next((r for r, s in self._streams.items() if s is stream), None)
        if runtime is None:
            return  # closed since the loop took it (the runtimes were reloaded)
        now = self.clock()
        try:
            said = stream.created()
        except (Unavailable, BadAnswer) as e:
            log.debug("runtime.events_broken", runtime=runtime, reason=one_line(e))
            said, broken = {}, True
            if isinstance(e, Unavailable):
                self.reach.failed(runtime, self.adapters[runtime].socket, one_line(e))
        else:
            broken = stream.ended
        budget_end = now + self.budget
        for cid, meta in sorted(said.items()):
            target = (runtime, cid)
            if target in self._entries:
                continue
            if meta is not None:
                self._keep(target, _Entry(meta, None, prefetched=now, confirm=True))
                self.prefetched += 1
                self.told += 1
                continue
            if self.clock() >= budget_end:
                continue
            entry = self._ask(target, None, budget_end)
            if entry.meta is not None:
                self._keep(target, replace(entry, prefetched=now))
                self.prefetched += 1
        if broken:
            stream.close()
            del self._streams[runtime]
            self._stream_at[runtime] = self.clock() + RETRY_S

    def retry_at(self, identity: WorkloadIdentity) -> float | None:
        """When (on `clock`) a lookup this identity still lacks can be made again: its
        runtime's retry when the runtime did not answer, now when the lookups' budget ran out,
        the next try when the runtime did not know it yet. None: it has its answer, or none
        will come (refused, lookups off, not a runtime's, the runtime never knew it)."""
        if identity.meta is not None:
            return None
        target = self._adapter(identity)
        if target is None or target[0] not in self.adapters or target in self._refused:
            return None
        down = self._down.get(target[0])
        if down is not None:
            return down.retry_at
        entry = self._entries.get(target)
        return self.clock() if entry is None else entry.ask_at

    def _identity(self, identity: WorkloadIdentity, entry: _Entry) -> WorkloadIdentity:
        """The identity with the entry's answer: last time's object when nothing changed
        (the same identity given, most often the very object discovery keeps, and the same
        answer), made anew otherwise. Asked of every claimed workload every tick: no copy is
        made to find that nothing changed."""
        last = self._attached.get(identity.path)
        if last is not None:
            given, made = last
            if (
                (given is identity or given == identity)
                and made.meta == entry.meta
                and made.meta_problem == entry.problem
            ):
                return made
        made = replace(identity, meta=entry.meta, meta_problem=entry.problem)
        self._attached[identity.path] = (identity, made)
        return made

    def _ask(self, target: tuple[str, str], old: _Entry | None, budget_end: float) -> _Entry:
        runtime, key = target
        now = self.clock()
        adapter = self.adapters.get(runtime)
        if adapter is None:
            return self._keep(
                target, _Entry(None, f"{runtime} lookups are off (agent.runtimes.{runtime})")
            )
        down = self._down.get(runtime)
        if down is not None and now < down.retry_at:
            return old if old is not None and old.meta is not None else _Entry(None, down.reason)
        if now >= budget_end:
            if old is not None:
                return old
            return _Entry(None, "not asked yet (too many new containers this tick)", ask_at=now)
        try:
            self.lookups += 1
            pod = key.startswith("pod:")
            meta = adapter.pod(key[4:]) if pod else adapter.container(key)
        except Unavailable as e:
            if self._answers(adapter):
                return self._late(target, old, one_line(e), self.clock())
            self._went_down(runtime, adapter, one_line(e), now)
            reason = self._down[runtime].reason
            if old is not None and old.meta is not None:
                return self._keep(target, replace(old, ask_at=self._down[runtime].retry_at))
            return _Entry(None, reason)
        except BadAnswer as e:
            return self._refuse(target, adapter, one_line(e))
        except Exception as e:  # an adapter's bug must not cost the tick: this container only
            return self._refuse(target, adapter, f"{type(e).__name__}: {e}")
        self._came_back(runtime, adapter, now)
        if meta is None:
            tries = 1 if old is None or old.meta is not None else old.tries + 1
            if tries >= UNKNOWN_TRIES:
                return self._keep(target, _Entry(None, f"{runtime} does not know it", None, tries))
            what = f"{runtime} does not know it (yet)"
            return self._keep(target, _Entry(None, what, now + 1.0, tries))
        ask_at = now + RETRY_S if meta.incomplete is not None else None
        return self._keep(target, _Entry(meta, None, ask_at))

    def _answers(self, adapter: Adapter) -> bool:
        """Whether the runtime answers at all, when it did not about one container."""
        try:
            self.lookups += 1
            adapter.ping()
        except Unavailable:
            return False
        return True

    def _late(self, target: tuple[str, str], old: _Entry | None, reason: str, now: float) -> _Entry:
        """A container its runtime holds (starting it): asked again soon, alone."""
        tries = 1 if old is None or old.late is None else old.late + 1
        wait = min(LATE_S * 2 ** (tries - 1), RETRY_S)
        if old is not None and old.meta is not None:
            return self._keep(target, replace(old, ask_at=now + wait, late=tries))
        problem = (
            f"{target[0]} did not answer about it ({reason}) but answers otherwise (it may be"
            f" starting it); asking again in {wait:g} s"
        )
        return self._keep(target, _Entry(None, problem, now + wait, late=tries))

    def _keep(self, target: tuple[str, str], entry: _Entry) -> _Entry:
        self._entries[target] = entry
        return entry

    def _refuse(self, target: tuple[str, str], adapter: Adapter, reason: str) -> _Entry:
        runtime, key = target
        problem = f"{runtime}'s answer was refused: {reason}"
        if target not in self._refused:
            self._refused.add(target)
            if self.say:
                log.warning(
                    "runtime.answer_refused",
                    runtime=runtime,
                    socket=adapter.socket,
                    container=key[:64],
                    reason=reason,
                    action="it keeps its path identity; rules that need metadata skip it",
                )
        return self._keep(target, _Entry(None, problem))

    def _probe(self, runtime: str, adapter: Adapter, now: float) -> None:
        """Ask `runtime` whether it answers (one deadline at most), as a lookup would."""
        self._probed[runtime] = now
        try:
            self.lookups += 1
            adapter.ping()
        except Unavailable as e:
            self._went_down(runtime, adapter, one_line(e), now)
        else:
            self._came_back(runtime, adapter, now)

    def _went_down(self, runtime: str, adapter: Adapter, reason: str, now: float) -> None:
        self.reach.failed(runtime, adapter.socket, reason)
        down = self._down.get(runtime)
        text = f"{runtime} does not answer: {reason}"
        if down is None:
            if self.say:
                log.warning(
                    "runtime.unavailable",
                    runtime=runtime,
                    socket=adapter.socket,
                    error=reason,
                    action=(
                        "its containers keep their path identity and what it said before; rules"
                        f" that need metadata skip its new ones; asking again every {RETRY_S:g} s"
                    ),
                )
            self._down[runtime] = _Down(text, now, now + RETRY_S)
        else:
            down.reason, down.retry_at = text, now + RETRY_S

    def _came_back(self, runtime: str, adapter: Adapter, now: float) -> None:
        """`runtime` answered (at every answer: most find it up)."""
        self.reach.ok(runtime, adapter.socket)
        down = self._down.pop(runtime, None)
        if down is None:
            return
        if self.say:
            log.info(
                "runtime.available",
                runtime=runtime,
                socket=adapter.socket,
                after_s=round(now - down.since, 1),
                action="asking it again about each of its containers (its events were missed)",
            )
        self._events.pop(runtime, None)
        for key, entry in list(self._entries.items()):
            if key[0] == runtime and key not in self._refused:
                self._entries[key] = replace(entry, ask_at=now)

    def _follow_events(self, now: float) -> None:
        """Ask again about the containers the runtimes' events say changed (renames); ask a
        runtime that is down about one of its containers once its retry is due, so that it
        is found back even when nothing new needs it; and ask one without events whether it
        answers every PROBE_S, so that it is found down when nothing new needs it either."""
        for runtime, adapter in self.adapters.items():
            known = [k for k, e in self._entries.items() if k[0] == runtime and e.meta]
            if not known:
                continue
            down = self._down.get(runtime)
            if down is not None:
                if now >= down.retry_at:
                    self._ask(known[0], self._entries[known[0]], now + self.budget)
                continue
            cursor = self._events.get(runtime)
            wall = self.wall()
            if cursor is None:
                self._events[runtime] = (wall, now)
                continue
            if now - cursor[1] < EVENTS_EVERY_S:
                continue
            try:
                self.lookups += 1
                changed = adapter.changed(cursor[0], wall)
            except Unavailable as e:
                self._went_down(runtime, adapter, one_line(e), now)
                continue
            except BadAnswer:  # unreadable events: the next poll covers the same window
                self._events[runtime] = (cursor[0], now)
                continue
            if changed is not None:
                self.reach.ok(runtime, adapter.socket)
            elif now - self._probed.get(runtime, -math.inf) >= PROBE_S:
                self._probe(runtime, adapter, now)
            self._events[runtime] = (wall, now)
            for cid in changed or ():
                entry = self._entries.get((runtime, cid))
                if entry is not None and (runtime, cid) not in self._refused:
                    self._entries[(runtime, cid)] = replace(entry, ask_at=now)
