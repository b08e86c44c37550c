"""Builds each tick's frozen NodeSnapshot from the kernel, turning counters into rates."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from nodeagent.cgroupfs import parse
from nodeagent.cgroupfs.tree import CgroupTree, CgroupVanished
from nodeagent.cgroupfs.values import Attribute, CpuWeight
from nodeagent.errors import one_line
from nodeagent.identity import WorkloadIdentity
from nodeagent.sense.cgroup_files import read_sample
from nodeagent.sense.node import NodeSensor
from nodeagent.snapshot import CgroupSample, NodeSnapshot, Skipped, WorkloadState


@dataclass(frozen=True, slots=True)
class _Counters:
    at: float
    usage_us: int
    periods: int
    throttled: int
    stall_us: int | None


class Sensor:
    """Reads every known workload once per tick.

    One cgroup never costs the others: a vanished cgroup is dropped and reported in
    `vanished`; one whose files cannot be read or parsed (whatever the error) is
    reported in `skipped` with the reason, and the rest are sensed as usual.

    Rates are measured over at least `min_window` seconds: a tick that inotify brings
    early would otherwise divide a counter that moves in scheduler ticks by a few
    milliseconds, and a busy cgroup could read as idle. Inside the window the last rate
    stands and the baseline is kept.
    """

    def __init__(self, tree: CgroupTree, node: NodeSensor, min_window: float = 0.0) -> None:
        self.tree = tree
        self.node = node
        self.min_window = min_window
        self._seq = 0
        self._last_mono: float | None = None
        self._baseline: dict[str, _Counters] = {}
        self._rates: dict[str, _Rates] = {}

    def snapshot(
        self,
        workloads: Iterable[WorkloadIdentity],
        wall_time: float,
        monotonic: float,
        count_threads: Collection[str] = (),
        levels: Iterable[WorkloadIdentity] = (),
    ) -> NodeSnapshot:
        """`count_threads`: paths whose threads are counted too (deadline jobs); `levels`:
        parents of workloads, of which only cpu.weight is read (one that cannot be read is
        left out: the hierarchy stops below it)."""
        elapsed = None if self._last_mono is None else monotonic - self._last_mono
        node = self.node.read()
        states = []
        skipped: list[Skipped] = []
        vanished: list[str] = []
        baseline: dict[str, _Counters] = {}
        rates: dict[str, _Rates] = {}
        for identity in workloads:
            try:
                with self.tree.open(identity.path) as d:
                    sample = read_sample(d, node.page_size, threads=identity.path in count_threads)
            except CgroupVanished:
                vanished.append(identity.path)
                continue
            except Exception as e:  # unreadable, unparsable, unexpected: skip this one only
                skipped.append(Skipped(identity, "sense", one_line(e)))
                if identity.path in self._baseline:  # measure from it when the cgroup recovers
                    baseline[identity.path] = self._baseline[identity.path]
                continue
            path = identity.path
            now = _counters(sample, monotonic)
            prev = self._baseline.get(path)
            if now is not None:
                baseline[path] = now
                if prev is not None and now.at - prev.at < self.min_window:
                    baseline[path] = prev  # too soon: keep measuring from the old baseline
                    if path in self._rates:
                        rates[path] = self._rates[path]
                elif prev is not None and now.at > prev.at:
                    rates[path] = _rates(prev, now)
            r = rates.get(path)
            states.append(
                WorkloadState(
                    identity,
                    sample,
                    None if r is None else r.cpu,
                    None if r is None else r.throttled,
                    None if r is None else r.stall,
                )
            )
        self._baseline, self._rates = baseline, rates
        self._last_mono = monotonic
        self._seq += 1
        parents = self._levels(levels, skipped)
        return NodeSnapshot(
            self._seq,
            wall_time,
            elapsed,
            node,
            tuple(states),
            tuple(skipped),
            tuple(vanished),
            parents,
        )

    def _levels(
        self, levels: Iterable[WorkloadIdentity], skipped: list[Skipped]
    ) -> tuple[WorkloadState, ...]:
        out = []
        for identity in levels:
            try:
                with self.tree.open(identity.path) as d:
                    text = d.read_optional(Attribute.CPU_WEIGHT)
                    weight = None if text is None else CpuWeight(parse.single_int(text))
            except CgroupVanished:
                continue
            except Exception as e:  # unreadable: not weighted this tick, said once
                skipped.append(Skipped(identity, "sense", one_line(e)))
                continue
            settings = {} if weight is None else {Attribute.CPU_WEIGHT: weight}
            out.append(WorkloadState(identity, CgroupSample(settings=settings)))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class _Rates:
    cpu: float
    throttled: float
    stall: float | None


def _rates(prev: _Counters, now: _Counters) -> _Rates:
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
