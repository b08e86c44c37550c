"""classify(): every cgroup layout nodeagent recognises, and the ones it must not."""

from __future__ import annotations

import multiprocessing
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.discovery.layouts import classify, delegated_root
from nodeagent.discovery.scan import descends
from nodeagent.identity import Kind, Owner, QosTier, Runtime, WorkloadIdentity

ROOT = "nodeagent.slice"

CID = "4f1c2a9be7d3" + "0123456789abcdef" * 3 + "0123"  # 64 lowercase hex
CID2 = "9a8b7c6d5e4f" + "fedcba9876543210" * 3 + "3210"
assert len(CID) == 64 and len(CID2) == 64
PODID = "e" * 64  # a podman pod id
UID = "3b1e5f2a-9c4d-4e7f-8a6b-0d2c1e9f7a35"
UID_ = UID.replace("-", "_")
STATIC_UID = "a1b2c3d4e5f60718293a4b5c6d7e8f90"  # kubelet: md5 of a static pod manifest

SD_BURSTABLE_POD = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
SD_BESTEFFORT_POD = f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice"
SD_GUARANTEED_POD = f"kubepods.slice/kubepods-pod{UID_}.slice"
FS_BURSTABLE_POD = f"kubepods/burstable/pod{UID}"
FS_BESTEFFORT_POD = f"kubepods/besteffort/pod{UID}"
FS_GUARANTEED_POD = f"kubepods/pod{UID}"


def container(
    runtime: Runtime,
    owner: Owner,
    cid: str = CID,
    pod_uid: str | None = None,
    qos: QosTier | None = None,
) -> WorkloadIdentity:
    """The expected identity; `path` is filled in by the test."""
    return WorkloadIdentity("", Kind.CONTAINER, runtime, owner, cid[:12], cid, pod_uid, qos)


def pod(owner: Owner, qos: QosTier, uid: str = UID) -> WorkloadIdentity:
    return WorkloadIdentity("", Kind.POD, Runtime.KUBELET, owner, f"pod-{uid}", None, uid, qos)


def service(unit: str, owner: Owner = Owner.SYSTEMD) -> WorkloadIdentity:
    return WorkloadIdentity("", Kind.SERVICE, Runtime.SYSTEMD, owner, unit)


def slurm_job(job_id: str) -> WorkloadIdentity:
    return WorkloadIdentity(
        "", Kind.JOB, Runtime.SLURM, Owner.SLURM, f"slurm-{job_id}", job_id=job_id
    )


SD, FS, USER = Owner.SYSTEMD, Owner.CGROUPFS, Owner.USER_SYSTEMD
G, B, BE = QosTier.GUARANTEED, QosTier.BURSTABLE, QosTier.BESTEFFORT

