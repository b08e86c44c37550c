"""Issue 35: what a real dockerd (Debian's, tests/kernel/runtimes.py, cgroupfs driver) says it
gave a `docker run --gpus` container, read as nodeagent reads it (nodeagent.gpu.grants through
the Docker adapter's inspect), and made into the container's hold (nodeagent.runtimes.gpus).

The containers are created, never started: the VM has no NVIDIA runtime or hook, so a start
would fail. dockerd keeps a container's DeviceRequests from its creation, as the docker CLI
wrote them, so the inspect answer read here is the one a started container's would be. The
GPUs are two simulated ones (no GPU in the VM), and the container's cgroup is where the
cgroupfs driver will put it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import runtimes as rt

from nodeagent.gpu.grants import NO_GPUS, GpuGrant
from nodeagent.gpu.model import Device, GpuProcess, GpuState, HoldKind, Topology
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.meta import ContainerMeta
from nodeagent.policy.gpu_checks import violations
from nodeagent.runtimes.docker import DockerAdapter
from nodeagent.runtimes.gpus import DockerGpus, RuntimeGpus

G0, G1, G2 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111", "GPU-22222222"
DEVICES = tuple(
    Device(i, u, "simulated GPU", f"0000:0{i}:00.0", i, 80 << 30, 0, (), None, simulated=True)
    for i, u in enumerate((G0, G1, G2))
)


@pytest.fixture
def docker(cgroupfs_runtimes: rt.Runtimes) -> Iterator[rt.Runtimes]:
    """The run's cgroupfs runtimes (conftest.py), without the containers made here after."""
    try:
        yield cgroupfs_runtimes
    finally:
        cgroupfs_runtimes.remove_containers()


def create(r: rt.Runtimes, name: str, *options: str) -> rt.Container:
    """A container created (not started) by the real docker CLI."""
    cid = r.docker(
        "create", "--name", name, "--network", "none",
        "--security-opt", "apparmor=unconfined", *options, rt.IMAGE, "sleep", "3600",
    )  # fmt: skip
    container = rt.Container("docker", cid, name, r.cgroup_of("docker", cid))
    r.containers.append(container)
    return container


def identity(r: rt.Runtimes, c: rt.Container) -> WorkloadIdentity:
    path = str(c.cgroup.relative_to(r.sandbox_root))
    return WorkloadIdentity(
        path, Kind.CONTAINER, Runtime.DOCKER, Owner.CGROUPFS, c.name, container_id=c.id,
        meta=ContainerMeta("docker", name=c.name),
    )  # fmt: skip


def test_real_dockerd_gpu_requests_read_into_grants_and_holds(docker: rt.Runtimes) -> None:
    r = docker
    adapter = DockerAdapter(r.paths.docker, 30.0)
    two = create(r, "gpus-two", "--gpus", '"device=0,2"')
    every = create(r, "gpus-all", "--gpus", "all")
    counted = create(r, "gpus-count", "--gpus", "2")
    plain = create(r, "gpus-none")

    assert adapter.gpus(two.id) == GpuGrant(False, ("0", "2"), "--gpus")
    assert adapter.gpus(every.id) == GpuGrant(True, (), "--gpus")
    assert adapter.gpus(counted.id) == GpuGrant(False, ("0", "1"), "--gpus")
    assert adapter.gpus(plain.id) == NO_GPUS
    assert adapter.gpus("0" * 64) is None  # unknown to dockerd: 404

    # the join: a process of the container on a GPU it was given is no violation; one on
    # the GPU it was not, or in the container given none, is
    ids = [identity(r, c) for c in (two, every, plain)]
    paths = [i.path for i in ids]
    processes = (
        GpuProcess(10, G2, None, paths[0]),
        GpuProcess(11, G1, None, paths[0]),
        GpuProcess(12, G1, None, paths[1]),
        GpuProcess(13, G0, None, paths[2]),
    )
    state = GpuState(DEVICES, Topology(), (), processes, (), "simulated", True)
    gpus = RuntimeGpus()
    holds = gpus.holds(DockerGpus(adapter), state, ids, {}, ())
    assert [(h.owner, h.kind, h.uuids, h.indices, h.cgroup) for h in holds] == sorted(
        [
            ("docker:gpus-two", HoldKind.RUNTIME, (G0, G2), (0, 2), paths[0]),
            ("docker:gpus-all", HoldKind.RUNTIME, (G0, G1, G2), (0, 1, 2), paths[1]),
        ],
        key=lambda h: str(h[4]),
    )
    judged = GpuState(DEVICES, Topology(), (), processes, holds, "simulated", True)
    assert [(p.pid, kind) for p, kind, _ in violations(judged)] == [
        (11, "wrong-gpu"),
        (13, "unassigned"),
    ]
    assert gpus.asked == 3
    gpus.holds(DockerGpus(adapter), state, ids, {}, ())
    assert gpus.asked == 3  # kept for the containers' lives
