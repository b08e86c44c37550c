"""Rules that can claim a cgroup and another one below it, as far as the rules alone tell.

The tenant split counts only the innermost claims (`policy.classify.outer_claims`), so such
a policy works, but its outer claims take no share of their own: `validate` warns. Tried on
what discovery finds nested: a pod with its containers, in every layout (sample uids and
ids, and a few that rules name), and the service that holds the managed root with the jobs
below it, which `exec` claims whatever the rules say.
"""

from __future__ import annotations

from nodeagent.discovery.layouts import classify
from nodeagent.identity import WorkloadIdentity
from nodeagent.policyfile.matching import matches
from nodeagent.policyfile.model import PolicySpec

_SAMPLE_UID = "00000000-0000-4000-8000-000000000000"
_SAMPLE_CID = "0" * 64
_MAX_NAMED = 4
"""Pod uids and container ids that rules name, tried besides the samples (a bounded cost)."""


def _pods(uid: str) -> list[str]:
    """A pod with `uid` in each of the kubelet's layouts (both drivers, every QoS tier)."""
    sd = uid.replace("-", "_")
    out = [f"kubepods.slice/kubepods-pod{sd}.slice", f"kubepods/pod{uid}"]
    for tier in ("burstable", "besteffort"):
        out.append(f"kubepods.slice/kubepods-{tier}.slice/kubepods-{tier}-pod{sd}.slice")
        out.append(f"kubepods/{tier}/pod{uid}")
    return out


def _containers(pod: str, cid: str) -> list[str]:
    if pod.startswith("kubepods.slice/"):
        return [f"{pod}/{rt}-{cid}.scope" for rt in ("cri-containerd", "crio", "docker")]
    return [f"{pod}/{cid}", f"{pod}/crio-{cid}"]


def _first(spec: PolicySpec, w: WorkloadIdentity | None) -> int | None:
    """The rule that claims `w` (first match wins), by index."""
    if w is None:
        return None
    return next(
        (i for i, rule in enumerate(spec.rules) if matches(rule.match, w, assume_meta=True)), None
    )


def nesting_rules(spec: PolicySpec) -> dict[tuple[int, int | None], str]:
    """(the outer cgroup's rule, the inner one's: None for exec's jobs) -> an example of
    the outer cgroup."""
    root = spec.agent.managed_root
    uids = [_SAMPLE_UID, *dict.fromkeys(r.match.pod_uid for r in spec.rules if r.match.pod_uid)]
    named = (r.match.container_id for r in spec.rules if r.match.container_id)
    cids = [_SAMPLE_CID, *dict.fromkeys(c.ljust(64, "0") for c in named if len(c) <= 64)]
    out: dict[tuple[int, int | None], str] = {}
    for uid in uids[: _MAX_NAMED + 1]:
        for pod in _pods(uid):
            outer = _first(spec, classify(pod, root))
            if outer is None:
                continue
            for cid in cids[: _MAX_NAMED + 1]:
                for path in _containers(pod, cid):
                    inner = _first(spec, classify(path, root))
                    if inner is not None:
                        out.setdefault((outer, inner), pod)
    parts = root.split("/")
    for n in range(1, len(parts)):
        above = "/".join(parts[:n])
        outer = _first(spec, classify(above, root))
        if outer is not None:
            out.setdefault((outer, None), above)
    return out


def nesting_warnings(spec: PolicySpec) -> list[tuple[int, str]]:
    """(rule index, what to say) for each rule that can claim a cgroup with claims below:
    one line for pods, one for the service that holds the managed root."""
    found = nesting_rules(spec)
    split = "the tenant split counts only the cgroups below it, and weights it as their parent"
    out = []
    for outer in sorted({o for o, _ in found}):
        inner = sorted(
            (i for o, i in found if o == outer and i is not None), key=lambda i: (i != outer, i)
        )
        if inner:
            pod = _placeholder(found[(outer, inner[0])])
            by = [("this rule" if i == outer else f"rule {spec.rules[i].name!r}") for i in inner]
            verb = "claims" if len(by) == 1 else "claim"
            out.append(
                (
                    outer,
                    f"can claim a pod ({pod}) whose containers {' and '.join(by)} {verb}:"
                    f" {split}; say `kind: container` (or `kind: pod`) to claim one of them",
                )
            )
        if (outer, None) in found:
            out.append(
                (
                    outer,
                    f"can claim {found[(outer, None)]}, which holds the managed root and the"
                    f" jobs below it: {split}; match it out (by name, for instance)",
                )
            )
    return out


def _placeholder(pod: str) -> str:
    return pod.replace(_SAMPLE_UID, "<uid>").replace(_SAMPLE_UID.replace("-", "_"), "<uid>")
