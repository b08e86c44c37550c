"""Builds each tick's frozen NodeSnapshot from the kernel, turning counters into rates."""

from __future__ import annotations

import resource
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import NamedTuple, TypeVar

from nodeagent.cgroupfs.tree import CgroupTree, CgroupVanished, KeptDir
from nodeagent.cgroupfs.values import Attribute, Value
from nodeagent.errors import one_line
from nodeagent.identity import WorkloadIdentity
from nodeagent.sense.cgroup_files import (
    NO_NEEDS,
    LeanRead,
    Memo,
    Needs,
    read_lean,
    read_sample,
    weight_or_idle,
)
from nodeagent.sense.node import NodeSensor
from nodeagent.snapshot import CgroupSample, NodeSnapshot, Skipped, WorkloadState

T = TypeVar("T")


class _Counters(NamedTuple):
    at: float
    usage_us: int
    periods: int
    throttled: int
    stall_us: int | None


class Sensor:
    """Reads every known workload once per tick, reading what moves.

    A workload's files are all read when it is first seen, then in turn, a few
    workloads a tick so that each is read in full every `verify_every` seconds; every
    other tick reads its cpu.stat only, plus what a policy in use needs (`Needs`), and
    takes its settings from the last full read, updated with what the agent wrote
    (`learn`). So a tick costs little more than reading each workload's usage, and a
    change made by another writer is seen within `verify_every` seconds at most (and
    repaired at once). Directory fds are kept from tick to tick: a read is one openat.

    One cgroup never costs the others: a vanished cgroup is dropped and reported in
    `vanished`; one whose files cannot be read or parsed (whatever the error) is
    reported in `skipped` with the reason, and the rest are sensed as usual.

    Rates are measured over at least `min_window` seconds: a tick that inotify brings
    early would otherwise divide a counter that moves in scheduler ticks by a few
    milliseconds, and a busy cgroup could read as idle. Inside the window the last rate
    stands and the baseline is kept.
    """

    def __init__(
        self,
        tree: CgroupTree,
        node: NodeSensor,
        min_window: float = 0.0,
        verify_every: float = 30.0,
    ) -> None:
        self.tree = tree
        self.node = node
        self.min_window = min_window
        self.verify_every = verify_every
        self._seq = 0
        self._last_mono: float | None = None
        self._baseline: dict[str, _Counters] = {}
        self._rates: dict[str, _Rates] = {}
        self._known: dict[str, CgroupSample] = {}
        self._dirs: dict[str, KeptDir] = {}
        self._memo: Memo = {}
        """The settings files' texts full reads parsed, and their values (all workloads)."""
        self._memo_page_size = 0
        self._lean: dict[str, LeanRead] = {}
        """Each workload's last lean read: an idle one's next is the same sample again."""
        self._states: dict[str, WorkloadState] = {}
        """Last snapshot's workloads: one that reads the same again is the same object."""
        self._quiet: dict[str, _Calm] = {}
        """Per workload: reads in a row that found it unchanged, when it was last read,
        and what it read. A quiet one (nothing it needs read every tick) is read every
        QUIET_EVERY seconds instead of every tick, until it moves."""
        self._max_dirs = dir_budget()
        self._turn: deque[str] = deque()
        self._credit = 0.0
        self.fresh: frozenset[str] = frozenset()
        """The workloads whose settings the last snapshot read from the kernel, and the
        levels (read every tick)."""
        self._written: dict[str, dict[Attribute, Value]] = {}
        """What the agent last wrote to each cgroup (workloads and levels), to tell when a
        full read finds another writer's value there (`NodeSnapshot.overwritten`)."""
        self._overwritten: list[tuple[str, Attribute]] = []

    def learn(self, path: str, attribute: Attribute, value: Value) -> None:
        """What the agent just wrote, so the next lean read does not take it for drift,
        and the next full read can tell whether someone else changed it since."""
        self._written.setdefault(path, {})[attribute] = value
        known = self._known.get(path)
        if known is not None:
            self._known[path] = replace(known, settings={**known.settings, attribute: value})

    def close(self) -> None:
        for d in self._dirs.values():
            d.close()
        self._dirs.clear()

    def _dir(self, path: str) -> KeptDir:
        d = self._dirs.get(path)
        if d is None:
            if len(self._dirs) >= self._max_dirs:
                raise _NoRoom
            d = self._dirs[path] = KeptDir(path, self.tree.open_fd(path))
        return d

    def _drop(self, path: str) -> None:
        d = self._dirs.pop(path, None)
        if d is not None:
            d.close()
        self._known.pop(path, None)
        self._lean.pop(path, None)
        self._quiet.pop(path, None)

    def _due(self, paths: list[str], elapsed: float | None, full: bool) -> set[str]:
        """The workloads to read in full this tick: new ones, and the next in turn."""
        if full:
            return set(paths)
        due = {p for p in paths if p not in self._known}
        if elapsed and self.verify_every > 0:
            self._credit += len(paths) * min(elapsed, self.verify_every) / self.verify_every
        live = set(paths)
        self._turn = deque(p for p in self._turn if p in live)
        queued = set(self._turn)
        self._turn.extend(p for p in paths if p not in queued)
        while self._credit >= 1 and self._turn:
            p = self._turn.popleft()
            self._turn.append(p)
            due.add(p)
            self._credit -= 1
        return due

    def snapshot(
        self,
        workloads: Iterable[WorkloadIdentity],
        wall_time: float,
        monotonic: float,
        *,
        needs: Mapping[str, Needs] | None = None,
        levels: Iterable[WorkloadIdentity] = (),
        full: bool = False,
    ) -> NodeSnapshot:
        """`needs`: what a lean read adds for each workload; `levels`: parents of
        workloads, of which only cpu.weight is read (one that cannot be read is left out:
        the hierarchy stops below it); `full`: read every file of every workload."""
        elapsed = None if self._last_mono is None else monotonic - self._last_mono
        node = self.node.read()
        identities = list(workloads)
        due = self._due([i.path for i in identities], elapsed, full)
        needs = needs or {}
        states = []
        skipped: list[Skipped] = []
        vanished: list[str] = []
        baseline: dict[str, _Counters] = {}
        rates: dict[str, _Rates] = {}
        read: set[str] = set()
        last_states, new_states = self._states, {}
        last_baseline, last_rates, min_window = self._baseline, self._rates, self.min_window
        page_size = node.page_size
        for identity in identities:
            path = identity.path
            last = last_states.get(path)
            if last is not None and self._is_quiet(path, monotonic, due, needs):
                # its usage has not moved for a while: the last reading stands
                read.add(path)
                _carried(path, last_baseline, baseline)
                _carried(path, last_rates, rates)
                states.append(last)
                new_states[path] = last
                continue
            try:
                sample = self._read(path, path in due, needs.get(path, NO_NEEDS), page_size)
            except CgroupVanished:
                vanished.append(path)
                self._drop(path)
                continue
            except Exception as e:  # unreadable, unparsable, unexpected: skip this one only
                skipped.append(Skipped(identity, "sense", one_line(e)))
                self._drop(path)
                if path in last_baseline:  # measure from it when the cgroup recovers
                    baseline[path] = last_baseline[path]
                continue
            read.add(path)
            self._note_read(path, sample, path in needs, monotonic)
            _measure(path, _counters(sample, monotonic), min_window=min_window,
                     baseline=baseline, rates=rates, last_baseline=last_baseline,
                     last_rates=last_rates)  # fmt: skip
            state = _state(last_states.get(path), identity, sample, rates.get(path))
            states.append(state)
            new_states[path] = state
        for gone in [p for p in self._dirs if p not in read]:
            self._drop(gone)  # no longer sensed: a workload that went, or one no rule claims
        self._baseline, self._rates, self._states = baseline, rates, new_states
        self._last_mono = monotonic
        self._seq += 1
        parents = self._levels(levels, skipped)
        overwritten = self._overwrites(read, parents)
        self.fresh = frozenset(due | {w.path for w in parents})
        return NodeSnapshot(
            self._seq,
            wall_time,
            elapsed,
            node,
            tuple(states),
            tuple(skipped),
            tuple(vanished),
            parents,
            overwritten=overwritten,
            local_seconds=_local_seconds(wall_time),
        )

    def _overwrites(
        self, read: set[str], parents: tuple[WorkloadState, ...]
    ) -> tuple[tuple[str, Attribute], ...]:
        """This snapshot's overwritten values, the levels' (read every tick) included;
        what was written to cgroups no longer sensed is forgotten."""
        for w in parents:
            self._found(w.path, w.sample.settings)
        sensed = read | {w.path for w in parents}
        self._written = {p: v for p, v in self._written.items() if p in sensed}
        found, self._overwritten = tuple(self._overwritten), []
        return found

    def _found(self, path: str, settings: Mapping[Attribute, Value]) -> None:
        """A read from the kernel: each value the agent wrote and finds changed is noted
        once (it is written again, and learnt again, if the plan still wants it)."""
        written = self._written.get(path)
        if not written:
            return
        for attribute, value in list(written.items()):
            if attribute in settings and settings[attribute] != value:
                self._overwritten.append((path, attribute))
                del written[attribute]

    def _note_read(self, path: str, sample: CgroupSample, needed: bool, monotonic: float) -> None:
        """Count the reads in a row that found `path` unchanged, and when it was read. A
        read finds it unchanged when it stands on the same full read (a full read that
        finds what the last one found keeps it) with the same cpu.stat counters; one that
        read more than cpu.stat for a need never does."""
        known = self._known.get(path)
        read = None if known is None or needed else (known, _usage(sample))
        calm = self._quiet.get(path)
        same = (
            read is not None
            and calm is not None
            and calm.read is not None
            and calm.read[0] is known
            and calm.read[1] == read[1]
        )
        self._quiet[path] = _Calm(calm.reads + 1 if same and calm else 0, monotonic, read)

    def _is_quiet(
        self, path: str, monotonic: float, due: set[str], needs: Mapping[str, Needs]
    ) -> bool:
        """Read unchanged QUIET_READS times in a row and last read under QUIET_EVERY
        seconds ago, not due for its full read, and nothing of it needed every tick."""
        calm = self._quiet.get(path)
        return (
            calm is not None
            and calm.reads >= QUIET_READS
            and monotonic - calm.at < QUIET_EVERY
            and path not in due
            and path not in needs
        )

    def _read(self, path: str, full: bool, needs: Needs, page_size: int) -> CgroupSample:
        try:
            d = self._dir(path)
        except _NoRoom:  # more workloads than fds kept: open this one for this read only
            with self.tree.open(path) as once:
                return read_sample(once, page_size, threads=needs.threads)
        known = self._known.get(path)
        if full or known is None:
            if page_size != self._memo_page_size:  # the memory limits are parsed in pages
                self._memo, self._memo_page_size = {}, page_size
            sample = read_sample(d, page_size, threads=needs.threads, memo=self._memo)
            if sample == known:  # what stands on the last full read stands on this one
                sample = known
            self._known[path] = sample
            self._found(path, sample.settings)
            return sample
        lean = self._lean[path] = read_lean(d, known, needs, self._lean.get(path))
        return lean.sample

    def _levels(
        self, levels: Iterable[WorkloadIdentity], skipped: list[Skipped]
    ) -> tuple[WorkloadState, ...]:
        out = []
        for identity in levels:
            try:
                with self.tree.open(identity.path) as d:
                    text = d.read_optional(Attribute.CPU_WEIGHT)
                    weight = None if text is None else weight_or_idle(text)
            except CgroupVanished:
                continue
            except Exception as e:  # unreadable: not weighted this tick, said once
                skipped.append(Skipped(identity, "sense", one_line(e)))
                continue
            settings = {} if weight is None else {Attribute.CPU_WEIGHT: weight}
            idle = text is not None and weight is None
            out.append(WorkloadState(identity, CgroupSample(settings=settings, cpu_idle=idle)))
        return tuple(out)


