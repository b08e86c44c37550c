"""Views of a policy's input that refuse what the policy did not declare it reads
(`Policy.reads`, nodeagent.policy.reads), for the unit suite: conftest runs every plan the
suite makes through them, so a policy that reads a part of the snapshot, a workload's
figure, a section of the policy file, the usage or its carried state without declaring it
fails the test that planned it, where the plan cache would have kept a stale plan.

A view is a stand-in for the frozen input only in tests: the daemon hands policies the
input itself, at no cost.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields
from typing import cast

from nodeagent.policy.base import Output, Policy, PolicyInput
from nodeagent.policy.reads import Reads
from nodeagent.policyfile.model import PolicySpec
from nodeagent.snapshot import CgroupSample, NodeSnapshot, WorkloadState

ALWAYS_SNAPSHOT = frozenset({"workloads"})
ALWAYS_WORKLOAD = frozenset({"identity", "path", "sample"})


class Undeclared(AssertionError):
    """A policy read what its `reads` does not declare."""


class _View:
    """Attribute reads of one object, refused outside `may`."""

    def __init__(self, of: object, may: frozenset[str], what: str, seen: list[str]) -> None:
        self._of, self._may, self._what, self._seen = of, may, what, seen

    def __getattr__(self, name: str) -> object:
        if name.startswith("_") or name in self._may:
            return self._wrap(name, getattr(self._of, name))
        self._seen.append(f"{self._what}.{name}")
        raise Undeclared(f"{self._what}.{name} is read but not declared")

    def _wrap(self, name: str, value: object) -> object:
        return value


class _Sample(_View):
    pass


class _Workload(_View):
    def __init__(self, of: WorkloadState, reads: Reads, policy: str, seen: list[str]) -> None:
        mine = frozenset(f.name for f in fields(WorkloadState)) & reads.workload
        super().__init__(of, ALWAYS_WORKLOAD | mine, f"{policy}: workload", seen)
        sample = frozenset(f.name for f in fields(CgroupSample)) & reads.workload
        self._sample = _Sample(of.sample, sample, f"{policy}: workload sample", seen)

    def _wrap(self, name: str, value: object) -> object:
        return self._sample if name == "sample" else value


class _Snapshot(_View):
    def __init__(self, of: NodeSnapshot, reads: Reads, policy: str, seen: list[str]) -> None:
        super().__init__(of, ALWAYS_SNAPSHOT | reads.snapshot, f"{policy}: snapshot", seen)
        self._views: dict[str, tuple[_Workload, ...]] = {
            part: tuple(_Workload(w, reads, policy, seen) for w in getattr(of, part))
            for part in ("workloads", "levels")
        }

    def _wrap(self, name: str, value: object) -> object:
        return self._views.get(name, value)


class _Refused(Mapping[str, object]):
    """A mapping the policy did not declare it reads, or another policy's carried state."""

    def __init__(self, of: Mapping[str, object], may: frozenset[str], what: str, seen: list[str]):
        self._of, self._may, self._what, self._seen = of, may, what, seen

    def __getitem__(self, key: str) -> object:
        if key not in self._may:
            self._seen.append(f"{self._what}[{key!r}]")
            raise Undeclared(f"{self._what}[{key!r}] is read but not declared")
        return self._of[key]

    def __iter__(self) -> Iterator[str]:
        self._seen.append(f"{self._what} (all of it)")
        raise Undeclared(f"{self._what} is read whole")

    def __len__(self) -> int:
        self._seen.append(f"{self._what} (all of it)")
        raise Undeclared(f"{self._what} is read whole")


def guarded(given: PolicyInput, policy: Policy, seen: list[str]) -> PolicyInput:
    """The input as the policy may read it; each refused read is also added to `seen`
    (the pipeline turns a policy's exception into a skip or a problem, so the test looks
    at `seen`, not at whether it raised)."""
    reads, name = policy.reads, policy.name
    spec = _View(given.spec, reads.settings, f"{name}: policy file", seen)
    usage = given.tenant_usage
    if not reads.usage:
        usage = cast(Mapping[str, float], _Refused(usage, frozenset(), f"{name}: usage", seen))
    own = frozenset({name}) if reads.carry else frozenset()
    carried = _Refused(given.carried, own, f"{name}: carried", seen)
    return PolicyInput(
        cast(NodeSnapshot, _Snapshot(given.snapshot, reads, name, seen)),
        cast(PolicySpec, spec),
        given.assignments,
        usage,
        given.earlier,
        cast(Mapping[str, Mapping[str, object]], carried),
    )


class Guarded(Policy):
    """A policy run on guarded input (`guarded`), as the pipeline sees it otherwise."""

    def __init__(self, policy: Policy, seen: list[str]) -> None:
        self.policy, self.seen = policy, seen
        self.name, self.writes = policy.name, policy.writes
        self.device_settings, self.reads = policy.device_settings, policy.reads

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        return self.policy.decide(guarded(given, self.policy, self.seen))
