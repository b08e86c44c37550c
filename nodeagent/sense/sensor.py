"""Builds each tick's frozen NodeSnapshot from the kernel, turning counters into rates."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nodeagent.cgroupfs.tree import CgroupTree, CgroupVanished
from nodeagent.identity import WorkloadIdentity
from nodeagent.sense.cgroup_files import read_sample
from nodeagent.sense.node import NodeSensor
from nodeagent.snapshot import CgroupSample, NodeSnapshot, WorkloadState


@dataclass(frozen=True, slots=True)
class _Counters:
    usage_us: int
    periods: int
    throttled: int


class Sensor:
    """Reads every known workload once per tick. Vanished cgroups are dropped silently."""

    def __init__(self, tree: CgroupTree, node: NodeSensor) -> None:
        self.tree = tree
        self.node = node
        self._seq = 0
        self._last_mono: float | None = None
        self._counters: dict[str, _Counters] = {}

    def snapshot(
        self, workloads: Iterable[WorkloadIdentity], wall_time: float, monotonic: float
    ) -> NodeSnapshot:
        elapsed = None if self._last_mono is None else monotonic - self._last_mono
        node = self.node.read()
        states = []
        counters: dict[str, _Counters] = {}
        for identity in workloads:
            try:
                with self.tree.open(identity.path) as d:
                    sample = read_sample(d, node.page_size)
            except CgroupVanished:
                continue
            rate, throttled = None, None
            now = _counters(sample)
            if now is not None:
                counters[identity.path] = now
                prev = self._counters.get(identity.path)
                if prev is not None and elapsed:
                    rate = max(0, now.usage_us - prev.usage_us) / 1e6 / elapsed
                    periods = now.periods - prev.periods
                    throttled = (now.throttled - prev.throttled) / periods if periods > 0 else 0.0
            states.append(WorkloadState(identity, sample, rate, throttled))
        self._counters = counters
        self._last_mono = monotonic
        self._seq += 1
        return NodeSnapshot(self._seq, wall_time, elapsed, node, tuple(states))


def _counters(sample: CgroupSample) -> _Counters | None:
    if sample.cpu_usage_us is None:
        return None
    return _Counters(sample.cpu_usage_us, sample.cpu_nr_periods or 0, sample.cpu_nr_throttled or 0)