def _carried(path: str, last: Mapping[str, T], now: dict[str, T]) -> None:
    """`path`'s entry of the last tick's map into this tick's, if it had one."""
    value = last.get(path)
    if value is not None:
        now[path] = value


def _measure(
    path: str,
    now: _Counters | None,
    *,
    min_window: float,
    baseline: dict[str, _Counters],
    rates: dict[str, _Rates],
    last_baseline: Mapping[str, _Counters],
    last_rates: Mapping[str, _Rates],
) -> None:
    """A workload's new baseline and rates from its counters now, into `baseline` and
    `rates`: inside `min_window` of the last baseline, that one and its rates stand."""
    if now is None:
        return
    prev = last_baseline.get(path)
    baseline[path] = now
    if prev is not None and now.at - prev.at < min_window:
        baseline[path] = prev  # too soon: keep measuring from the old baseline
        if path in last_rates:
            rates[path] = last_rates[path]
    elif prev is not None and now.at > prev.at:
        rates[path] = _rates(prev, now)


MAX_OPEN_DIRS = 4096
"""Directory fds kept open across ticks at most; workloads past this are opened per read."""
QUIET_READS = 3
"""Reads in a row with the same cpu.stat after which a workload counts as quiet."""
QUIET_EVERY = 5.0
"""Seconds between reads of a quiet workload: one that wakes is seen within this."""