WORKLOADS: list[tuple[str, WorkloadIdentity]] = [
    # docker
    (f"system.slice/docker-{CID}.scope", container(Runtime.DOCKER, SD)),
    (f"docker/{CID}", container(Runtime.DOCKER, FS)),
    (f"docker/{CID[:12]}", container(Runtime.DOCKER, FS, cid=CID[:12])),
    # podman
    (f"machine.slice/libpod-{CID}.scope", container(Runtime.PODMAN, SD)),
    (
        f"machine.slice/machine-libpod_pod_{PODID}.slice/libpod-{CID}.scope",
        container(Runtime.PODMAN, SD),
    ),
    # rootless: the user's own manager owns it, not the system manager (issue 12 item 9)
    (
        f"user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{CID}.scope",
        container(Runtime.PODMAN, USER),
    ),
    (
        "user.slice/user-1000.slice/user@1000.service/user.slice/"
        f"user-libpod_pod_{PODID}.slice/libpod-{CID}.scope",
        container(Runtime.PODMAN, USER),
    ),
    (f"libpod_parent/libpod-{CID}", container(Runtime.PODMAN, FS)),
    (f"libpod_parent/{PODID}/libpod-{CID}", container(Runtime.PODMAN, FS)),
    # Kubernetes pods, systemd driver
    (SD_GUARANTEED_POD, pod(SD, G)),
    (SD_BURSTABLE_POD, pod(SD, B)),
    (SD_BESTEFFORT_POD, pod(SD, BE)),
    (
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{STATIC_UID}.slice",
        pod(SD, B, uid=STATIC_UID),
    ),
    # Kubernetes containers, systemd driver: every runtime, every tier
    (
        f"{SD_GUARANTEED_POD}/cri-containerd-{CID}.scope",
        container(Runtime.CONTAINERD, SD, pod_uid=UID, qos=G),
    ),
    (
        f"{SD_BURSTABLE_POD}/cri-containerd-{CID2}.scope",
        container(Runtime.CONTAINERD, SD, cid=CID2, pod_uid=UID, qos=B),
    ),
    (f"{SD_BURSTABLE_POD}/crio-{CID}.scope", container(Runtime.CRIO, SD, pod_uid=UID, qos=B)),
    (f"{SD_BESTEFFORT_POD}/crio-{CID}.scope", container(Runtime.CRIO, SD, pod_uid=UID, qos=BE)),
    (f"{SD_BESTEFFORT_POD}/docker-{CID}.scope", container(Runtime.DOCKER, SD, pod_uid=UID, qos=BE)),
    (f"{SD_GUARANTEED_POD}/docker-{CID}.scope", container(Runtime.DOCKER, SD, pod_uid=UID, qos=G)),
    # Kubernetes pods and containers, cgroupfs driver
    (FS_GUARANTEED_POD, pod(FS, G)),
    (FS_BURSTABLE_POD, pod(FS, B)),
    (FS_BESTEFFORT_POD, pod(FS, BE)),
    (f"kubepods/pod{STATIC_UID}", pod(FS, G, uid=STATIC_UID)),
    (f"{FS_GUARANTEED_POD}/{CID}", container(Runtime.CONTAINERD, FS, pod_uid=UID, qos=G)),
    (f"{FS_BURSTABLE_POD}/{CID}", container(Runtime.CONTAINERD, FS, pod_uid=UID, qos=B)),
    (f"{FS_BESTEFFORT_POD}/{CID}", container(Runtime.CONTAINERD, FS, pod_uid=UID, qos=BE)),
    (f"{FS_BURSTABLE_POD}/crio-{CID}", container(Runtime.CRIO, FS, pod_uid=UID, qos=B)),
    (
        f"kubepods/pod{STATIC_UID}/{CID}",
        container(Runtime.CONTAINERD, FS, pod_uid=STATIC_UID, qos=G),
    ),
    # Slurm's cgroup/v2 plugin: the job, never its steps
    ("system.slice/slurmstepd.scope/job_42", slurm_job("42")),
    ("system.slice/slurmstepd.scope/job_4294967294", slurm_job("4294967294")),
    ("system.slice/gpu-node-07.cluster_slurmstepd.scope/job_7", slurm_job("7")),
    # systemd services
    ("system.slice/nginx.service", service("nginx.service")),
    ("system.slice/foo@1.service", service("foo@1.service")),
    ("system.slice/system-getty.slice/getty@tty1.service", service("getty@tty1.service")),
    ("system.slice/docker.service", service("docker.service")),
    ("system.slice/containerd.service", service("containerd.service")),
    (
        "user.slice/user-1000.slice/user-runtime-dir@1000.service",
        service("user-runtime-dir@1000.service"),
    ),
    (
        "user.slice/user-1000.slice/user@1000.service/app.slice/dbus-broker.service",
        service("dbus-broker.service", USER),
    ),
    ("custom.service", service("custom.service")),
    (
        r"system.slice/systemd-fsck@dev-disk-by\x2duuid-1234.service",
        service(r"systemd-fsck@dev-disk-by\x2duuid-1234.service"),
    ),
]


@pytest.mark.parametrize(("path", "expected"), WORKLOADS, ids=[p for p, _ in WORKLOADS])
def test_recognises_workload(path: str, expected: WorkloadIdentity) -> None:
    assert classify(path, ROOT) == replace(expected, path=path)


def test_pod_uid_underscores_are_decoded() -> None:
    ident = classify(SD_BURSTABLE_POD, ROOT)
    assert ident is not None
    assert ident.pod_uid == UID
    assert "_" not in ident.name


