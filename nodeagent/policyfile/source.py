"""The policy in force, as one object the long-lived parts share.

A reload replaces the policy; the parts built once at start (the executor, the GPU service,
the state saver) read what they need of it when they need it, from this one holder, instead
of each being handed a callback over the reconciler that owns it. Only the loop's thread
sets `spec` (at a reload); the others read it whole.
"""

from __future__ import annotations

from nodeagent.policyfile.model import PolicySpec


class PolicySource:
    __slots__ = ("spec",)

    def __init__(self, spec: PolicySpec) -> None:
        self.spec = spec