FDS_PER_DIR = 2
"""A kept workload directory holds two descriptors: itself and its cpu.stat."""


def dir_budget() -> int:
    """How many workload directories the sensor keeps open: as many as half the soft
    RLIMIT_NOFILE holds (at most MAX_OPEN_DIRS), so that the API, writes and logs always
    have descriptors left. The others are opened for each read."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_DIRS
    return max(0, min(MAX_OPEN_DIRS, soft // 2 // FDS_PER_DIR))


def raise_fd_limit(want: int = 2 * FDS_PER_DIR * MAX_OPEN_DIRS) -> int:
    """Raise the soft RLIMIT_NOFILE towards `want`, within the hard limit, as systemd
    advises programs that need many descriptors (its soft default is 1024; the unit sets
    LimitNOFILE=8192). Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


class _NoRoom(Exception):
    pass


class _Calm(NamedTuple):
    reads: int
    """Reads in a row that found the workload unchanged."""
    at: float
    read: tuple[CgroupSample, tuple[int | None, ...]] | None
    """The full read the last read stood on and its cpu.stat counters (None: it read
    more than cpu.stat, or was not kept)."""


class _Rates(NamedTuple):
    cpu: float
    throttled: float
    stall: float | None


def _rates(prev: _Counters, now: _Counters) -> _Rates:
    if (
        now.usage_us == prev.usage_us
        and now.periods == prev.periods
        and now.throttled == prev.throttled
        and now.stall_us == prev.stall_us
    ):  # an idle workload: what the arithmetic below gives, without it
        return _IDLE if now.stall_us is None else _IDLE_STALL
    seconds = now.at - prev.at
    periods = now.periods - prev.periods
    stall = None
    if now.stall_us is not None and prev.stall_us is not None:
        stall = min(1.0, max(0, now.stall_us - prev.stall_us) / 1e6 / seconds)
    return _Rates(
        max(0, now.usage_us - prev.usage_us) / 1e6 / seconds,
        (now.throttled - prev.throttled) / periods if periods > 0 else 0.0,
        stall,
    )


