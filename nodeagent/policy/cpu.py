"""The CPU the policies may hand out: the node's CPUs less what is reserved.

The system reservation (`node.reserved_cpu`) is never given to a workload. Class
reservations (`classes.<c>.reserved_cpu`) are kept for their class: other classes'
floors (deadline rates) plan around them. Shares such as "20%" are of the node's CPUs.
"""

from __future__ import annotations

from nodeagent.policy.base import PolicyInput
from nodeagent.spec.model import WorkloadClass


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