def test_container_name_is_short_id() -> None:
    ident = classify(f"system.slice/docker-{CID}.scope", ROOT)
    assert ident is not None
    assert ident.name == CID[:12]
    assert ident.container_id == CID


JOBS = [
    ("nodeagent.slice", "nodeagent.slice/train-42", "train-42"),
    ("nodeagent.slice", "nodeagent.slice/x.service", "x.service"),
    ("nodeagent.slice", f"nodeagent.slice/docker-{CID}.scope", f"docker-{CID}.scope"),
    (
        "system.slice/nodeagent.service/workloads",
        "system.slice/nodeagent.service/workloads/eval-7",
        "eval-7",
    ),
    ("kubepods.slice", f"kubepods.slice/kubepods-pod{UID_}.slice", f"kubepods-pod{UID_}.slice"),
]


@pytest.mark.parametrize(("root", "path", "name"), JOBS)
def test_children_of_managed_root_are_jobs_first(root: str, path: str, name: str) -> None:
    assert classify(path, root) == WorkloadIdentity(
        path=path, kind=Kind.JOB, runtime=Runtime.NODEAGENT, owner=Owner.NODEAGENT, name=name
    )


def test_service_holding_the_managed_root_is_still_a_service() -> None:
    root = "system.slice/nodeagent.service/workloads"
    path = "system.slice/nodeagent.service"
    assert classify(path, root) == replace(service("nodeagent.service"), path=path)