_IDLE = _Rates(0.0, 0.0, None)
_IDLE_STALL = _Rates(0.0, 0.0, 0.0)


def _state(
    last: WorkloadState | None, identity: WorkloadIdentity, sample: CgroupSample, r: _Rates | None
) -> WorkloadState:
    """The workload's state; the last one again when nothing in it changed."""
    cpu, throttled, stall = (None, None, None) if r is None else r
    if (
        last is None
        or last.sample is not sample
        or last.identity is not identity
        or last.cpu_rate != cpu
        or last.throttled_fraction != throttled
        or last.cpu_stall != stall
    ):
        return WorkloadState(identity, sample, cpu, throttled, stall)
    return last


def _usage(s: CgroupSample) -> tuple[int | None, ...]:
    """A sample's cpu.stat counters."""
    return (s.cpu_usage_us, s.cpu_nr_periods, s.cpu_nr_throttled, s.cpu_throttled_us)


def _counters(sample: CgroupSample, at: float) -> _Counters | None:
    if sample.cpu_usage_us is None:
        return None
    return _Counters(
        at,
        sample.cpu_usage_us,
        sample.cpu_nr_periods or 0,
        sample.cpu_nr_throttled or 0,
        None if sample.cpu_psi is None else sample.cpu_psi.some.total_us,
    )


def _local_seconds(wall: float) -> float:
    """Seconds since local midnight, for the policies' daily windows."""
    t = time.localtime(wall)
    return t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec + wall % 1
