"""The CPU the policies may hand out: the node's CPUs less what is reserved.

The system reservation (`node.reserved_cpu`) is never given to a workload. Class
reservations (`classes.<c>.reserved_cpu`) are kept for their class: other classes'
floors (deadline rates) plan around them. Shares such as "20%" are of the node's CPUs.
`capacity` is what deadline jobs are planned on: that, or less when the rest of the node
is measured to use more than the system reservation leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodeagent.policy.base import PolicyInput
from nodeagent.policyfile.model import WorkloadClass
from nodeagent.snapshot import NodeState


def cores(amount: tuple[float, bool], cpus: int) -> float:
    value, is_fraction = amount
    return value * cpus if is_fraction else value


def usable(given: PolicyInput) -> float:
    """The node's CPUs less the system reservation: what workloads may use in all."""
    cpus = given.snapshot.node.cpu_count
    return max(0.0, cpus - cores(given.spec.node.reserved_cpu, cpus))


def reserved(given: PolicyInput) -> dict[WorkloadClass, float]:
    """Each class's reservation in cores, for the classes that have one."""
    cpus = given.snapshot.node.cpu_count
    return {
        c: cores(s.reserved_cpu, cpus)
        for c, s in given.spec.classes.items()
        if s.reserved_cpu is not None and cores(s.reserved_cpu, cpus) > 0
    }


SMOOTHING = 0.3
"""Weight of this tick's reading in the measured use outside the workloads (an EWMA)."""


@dataclass(frozen=True, slots=True)
class Capacity:
    """The CPU the deadline jobs can be planned on, and where that figure came from."""

    cores: float
    nominal: float
    """The node's CPUs less the system and class reservations."""
    other: float
    """Cores measured in use outside the managed workloads (the agent, the system, steal),
    smoothed over ticks."""
    source: str
    """'measured' when the measured use outside the workloads leaves less than nominal."""

    def describe(self) -> str:
        if self.source == "measured":
            return (
                f"{self.cores:.2f} cores measured ({self.nominal:.2f} nominal, less"
                f" {self.other:.2f} in use outside the managed workloads)"
            )
        return f"{self.cores:.2f} cores nominal (usable less reservations)"


def busy_cores(node: NodeState) -> float | None:
    """Cores the whole node kept busy last tick (a hypervisor's steal counted as busy, as
    /proc/stat counts it); None before the first rate."""
    return None if node.cpu_busy is None else node.cpu_busy * node.cpu_count


def idle_cores(node: NodeState) -> float:
    """Cores the node left idle last tick; none known before the first rate."""
    busy = busy_cores(node)
    return 0.0 if busy is None else node.cpu_count - busy


def capacity(given: PolicyInput, other_before: float | None) -> Capacity:
    """What the node really has for the managed workloads: the nominal figure, or less when
    the rest of the node (the agent itself, the system, unmanaged cgroups, a hypervisor's
    steal, which /proc/stat counts as busy) was measured to use more than the system
    reservation leaves it. The use outside is smoothed, so one noisy tick moves it little."""
    node = given.snapshot.node
    cpus = node.cpu_count
    kept = sum(reserved(given).values())
    nominal = max(0.0, usable(given) - kept)
    other = other_before
    # a workload on its first tick has no rate yet: its use would be counted outside (three
    # deadline jobs started at once read as 1.9 cores outside, and the EWMA kept the
    # capacity low for ten ticks, seen in the VM); this tick's reading waits for its rate
    unknown = any(w.cpu_rate is None and w.sample.populated for w in given.snapshot.workloads)
    busy = busy_cores(node)
    if busy is not None and not unknown:
        managed = sum(w.cpu_rate or 0.0 for w in given.snapshot.workloads)
        now = min(float(cpus), max(0.0, busy - managed))
        other = now if other is None else (1 - SMOOTHING) * other + SMOOTHING * now
    if other is None:
        return Capacity(nominal, nominal, 0.0, "nominal")
    measured = max(0.0, cpus - other - kept)
    if measured < nominal:
        return Capacity(measured, nominal, other, "measured")
    return Capacity(nominal, nominal, other, "nominal")
