"""Tell what a cgroup is from its path alone, by matching the layouts runtimes create.

Every runtime names its cgroups predictably, and the name is all discovery needs
to know who made a cgroup and therefore who may write its attributes (see
`Owner`). The layouts recognised, relative to the cgroup root:

systemd cgroup driver (owner SYSTEMD)
    system.slice/docker-<id>.scope                         docker container
    machine.slice/libpod-<id>.scope                        podman container
    machine.slice/machine-libpod_pod_<podid>.slice/libpod-<id>.scope   (in a podman pod)
    kubepods.slice/kubepods-pod<uid>.slice                 guaranteed pod
    kubepods.slice/kubepods-<tier>.slice/kubepods-<tier>-pod<uid>.slice   burstable/besteffort
    <pod>/cri-containerd-<id>.scope | crio-<id>.scope | docker-<id>.scope   pod containers
    <slices>/<unit>.service                                a systemd service

a user's systemd manager (owner USER_SYSTEMD: its units are not the system manager's)
    user.slice/user-<n>.slice/user@<n>.service/<slices>/libpod-<id>.scope  rootless podman
    user.slice/user-<n>.slice/user@<n>.service/<slices>/<unit>.service     a user service

    User n makes whatever cgroups it likes there (Delegate=yes), names included: a
    libpod-<id>.scope below user@<n>.service is user n's own podman's container if
    anything, and the id, which any user reads in /proc/*/cgroup, may be a rootful
    container's. So such a container is never asked of root's runtimes
    (nodeagent.runtimes.metadata, `delegated_uid`), and its names match only rules that
    name owner user-systemd (nodeagent.policyfile.matching).

Slurm's cgroup/v2 plugin (owner SLURM: slurmd made it, below systemd's delegated scope)
    system.slice/slurmstepd.scope/job_<id>                 a Slurm job
    system.slice/<node>_slurmstepd.scope/job_<id>          (a host running several slurmd)

cgroupfs driver (owner CGROUPFS)
    docker/<id>                                            docker container
    libpod_parent/[<podid>/]libpod-<id>                    podman container
    kubepods/pod<uid>, kubepods/<tier>/pod<uid>            pods
    <pod>/<id>, <pod>/crio-<id>                            pod containers

The kubelet's systemd driver spells the pod uid with '_' for '-' (a '-' in a slice
name means nesting to systemd); it is decoded back. Pod uids are UUIDs, except
for static pods (manifests in /etc/kubernetes/manifests), whose uid is the hex
md5 of the manifest: 32 hex digits, no dashes (kubelet pkg/kubelet/config/common.go
applyDefaults). Both are accepted, or the control plane's own pods would vanish.

A Slurm job's steps (step_<n>, step_batch, step_extern, their user/task_<n>) and the
scope's own system/ cgroup (slurmstepd itself) are below the job or not a job: not
workloads. What a job's account is, the path cannot say: nodeagent.slurm asks Slurm.

Anything else is not a workload: the root, slices, QoS tier cgroups, init.scope,
conmon scopes (crio-conmon-<id>.scope, libpod-conmon-<id>.scope; they hold the
runtime's monitor, not the workload), the user manager user@<n>.service, and
every cgroup below a workload, whose children are the workload's own business.

Every pattern is anchored (`fullmatch`, so a trailing newline cannot sneak past
`$`), uses ASCII classes only, and has no nested quantifier over overlapping
characters, so matching is linear in the path length. Patterns are grouped by
the path's first component so a path is tried against a handful of them at most.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from nodeagent.cgroupfs.paths import split_path
from nodeagent.errors import UnsafePath
from nodeagent.identity import Kind, Owner, QosTier, Runtime, WorkloadIdentity

__all__ = ["classify", "delegated_root", "delegated_uid", "may_hold", "user_manager"]

# --- component fragments; none of them can match a '/' -----------------------

_ID: Final = r"(?P<cid>[0-9a-f]{12,64})"
"""A container id: 64 lowercase hex in practice; 12 (docker's short form) and up accepted."""


def _pod_uid(sep: str) -> str:
    """A pod uid: a UUID with `sep` between its groups, or a static pod's 32-hex md5."""
    uuid = sep.join(f"[0-9a-f]{{{n}}}" for n in (8, 4, 4, 4, 12))
    return rf"(?P<uid>{uuid}|[0-9a-f]{{32}})"


_POD_UID: Final = _pod_uid("-")
_POD_UID_SYSTEMD: Final = _pod_uid("_")
"""The kubelet's systemd driver escapes '-' in the uid as '_'."""

_TIER: Final = r"(?P<qos>burstable|besteffort)"
"""Guaranteed pods have no tier cgroup; they sit directly under kubepods."""

_SLICES: Final = r"(?:[^/]+\.slice/)*"
"""Zero or more slice components: what may sit between a systemd manager and its units."""

_USER_MANAGER: Final = r"user\.slice/user-(?P<n>[0-9]+)\.slice/user@(?P=n)\.service"
"""A per-user systemd instance: its subtree is laid out like the system manager's."""

_UNIT: Final = r"(?P<unit>[A-Za-z0-9:_.\\-]+(?:@[A-Za-z0-9:_.\\-]*)?\.service)"
"""A systemd service unit name, template instances (foo@bar.service) included."""

_SLURM_SCOPE: Final = r"system\.slice/(?:[A-Za-z0-9][A-Za-z0-9._-]{0,200}_)?slurmstepd\.scope"
"""The scope slurmd's cgroup/v2 plugin has systemd make for slurmstepd (Delegate=yes); a
slurmd built for several per host prefixes its node name."""

# Container leaves below a pod. The runtime comes from the 'rt' prefix; under the
# cgroupfs driver a bare id carries no prefix at all (see _RUNTIME_BY_PREFIX).
_POD_CONTAINER_SYSTEMD: Final = rf"(?P<rt>cri-containerd|crio|docker)-{_ID}\.scope"
_POD_CONTAINER_CGROUPFS: Final = rf"(?:(?P<rt>crio)-)?{_ID}"

_RUNTIME_BY_PREFIX: Final[dict[str | None, Runtime]] = {
    "cri-containerd": Runtime.CONTAINERD,
    "crio": Runtime.CRIO,
    "docker": Runtime.DOCKER,
    # A bare hex id under a cgroupfs-driver pod is what containerd's CRI plugin
    # creates (cgroupsParent joined with the id). cri-dockerd with docker's cgroupfs
    # driver does the same, and the path cannot tell them apart; containerd is by
    # far the common runtime today (dockershim left the kubelet in 1.24), so a bare
    # id is taken for containerd.
    None: Runtime.CONTAINERD,
}


@dataclass(frozen=True, slots=True)
class _Rule:
    """One layout: a whole-path pattern and what a match means.

    Named groups fill in the rest: `cid` the container id, `uid` the pod uid,
    `qos` the tier (absent means guaranteed for pods), `rt` a runtime prefix
    (looked up in _RUNTIME_BY_PREFIX, overriding `runtime`).
    """

    pattern: re.Pattern[str]
    kind: Kind
    runtime: Runtime
    owner: Owner


def _rule(regex: str, kind: Kind, runtime: Runtime, owner: Owner) -> _Rule:
    return _Rule(re.compile(regex, re.ASCII), kind, runtime, owner)


def _kube_rules(pod: str, container: str, owner: Owner) -> tuple[_Rule, _Rule]:
    """The pod cgroup itself, and a container directly below it."""
    return (
        _rule(pod, Kind.POD, Runtime.KUBELET, owner),
        _rule(rf"{pod}/{container}", Kind.CONTAINER, Runtime.CONTAINERD, owner),
    )


_SD, _FS, _USER = Owner.SYSTEMD, Owner.CGROUPFS, Owner.USER_SYSTEMD
_CTR = Kind.CONTAINER

_RULES: Final[tuple[_Rule, ...]] = (
    # docker, outside Kubernetes
    _rule(rf"system\.slice/docker-{_ID}\.scope", _CTR, Runtime.DOCKER, _SD),
    _rule(rf"docker/{_ID}", _CTR, Runtime.DOCKER, _FS),
    # podman: rootful (optionally in a pod's slice), rootless, and the cgroupfs manager
    _rule(
        rf"machine\.slice/(?:machine-libpod_pod_[0-9a-f]{{64}}\.slice/)?libpod-{_ID}\.scope",
        _CTR,
        Runtime.PODMAN,
        _SD,
    ),
    _rule(rf"{_USER_MANAGER}/{_SLICES}libpod-{_ID}\.scope", _CTR, Runtime.PODMAN, _USER),
    _rule(rf"libpod_parent/(?:[0-9a-f]{{64}}/)?libpod-{_ID}", _CTR, Runtime.PODMAN, _FS),
    # Slurm's cgroup/v2 plugin
    _rule(rf"{_SLURM_SCOPE}/job_(?P<job>[0-9]{{1,20}})", Kind.JOB, Runtime.SLURM, Owner.SLURM),
    # Kubernetes, systemd driver
    *_kube_rules(
        rf"kubepods\.slice/kubepods-pod{_POD_UID_SYSTEMD}\.slice", _POD_CONTAINER_SYSTEMD, _SD
    ),
    *_kube_rules(
        rf"kubepods\.slice/kubepods-{_TIER}\.slice/kubepods-(?P=qos)-pod{_POD_UID_SYSTEMD}\.slice",
        _POD_CONTAINER_SYSTEMD,
        _SD,
    ),
    # Kubernetes, cgroupfs driver
    *_kube_rules(rf"kubepods/pod{_POD_UID}", _POD_CONTAINER_CGROUPFS, _FS),
    *_kube_rules(rf"kubepods/{_TIER}/pod{_POD_UID}", _POD_CONTAINER_CGROUPFS, _FS),
)


def _top(rule: _Rule) -> str:
    """The literal first component a rule's paths start with (each rule starts with one)."""
    top = rule.pattern.pattern.split("/", 1)[0].replace("\\.", ".")
    if not re.fullmatch(r"[A-Za-z0-9_.]+", top):
        raise AssertionError(f"rule must start with a literal component: {rule.pattern.pattern}")
    return top


_RULES_BY_TOP: Final[dict[str, tuple[_Rule, ...]]] = {
    top: tuple(r for r in _RULES if _top(r) == top) for top in dict.fromkeys(map(_top, _RULES))
}

_SERVICE: Final = re.compile(rf"(?:{_USER_MANAGER}/)?{_SLICES}{_UNIT}", re.ASCII)
"""A service: only slices above it (below another unit it is that unit's business).

The one unit allowed above is a user manager, whose services are real services.
"""

_USER_MANAGER_UNIT: Final = re.compile(r"user@[0-9]+\.service", re.ASCII)


def user_manager(path: str) -> str | None:
    """The user manager (``user@<n>.service``) that `path` is strictly below, if any.

    Any component so named counts, wherever it sits: what is below it is that user's
    manager's (and the user's own) business, never the system manager's.
    """
    parts = path.split("/")
    return next((p for p in parts[:-1] if _USER_MANAGER_UNIT.fullmatch(p)), None)


def _check_path(path: str, what: str) -> None:
    """Refuse anything but a relative, normalised cgroup path, and the root itself.

    The caller sanitises already; this guards the pattern matching against a path
    that names one cgroup but would be read as another ('a/../b', 'a//b', '/a').
    """
    try:
        parts = split_path(path)
    except UnsafePath as e:
        raise UnsafePath(f"{what}: {e}") from None
    if not parts:
        raise UnsafePath(f"{what} is empty")


def _from_match(path: str, rule: _Rule, m: re.Match[str]) -> WorkloadIdentity:
    groups = m.groupdict()
    cid = groups.get("cid")
    uid = groups.get("uid")
    if uid is not None:
        uid = uid.replace("_", "-")
    qos: QosTier | None = None
    if "uid" in groups:  # a pod, or a container in one
        tier = groups.get("qos")
        qos = QosTier(tier) if tier else QosTier.GUARANTEED
    runtime = _RUNTIME_BY_PREFIX[groups["rt"]] if "rt" in groups else rule.runtime
    job = groups.get("job")
    if rule.kind is Kind.POD:
        name = f"pod-{uid}"
    elif job is not None:
        name = f"slurm-{job}"
    else:
        assert cid is not None, "every container rule captures an id"
        name = cid[:12]
    return WorkloadIdentity(
        path=path,
        kind=rule.kind,
        runtime=runtime,
        owner=rule.owner,
        name=name,
        container_id=cid,
        pod_uid=uid,
        qos=qos,
        job_id=job,
    )


def classify(path: str, managed_root: str) -> WorkloadIdentity | None:
    """Say what the cgroup at `path` is, or None when it is not a workload.

    `path` and `managed_root` are relative to the cgroup root ('/'-separated, no
    leading slash). Children of `managed_root` are nodeagent's own jobs, whatever
    they are called; the root itself and anything deeper are not workloads.
    Pure: no I/O. Raises ValueError for a path that is not relative and normalised.
    """
    _check_path(path, "cgroup path")
    _check_path(managed_root, "managed root")

    if path == managed_root:
        return None
    prefix = managed_root + "/"
    if path.startswith(prefix):
        job = path[len(prefix) :]
        if "/" in job:
            return None
        return WorkloadIdentity(
            path=path, kind=Kind.JOB, runtime=Runtime.NODEAGENT, owner=Owner.NODEAGENT, name=job
        )

    for rule in _RULES_BY_TOP.get(path.split("/", 1)[0], ()):
        m = rule.pattern.fullmatch(path)
        if m is not None:
            return _from_match(path, rule, m)

    m = _SERVICE.fullmatch(path)
    if m is None or _USER_MANAGER_UNIT.fullmatch(m["unit"]):
        return None
    owner = Owner.SYSTEMD if m["n"] is None else Owner.USER_SYSTEMD
    return WorkloadIdentity(
        path=path, kind=Kind.SERVICE, runtime=Runtime.SYSTEMD, owner=owner, name=m["unit"]
    )


_HOLDER: Final = re.compile(
    rf"(?:{_USER_MANAGER}|[^/]+\.slice)(?:/[^/]+\.slice)*"
    rf"|docker|libpod_parent(?:/[0-9a-f]{{64}})?|kubepods(?:/{_TIER})?|{_SLURM_SCOPE}",
    re.ASCII,
)
"""The cgroups that are no workload but may have one below them, by the layouts above:
slices (and a user manager) above services and scopes, the cgroupfs drivers' parents, and
Slurm's scope above its jobs.
A pod's containers and the managed root are the scan's to add."""

_DELEGATED: Final = re.compile(rf"{_USER_MANAGER}(?=/|$)", re.ASCII)


def may_hold(path: str) -> bool:
    """Whether some layout places a workload below `path`, a cgroup that is no workload.
    Pure, like `classify`: the scan descends only where this is true."""
    return _HOLDER.fullmatch(path) is not None


def delegated_root(path: str) -> str | None:
    """The user manager (user.slice/user-N.slice/user@N.service) at or above `path`, or
    None: below it, user N makes cgroups at will (user@.service has Delegate=yes)."""
    m = _DELEGATED.match(path)
    return None if m is None else m.group(0)


def delegated_uid(path: str) -> int | None:
    """The uid N whose manager (user@N.service) `path` is at or below, or None: what is
    there, its names included, is user N's to make, so only user N's own runtime may say
    what it is."""
    m = _DELEGATED.match(path)
    return None if m is None else int(m["n"])
