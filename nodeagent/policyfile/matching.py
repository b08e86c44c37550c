"""What a rule's `match:` means: whether a workload matches it, and the metadata terms that did.

Part of the policy file's meaning, beside its schema: the classifier (policy.classify) runs it
on every tick, and the loader's nesting check (spec.nesting) on the rules alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from nodeagent.identity import Kind, Owner, WorkloadIdentity
from nodeagent.meta import ContainerMeta
from nodeagent.policyfile.glob import glob_matches
from nodeagent.policyfile.model import CONTAINER_META, POD_META, Match


def matches(match: Match, w: WorkloadIdentity, assume_meta: bool = False) -> bool:
    """Whether `w` matches every key of `match`. `assume_meta`: a workload without runtime
    metadata is taken to match the metadata keys it could have (for checks of the rules
    alone, such as validate's nesting warnings)."""
    return match_terms(match, w, assume_meta) is not None


def match_terms(
    match: Match, w: WorkloadIdentity, assume_meta: bool = False
) -> tuple[str, ...] | None:
    """The metadata terms that matched (empty without metadata keys), or None: no match.

    A workload below a user's manager (owner user-systemd) matches only a rule that names
    `owner: user-systemd`: user N makes those cgroups, names them, and runs the podman that
    would describe them, so a rule written for the node's own workloads (by a name, a path,
    an image, a label) must never give its tenant or class to a look-alike (issue 34)."""
    checks = (
        match.path is None or glob_matches(match.path, w.path),
        match.name is None or glob_matches(match.name, w.name),
        match.runtime is None or match.runtime == w.runtime,
        match.kind is None or match.kind == w.kind,
        match.owner == w.owner if w.owner is Owner.USER_SYSTEMD else match.owner in (None, w.owner),
        match.qos is None or match.qos == w.qos,
        match.pod_uid is None or match.pod_uid == w.pod_uid,
        match.container_id is None
        or (w.container_id is not None and w.container_id.startswith(match.container_id)),
        match.account is None or (w.account is not None and glob_matches(match.account, w.account)),
    )
    if not all(checks):
        return None
    if not match.needs_metadata:
        return ()
    if w.meta is None:
        # only a container or a pod is ever described by a runtime (a systemd unit, a Slurm
        # job or an exec job never is), so only they can be assumed to be
        if not assume_meta or (w.container_id is None and w.pod_uid is None):
            return None
        own = any(getattr(match, k) is not None for k in CONTAINER_META)
        return None if own and w.kind is Kind.POD else ()
    if w.meta.sandbox:
        return None  # a pod's sandbox ("pause") is its plumbing, not its work
    return _meta_terms(match, w.meta)


def _meta_terms(match: Match, meta: ContainerMeta) -> tuple[str, ...] | None:
    terms: list[str] = []

    def one(key: str, pattern: str | None, value: str | None) -> bool:
        if pattern is None:
            return True
        if value is None or not glob_matches(pattern, value):
            return False
        terms.append(f"{key}={show(value)}")
        return True

    def every(key: str, patterns: Mapping[str, str] | None, values: Mapping[str, str]) -> bool:
        for k, pattern in (patterns or {}).items():
            value = values.get(k)
            if value is None or not glob_matches(pattern, value):
                return False
            terms.append(f"{key}.{k}={show(value)}")
        return True

    if match.labels is not None and meta.incomplete is not None:
        return None
    pod = meta.pod
    if pod is None and any(getattr(match, k) is not None for k in POD_META):
        return None
    ok = (
        one("container_name", match.container_name, meta.name)
        and one("image", match.image, meta.image)
        and every("labels", match.labels, meta.labels)
        and (
            pod is None
            or (
                one("namespace", match.namespace, pod.namespace)
                and one("pod_name", match.pod_name, pod.name)
                and every("pod_labels", match.pod_labels, pod.labels)
                and every("pod_annotations", match.pod_annotations, pod.annotations)
            )
        )
    )
    return tuple(terms) if ok else None


def show(value: str, most: int = 64) -> str:
    """A label value as a report shows it: printable, at most `most` characters."""
    text = value if value.isprintable() else value.encode("unicode_escape").decode("ascii")
    return text if len(text) <= most else text[: most - 3] + "..."