NOT_WORKLOADS = [
    # structure: slices, tiers, the root's children that are not workloads
    "system.slice",
    "user.slice",
    "machine.slice",
    "init.scope",
    "kubepods.slice",
    "kubepods.slice/kubepods-burstable.slice",
    "kubepods.slice/kubepods-besteffort.slice",
    "kubepods",
    "kubepods/burstable",
    "kubepods/besteffort",
    "docker",
    "libpod_parent",
    f"machine.slice/machine-libpod_pod_{PODID}.slice",
    "user.slice/user-1000.slice",
    "user.slice/user-1000.slice/session-3.scope",
    "user.slice/user-1000.slice/user@1000.service",
    "user.slice/user-1000.slice/user@1000.service/init.scope",
    "user.slice/user-1000.slice/user@1000.service/user.slice",
    "system.slice/system-getty.slice",
    # conmon: the runtime's monitor, not the workload
    f"{SD_BURSTABLE_POD}/crio-conmon-{CID}.scope",
    f"{FS_BURSTABLE_POD}/crio-conmon-{CID}",
    f"machine.slice/libpod-conmon-{CID}.scope",
    f"user.slice/user-1000.slice/user@1000.service/user.slice/libpod-conmon-{CID}.scope",
    # below a workload
    "system.slice/nginx.service/worker",
    "system.slice/nodeagent.service/workloads/x.service",
    "system.slice/foo.service/bar.service",
    f"system.slice/docker-{CID}.scope/init",
    f"docker/{CID}/system.slice/sshd.service",  # systemd running inside a container
    f"{SD_BURSTABLE_POD}/crio-{CID}.scope/container",
    f"{FS_BURSTABLE_POD}/{CID}/{CID2}",
    f"machine.slice/libpod-{CID}.scope/container",
    "nodeagent.slice/train-42/worker-0",
    "nodeagent.slice/train-42/sub.service",
    # Slurm: the scope, slurmstepd's own cgroup, a job's steps and tasks, misplaced jobs
    "system.slice/slurmstepd.scope",
    "system.slice/slurmstepd.scope/system",
    "system.slice/slurmstepd.scope/job_42/step_0",
    "system.slice/slurmstepd.scope/job_42/step_batch/user/task_0",
    "system.slice/slurmstepd.scope/job_42/step_extern",
    "system.slice/slurmstepd.scope/job_",
    "system.slice/slurmstepd.scope/job_4x",
    "system.slice/slurmstepd.scope/job_\u0664\u0662",
    "system.slice/slurmstepd.scope/job_42\n",
    "system.slice/_slurmstepd.scope/job_42",
    "machine.slice/slurmstepd.scope/job_42",
    "slurmstepd.scope/job_42",
    "user.slice/user-1000.slice/user@1000.service/app.slice/slurmstepd.scope/job_42",
    # the managed root itself
    "nodeagent.slice",
    # ids that are not 12-64 lowercase hex
    "system.slice/docker-abc.scope",
    f"system.slice/docker-{CID.upper()}.scope",
    f"system.slice/docker-{CID}0.scope",  # 65 hex
    f"system.slice/docker-{CID[:11]}.scope",
    f"system.slice/docker-{CID[:-1]}g.scope",
    "docker/not-a-container",
    f"{SD_BURSTABLE_POD}/cri-containerd-{CID[:-1]}z.scope",
    f"{FS_BURSTABLE_POD}/{CID[:-1]}Z",
    f"{SD_BURSTABLE_POD}/runc-{CID}.scope",
    # pod uids that are not UUIDs (or static-pod md5s), or in the wrong spelling
    "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice",
    f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID}.slice",  # dashes
    f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_.upper()}.slice",
    f"kubepods/burstable/pod{UID_}",  # underscores under cgroupfs
    f"kubepods/burstable/pod{UID[:-1]}",
    f"kubepods/burstable/pod{UID}0",
    f"kubepods/pod{STATIC_UID}0",
    # tier mismatches and misplaced pods
    f"kubepods.slice/kubepods-burstable.slice/kubepods-besteffort-pod{UID_}.slice",
    f"kubepods.slice/kubepods-burstable.slice/kubepods-pod{UID_}.slice",
    f"kubepods.slice/kubepods-burstable-pod{UID_}.slice",
    f"kubepods/guaranteed/pod{UID}",
    f"kubepods/burstable/besteffort/pod{UID}",
    f"system.slice/kubepods-pod{UID_}.slice",
    # layouts in the wrong place
    f"docker-{CID}.scope",
    f"machine.slice/docker-{CID}.scope",
    f"system.slice/libpod-{CID}.scope",
    f"user.slice/user-1000.slice/user@1001.service/user.slice/libpod-{CID}.scope",
    f"kubepods/burstable/pod{UID}/cri-containerd-{CID}.scope",  # systemd leaf under cgroupfs
    f"{SD_BURSTABLE_POD}/{CID}",  # cgroupfs leaf under systemd
    # not service names
    "system.slice/nginx.socket",
    "system.slice/.service",
    "system.slice/nginx.service.d",
    # a trailing newline must not slip past an anchor; non-ASCII digits are not digits
    f"system.slice/docker-{CID}.scope\n",
    "system.slice/nginx.service\n",
    f"user.slice/user-\u0661.slice/user@\u0661.service/user.slice/libpod-{CID}.scope",
]


@pytest.mark.parametrize("path", NOT_WORKLOADS)
def test_not_a_workload(path: str) -> None:
    assert classify(path, ROOT) is None


BAD_PATHS = [
    "",
    "/system.slice/nginx.service",
    "/",
    "system.slice/",
    "system.slice//nginx.service",
    "system.slice/../etc",
    "..",
    "nodeagent.slice/../system.slice/nginx.service",
    "nodeagent.slice/./train-42",
    ".",
    "system.slice/nginx.service\0",
]


@pytest.mark.parametrize("path", BAD_PATHS)
def test_malformed_path_is_refused(path: str) -> None:
    with pytest.raises(ValueError, match="path"):
        classify(path, ROOT)


@pytest.mark.parametrize("root", ["", "/nodeagent.slice", "nodeagent.slice/", "a/../b", "a//b"])
def test_malformed_managed_root_is_refused(root: str) -> None:
    with pytest.raises(ValueError, match="managed root"):
        classify("nodeagent.slice/train-42", root)


def _classify_deep_chains(out: Any) -> None:
    scope = "/".join(["a.slice"] * 2000 + ["x.scope"])
    service = "/".join(["a.slice"] * 2000 + ["x.service"])
    out.send((classify(scope, ROOT), classify(service, ROOT)))


def test_a_deep_slice_chain_is_classified_without_runaway_backtracking() -> None:
    """2000 slices above a scope (no workload) and above a service (one). The patterns are
    linear in the path (see layouts.py); a nested quantifier would make the failing match
    exponential, so it runs in a child process that is killed after a minute, a ceiling that
    bounds a runaway, not a speed: linear matching takes milliseconds."""
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    child = multiprocessing.get_context("fork").Process(
        target=_classify_deep_chains, args=(theirs,)
    )
    child.start()
    try:
        assert ours.poll(60), "classify did not finish on a 2000-deep chain within 60 s"
        scope, service = ours.recv()
    finally:
        child.kill()
        child.join()
    assert scope is None
    assert service is not None and service.name == "x.service"


# --- property: never raises on well-formed paths, and echoes the path -----------

_SAFE_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEF0123456789-_.@:"
_TOKENS = [
    "system.slice",
    "slurmstepd.scope",
    "n1_slurmstepd.scope",
    "job_12",
    "step_0",
    "kubepods.slice",
    "kubepods",
    "burstable",
    "besteffort",
    "kubepods-burstable.slice",
    f"kubepods-burstable-pod{UID_}.slice",
    f"kubepods-pod{UID_}.slice",
    f"pod{UID}",
    f"cri-containerd-{CID}.scope",
    f"crio-{CID}.scope",
    f"crio-conmon-{CID}.scope",
    f"docker-{CID}.scope",
    f"libpod-{CID}.scope",
    "docker",
    "machine.slice",
    "user.slice",
    "user-1000.slice",
    "user@1000.service",
    "nginx.service",
    "nodeagent.slice",
    "init.scope",
    CID,
]

_component = st.one_of(
    st.sampled_from(_TOKENS),
    st.text(alphabet=_SAFE_CHARS, min_size=1, max_size=70),
).filter(lambda c: c not in {".", ".."})

_paths = st.lists(_component, min_size=1, max_size=8).map("/".join)


# Layout-shaped paths with fresh ids, each with the identity the layout gives it, worked out
# from how the path was built (not from classify); one level below a leaf workload, none.
_HEX = "0123456789abcdef"
_cids = st.integers(12, 64).flatmap(lambda n: st.text(_HEX, min_size=n, max_size=n))
_pod_uids = st.one_of(st.uuids().map(str), st.text(_HEX, min_size=32, max_size=32))
_tiers = st.sampled_from([G, B, BE])
_slices = st.lists(st.from_regex(r"[a-z][a-z0-9-]{0,8}\.slice", fullmatch=True), max_size=3)
_units = st.from_regex(r"[a-z][a-z0-9-]{0,10}(@[a-z0-9]{1,4})?\.service", fullmatch=True).filter(
    lambda u: not u.startswith("user@")
)
_users = st.integers(0, 70_000)


def _path(*parts: str) -> str:
    return "/".join(p for p in parts if p)


@st.composite
def _laid_out(draw: st.DrawFn) -> tuple[str, WorkloadIdentity]:
    cid, kind = draw(_cids), draw(st.sampled_from(range(9)))
    n = draw(_users)
    manager = f"user.slice/user-{n}.slice/user@{n}.service"
    slices = "/".join(draw(_slices))
    if kind == 0:
        return f"system.slice/docker-{cid}.scope", container(Runtime.DOCKER, SD, cid=cid)
    if kind == 1:
        return f"docker/{cid}", container(Runtime.DOCKER, FS, cid=cid)
    if kind == 2:
        pod_id = draw(st.text(_HEX, min_size=64, max_size=64))
        in_pod = draw(st.booleans()) * f"machine-libpod_pod_{pod_id}.slice"
        return _path("machine.slice", in_pod, f"libpod-{cid}.scope"), container(
            Runtime.PODMAN, SD, cid=cid
        )
    if kind == 3:
        return _path(manager, slices, f"libpod-{cid}.scope"), container(
            Runtime.PODMAN, USER, cid=cid
        )
    if kind == 4:
        pod_id = draw(st.booleans()) * PODID
        return _path("libpod_parent", pod_id, f"libpod-{cid}"), container(
            Runtime.PODMAN, FS, cid=cid
        )
    if kind in (5, 6):  # a pod, or a container in it; systemd (5) or cgroupfs (6) driver
        uid, tier = draw(_pod_uids), draw(_tiers)
        if kind == 5:
            u = uid.replace("-", "_")
            top = "kubepods.slice"
            pod_path = (
                f"{top}/kubepods-pod{u}.slice"
                if tier is G
                else f"{top}/kubepods-{tier}.slice/kubepods-{tier}-pod{u}.slice"
            )
            prefix: str | None = draw(st.sampled_from(["cri-containerd", "crio", "docker"]))
            leaf, owner = f"{prefix}-{cid}.scope", SD
        else:
            pod_path = f"kubepods/pod{uid}" if tier is G else f"kubepods/{tier}/pod{uid}"
            prefix = draw(st.sampled_from([None, "crio"]))
            leaf, owner = (cid if prefix is None else f"crio-{cid}"), FS
        if draw(st.booleans()):
            return pod_path, pod(owner, tier, uid=uid)
        runtime = {None: Runtime.CONTAINERD, "cri-containerd": Runtime.CONTAINERD,
                   "crio": Runtime.CRIO, "docker": Runtime.DOCKER}[prefix]  # fmt: skip
        return f"{pod_path}/{leaf}", container(runtime, owner, cid=cid, pod_uid=uid, qos=tier)
    unit = draw(_units)
    if kind == 7:
        return _path("system.slice", slices, unit), service(unit)
    return _path(manager, slices, unit), service(unit, USER)


ANY = "any"
"""A random path: classify must not raise on it, whatever it is."""


@st.composite
def _cases(draw: st.DrawFn) -> tuple[str, WorkloadIdentity | str | None]:
    """A laid-out workload; one level below one (not a workload, unless the one above is a
    pod); or any well-formed path."""
    if draw(st.integers(0, 3)) == 3:  # (0 is what hypothesis draws most)
        return draw(_paths), ANY
    path, expected = draw(_laid_out())
    if expected.kind is not Kind.POD and draw(st.integers(0, 3)) == 3:
        return f"{path}/{draw(_component)}", None
    return path, replace(expected, path=path)


_ROOTS = st.sampled_from([ROOT, "system.slice/nodeagent.service/workloads"])


@given(case=_cases(), root=_ROOTS)
def test_classify_is_total_and_names_every_layout(
    case: tuple[str, WorkloadIdentity | str | None], root: str
) -> None:
    path, expected = case
    got = classify(path, root)  # never raises on a well-formed path
    if expected != ANY:
        assert got == expected


def reached(path: str, root: str) -> bool:
    """Whether the scan descends through every cgroup above `path` (it starts at the root)."""
    parts = path.split("/")
    above = ["/".join(parts[:n]) for n in range(1, len(parts))]
    return all(descends(classify(a, root), a, root) for a in above)


@pytest.mark.parametrize(("path", "expected"), WORKLOADS, ids=[p for p, _ in WORKLOADS])
def test_the_scan_reaches_every_layout(path: str, expected: WorkloadIdentity) -> None:
    assert reached(path, ROOT)


@given(case=_cases(), root=_ROOTS)
def test_the_scan_reaches_every_workload_classify_names(
    case: tuple[str, WorkloadIdentity | str | None], root: str
) -> None:
    path, _ = case
    if classify(path, root) is not None:
        assert reached(path, root)


def test_a_users_delegated_subtree_starts_at_the_user_manager() -> None:
    user = "user.slice/user-1000.slice/user@1000.service"
    assert delegated_root(user) == user
    assert delegated_root(f"{user}/app.slice/x.scope") == user
    for outside in (
        "user.slice/user-1000.slice",
        f"{user}x/a.slice",
        "system.slice/user@1000.service",
    ):
        assert delegated_root(outside) is None
    assert delegated_root("user.slice/user-1000.slice/user@1001.service/a.slice") is None


@given(job=_component)
def test_any_child_of_managed_root_is_a_job(job: str) -> None:
    ident = classify(f"{ROOT}/{job}", ROOT)
    assert ident is not None
    assert (ident.kind, ident.name, ident.owner) == (Kind.JOB, job, Owner.NODEAGENT)
