"""Issue 35: a `docker run --gpus` container's GPUs are a hold (kind runtime), so its own CUDA
processes on them are no GPU violation, while one on another GPU, or in a container given none,
still is.

The inspect answers are dockerd's shape (moby's api/types: `HostConfig.DeviceRequests[]` with
`Driver`, `Count`, `DeviceIDs`, `Capabilities`, `Options`; `HostConfig.Runtime`; `Config.Env`)
as the docker CLI writes them for each `--gpus` form (cli/opts/gpus.go); the real dockerd's
answers are read in tests/kernel/test_docker_gpus.py. Docker itself is a stand-in adapter
driven by those answers; the GPUs are test_gpu_policies' two fake ones, or a simulated node for
the agent's real tick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from builders import CGROUP_FILES, CID, CID2, docker_cgroupfs
from test_gpu_policies import G0, G1, state

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute, Frozen
from nodeagent.daemon import open_agent
from nodeagent.gpu.grants import NO_GPUS, GpuGrant, docker_gpus, granted, visible_devices
from nodeagent.gpu.model import GpuProcess, Hold, HoldKind
from nodeagent.identity import WorkloadIdentity
from nodeagent.meta import BadAnswer, ContainerMeta, Unavailable
from nodeagent.policy.gpu_checks import violations
from nodeagent.policyfile.model import PolicySpec
from nodeagent.runtimes.docker import DockerAdapter
from nodeagent.runtimes.gpus import RETRY_S, DockerGpus, RuntimeGpus

REPO = Path(__file__).resolve().parents[2]
CID3 = "77" * 32


def request(count: Any = 0, ids: Any = None, capabilities: Any = (("gpu",),)) -> dict[str, Any]:
    """One HostConfig.DeviceRequests entry as the docker CLI writes `--gpus`."""
    return {
        "Driver": "",
        "Count": count,
        "DeviceIDs": None if ids is None else list(ids),
        "Capabilities": [list(c) for c in capabilities],
        "Options": {},
    }


def inspect(
    requests: Sequence[Any] | None = None,
    runtime: str = "runc",
    env: Sequence[Any] = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",),
) -> dict[str, Any]:
    """dockerd's `GET /containers/{id}/json`, cut to what is read and a few fields beside
    (malformed ones too: what it is given is not checked)."""
    return {
        "Id": CID,
        "Name": "/trainer",
        "State": {"Status": "running", "Running": True, "Pid": 4242},
        "Config": {"Hostname": CID[:12], "Env": list(env), "Image": "nvidia/cuda:12.4.1-base"},
        "HostConfig": {
            "Runtime": runtime,
            "CgroupParent": "",
            "DeviceRequests": None if requests is None else list(requests),
            "Devices": [],
        },
    }


# --- what dockerd says it gave --------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "grant"),
    [
        # docker run --gpus all
        (inspect([request(count=-1)]), GpuGrant(True, (), "--gpus")),
        # docker run --gpus 2: indices 0 and 1 (moby's countToDevices)
        (inspect([request(count=2)]), GpuGrant(False, ("0", "1"), "--gpus")),
        # docker run --gpus '"device=1,GPU-xxxx"'
        (inspect([request(ids=["1", G1])]), GpuGrant(False, ("1", G1), "--gpus")),
        # --gpus 'device=0,capabilities=compute,utility': still the NVIDIA driver's
        (
            inspect([request(ids=["0"], capabilities=[["compute", "utility"]])]),
            GpuGrant(False, ("0",), "--gpus"),
        ),
        # Driver named outright
        (inspect([{**request(count=1), "Driver": "nvidia"}]), GpuGrant(False, ("0",), "--gpus")),
        # a device request for another driver's capability: no GPUs
        (inspect([request(count=-1, capabilities=[["rdma"]])]), NO_GPUS),
        (inspect([{**request(ids=["nvidia.com/gpu=0"]), "Driver": "cdi"}]), NO_GPUS),
        # no request at all (dockerd writes null), and Count 0 without ids (`void`)
        (inspect(), NO_GPUS),
        (inspect([]), NO_GPUS),
        (inspect([request(count=0)]), NO_GPUS),
        # the nvidia runtime reads the container's environment
        (
            inspect(runtime="nvidia", env=["NVIDIA_VISIBLE_DEVICES=0,GPU-bbbb"]),
            GpuGrant(False, ("0", G1), "the nvidia runtime"),
        ),
        (
            inspect(runtime="nvidia", env=["NVIDIA_VISIBLE_DEVICES=all"]),
            GpuGrant(True, (), "the nvidia runtime"),
        ),
        (inspect(runtime="nvidia", env=["NVIDIA_VISIBLE_DEVICES=none"]), NO_GPUS),
        (inspect(runtime="nvidia", env=["NVIDIA_VISIBLE_DEVICES=void"]), NO_GPUS),
        (inspect(runtime="nvidia", env=["NVIDIA_VISIBLE_DEVICES="]), NO_GPUS),
        (inspect(runtime="nvidia"), NO_GPUS),
        # a legacy CUDA image without the variable: all GPUs (nvidia-container-toolkit)
        (
            inspect(runtime="nvidia", env=["CUDA_VERSION=10.2"]),
            GpuGrant(True, (), "the nvidia runtime"),
        ),
        (
            inspect(runtime="nvidia", env=["CUDA_VERSION=12.4", "NVIDIA_REQUIRE_CUDA=cuda>=12.4"]),
            NO_GPUS,
        ),
        # the variable without the nvidia runtime gives nothing (runc ignores it)
        (inspect(env=["NVIDIA_VISIBLE_DEVICES=all"]), NO_GPUS),
        # both: what each gives
        (
            inspect([request(ids=["0"])], runtime="nvidia", env=["NVIDIA_VISIBLE_DEVICES=1"]),
            GpuGrant(False, ("0", "1"), "--gpus and the nvidia runtime"),
        ),
    ],
)
def test_what_dockerd_says_it_gave_a_container(answer: object, grant: GpuGrant) -> None:
    assert docker_gpus(answer) == grant


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ([], "the inspect answer is not a mapping"),
        ({"HostConfig": []}, "HostConfig is not a mapping"),
        ({"HostConfig": {"DeviceRequests": {}}}, "HostConfig.DeviceRequests is not a list"),
        (inspect([request(count=-1)] * 65), "HostConfig.DeviceRequests has 65 entries"),
        (inspect(["gpu"]), "HostConfig.DeviceRequests[0] is not a mapping"),
        (inspect([request(count="2")]), "HostConfig.DeviceRequests[0].Count is not an integer"),
        (inspect([request(count=True)]), "HostConfig.DeviceRequests[0].Count is not an integer"),
        (inspect([request(count=1 << 20)]), "HostConfig.DeviceRequests[0].Count is 1048576"),
        (inspect([request(ids=[str(i) for i in range(1025)])]), ".DeviceIDs has 1025 entries"),
        (inspect([request(ids=[7])]), ".DeviceIDs is not a string"),
        (inspect([request(ids=["x" * 5000])]), "bytes, more than 4096"),
        (inspect([{**request(), "Capabilities": ["gpu"]}]), ".Capabilities[] is not a list"),
        ({"HostConfig": {"Runtime": 3}}, "HostConfig.Runtime is not a string"),
        (inspect(runtime="nvidia", env=[None]), "an entry of Config.Env is not a string"),
        ({"HostConfig": {"Runtime": "nvidia"}, "Config": {"Env": "A=1"}}, "Config.Env is not"),
    ],
)
def test_a_malformed_answer_is_refused_whole(answer: object, why: str) -> None:
    with pytest.raises(BadAnswer) as info:
        docker_gpus(answer)
    assert why in str(info.value)


def test_visible_devices_reads_as_the_toolkit_reads_it() -> None:
    assert visible_devices(" all ") == (True, ())
    assert visible_devices("0, 1,,GPU-x") == (False, ("0", "1", "GPU-x"))
    assert visible_devices("none") == visible_devices("void") == (False, ())


def test_a_grant_names_the_nodes_gpus_by_index_or_uuid_and_says_what_is_not_here() -> None:
    gpus = state((), ())
    assert granted(GpuGrant(True), gpus) == ((G0, G1), ())
    assert granted(GpuGrant(False, ("1", G0)), gpus) == ((G0, G1), ())
    assert granted(GpuGrant(False, ("7", "GPU-elsewhere", "1")), gpus) == (
        (G1,),
        ("7", "GPU-elsewhere"),
    )


# --- the join ---------------------------------------------------------------------------------


class StandInDocker(DockerAdapter):
    """Docker's adapter with dockerd's inspect answers given (`answers`, by id), or none
    (`down`); everything else as the real adapter does it, on no socket."""

    def __init__(self, answers: Mapping[str, object], names: Mapping[str, str]) -> None:
        super().__init__("/run/stand-in/docker.sock", 1.0)
        self.answers = dict(answers)
        self.names = dict(names)
        self.down = False
        self.asked: list[str] = []

    def gpus(self, container_id: str) -> GpuGrant | None:
        self.asked.append(container_id)
        if self.down:
            raise Unavailable(f"no socket at {self.socket}")
        answer = self.answers.get(container_id)
        return None if answer is None else docker_gpus(answer)

    def container(self, container_id: str) -> ContainerMeta | None:
        named = self.names.get(container_id)
        return None if named is None else ContainerMeta("docker", name=named)

    def ping(self) -> None:
        if self.down:
            raise Unavailable(f"no socket at {self.socket}")

    def creations(self) -> None:
        return None

    def changed(self, since: float, until: float) -> set[str] | None:
        return set()


TRAINER = docker_cgroupfs(CID)
PLAIN = docker_cgroupfs(CID2)


def named(i: WorkloadIdentity, name: str) -> WorkloadIdentity:
    return replace(i, meta=ContainerMeta("docker", name=name))


CONTAINERS = [named(TRAINER, "trainer"), named(PLAIN, "plain")]
PROCESSES = (
    GpuProcess(10, G0, None, TRAINER.path),  # on the GPU it was given
    GpuProcess(11, G1, None, TRAINER.path + "/worker"),  # on one it was not
    GpuProcess(12, G0, None, PLAIN.path),  # a container given no GPU
    GpuProcess(13, G1, None, "system.slice/stray.service"),  # no container at all
)


def stand_in() -> StandInDocker:
    return StandInDocker(
        {CID: inspect([request(ids=["0"])]), CID2: inspect()}, {CID: "trainer", CID2: "plain"}
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def judged(holds: tuple[Hold, ...], processes: tuple[GpuProcess, ...] = PROCESSES) -> list[Any]:
    return [(p.pid, kind) for p, kind, _ in violations(state(processes, holds))]


def test_a_containers_own_gpu_is_held_and_only_a_process_nobody_granted_is_a_violation() -> None:
    docker, gpus = stand_in(), RuntimeGpus()
    classes = {TRAINER.path: "training"}
    holds = gpus.holds(DockerGpus(docker), state(PROCESSES, ()), CONTAINERS, classes, ())
    assert holds == (
        Hold("docker:trainer", HoldKind.RUNTIME, (G0,), (0,), None, TRAINER.path, "training"),
    )
    assert judged(()) == [(10, "unassigned"), (11, "unassigned"), (12, "unassigned"),
                          (13, "unassigned")]  # fmt: skip
    assert judged(holds) == [(11, "wrong-gpu"), (12, "unassigned"), (13, "unassigned")]
    assert sorted(docker.asked) == sorted([CID, CID2])  # the stray service's is nobody's to ask


def test_each_container_is_asked_once_for_its_life_and_forgotten_when_its_cgroup_goes() -> None:
    docker, gpus = stand_in(), RuntimeGpus()
    gpu_state = state(PROCESSES, ())
    for _ in range(3):
        assert [h.owner for h in gpus.holds(DockerGpus(docker), gpu_state, CONTAINERS, {}, ())] == [
            "docker:trainer"
        ]
    assert sorted(docker.asked) == sorted([CID, CID2])
    # the trainer's cgroup is gone: forgotten; a container of the same id is asked again
    assert gpus.holds(DockerGpus(docker), gpu_state, CONTAINERS[1:], {}, ()) == ()
    docker.answers[CID] = inspect([request(count=-1)])
    holds = gpus.holds(DockerGpus(docker), gpu_state, CONTAINERS, {}, ())
    assert [(h.owner, h.uuids) for h in holds] == [("docker:trainer", (G0, G1))]
    assert docker.asked.count(CID) == 2 and docker.asked.count(CID2) == 1


def test_nothing_is_asked_without_a_gpu_process_or_where_a_hold_already_covers_it() -> None:
    docker, gpus = stand_in(), RuntimeGpus()
    assert gpus.holds(DockerGpus(docker), state((), ()), CONTAINERS, {}, ()) == ()
    reserved = Hold("mine", HoldKind.RESERVATION, (G0,), (0,), cgroup=TRAINER.path, id="r1")
    covered = (PROCESSES[0],)
    held = gpus.holds(DockerGpus(docker), state(covered, (reserved,)), CONTAINERS, {}, (reserved,))
    assert held == ()
    assert docker.asked == []
    # the same container on a GPU the reservation does not cover: asked
    gpus.holds(DockerGpus(docker), state(PROCESSES[:2], (reserved,)), CONTAINERS, {}, (reserved,))
    assert docker.asked == [CID]


def test_dockerd_down_holds_nothing_says_so_once_and_is_asked_again_later() -> None:
    docker, clock = stand_in(), Clock()
    gpus = RuntimeGpus(clock)
    docker.down = True
    gpu_state = state(PROCESSES, ())
    with structlog.testing.capture_logs() as logs:
        for _ in range(4):
            assert gpus.holds(DockerGpus(docker), gpu_state, CONTAINERS, {}, ()) == ()
            clock.now += 1
        assert len(docker.asked) == 1  # left alone RETRY_S
        clock.now += RETRY_S
        assert gpus.holds(DockerGpus(docker), gpu_state, CONTAINERS, {}, ()) == ()
        assert len(docker.asked) == 2
        docker.down = False
        clock.now += RETRY_S
        holds = gpus.holds(DockerGpus(docker), gpu_state, CONTAINERS, {}, ())
    assert [h.owner for h in holds] == ["docker:trainer"]
    assert [e["event"] for e in logs] == ["runtime.gpus_unavailable", "runtime.gpus_available"]
    assert logs[0]["error"] == "no socket at /run/stand-in/docker.sock"


def test_a_malformed_answer_is_refused_for_that_container_said_once_not_asked_again() -> None:
    docker, gpus = stand_in(), RuntimeGpus()
    docker.answers[CID] = inspect([request(count="all")])
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert gpus.holds(DockerGpus(docker), state(PROCESSES, ()), CONTAINERS, {}, ()) == ()
    assert [e["event"] for e in logs] == ["runtime.gpus_refused"]
    assert "Count is not an integer" in logs[0]["message"]
    assert docker.asked.count(CID) == 1


def test_gpus_this_node_does_not_have_are_said_once_and_held_only_where_they_are() -> None:
    docker, gpus = stand_in(), RuntimeGpus()
    docker.answers[CID] = inspect([request(ids=["0", "GPU-elsewhere"])])
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):
            holds = gpus.holds(DockerGpus(docker), state(PROCESSES, ()), CONTAINERS, {}, ())
    assert [h.uuids for h in holds] == [(G0,)]
    assert [e["event"] for e in logs] == ["runtime.gpus_unknown"]
    assert "docker:trainer was given GPU-elsewhere (--gpus)" in logs[0]["message"]


def test_without_docker_nothing_is_held() -> None:
    assert RuntimeGpus().holds(None, state(PROCESSES, ()), CONTAINERS, {}, ()) == ()


# --- the agent's real tick --------------------------------------------------------------------


def node(tmp_path: Path, processes: list[dict[str, Any]]) -> str:
    description = yaml.safe_load((REPO / "config/gpus/4x-a100-two-nvlink-pairs.yaml").read_text())
    description["processes"] = processes
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(description))
    return str(path)


def test_the_agents_tick_holds_a_docker_containers_gpus_and_judges_only_the_others(
    tmp_path: Path,
) -> None:
    root = tmp_path / "cgroup"
    for path in ["docker", *(f"docker/{c}" for c in (CID, CID2, CID3))]:
        (root / path).mkdir(parents=True, exist_ok=True)
        for name, text in {**CGROUP_FILES, "cgroup.freeze": "0\n"}.items():
            (root / path / name).write_text(text)
    processes = [
        {"pid": 201, "gpu": 1, "memory": "10Gi", "cgroup": f"docker/{CID}"},  # given 1 and 2
        {"pid": 202, "gpu": 3, "memory": "1Gi", "cgroup": f"docker/{CID}"},  # not given 3
        {"pid": 203, "gpu": 0, "memory": "1Gi", "cgroup": f"docker/{CID2}"},  # given none
        {"pid": 204, "gpu": 2, "memory": "1Gi", "cgroup": f"docker/{CID3}"},  # --gpus all
    ]
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"state_file": str(tmp_path / "state.json")},
            "gpu": {"simulate": node(tmp_path, processes), "on_violation": "freeze"},
            "tenants": {"a": {"shares": 1}},
            "rules": [{"name": "docker", "match": {"runtime": "docker"}, "tenant": "a"}],
        }
    )
    a = open_agent(spec, CgroupTree(str(root)), dry_run=True)
    docker = StandInDocker(
        {
            CID: inspect([request(ids=["1", "2"])]),
            CID2: inspect(),
            CID3: inspect([request(count=-1)]),
        },
        {CID: "trainer", CID2: "plain", CID3: "everything"},
    )
    a.rec.runtimes.adapters["docker"] = docker
    a.rec.registry.resync()
    record = a.tick()
    assert record.snapshot.gpus is not None
    gpu = [d.uuid for d in record.snapshot.gpus.devices]
    assert {h.owner: (h.kind, h.uuids, h.cgroup) for h in record.snapshot.gpus.holds} == {
        "docker:trainer": ("runtime", tuple(sorted(gpu[1:3])), f"docker/{CID}"),
        "docker:everything": ("runtime", tuple(sorted(gpu)), f"docker/{CID3}"),
    }
    found = {
        n.fields["pid"]: (n.status, n.path) for n in record.plan.notes if n.kind == "gpu-violation"
    }
    assert found == {202: ("wrong-gpu", f"docker/{CID}"), 203: ("unassigned", f"docker/{CID2}")}
    frozen = {
        c.path
        for c in record.plan.cgroups
        if Attribute.FREEZE in c.targets and c.targets[Attribute.FREEZE].value == Frozen(True)
    }
    assert frozen == {f"docker/{CID}", f"docker/{CID2}"}
    # the answers are kept: the next ticks ask nothing; the GPUs are never the ledger's
    a.tick()
    a.tick()
    assert sorted(docker.asked) == sorted([CID, CID2, CID3])
    assert a.rec.gpus.ledger.holds() == ()
    assert a.rec.gpus.ledger.dump(0.0, 0.0) == []


def test_the_tick_goes_on_with_dockerd_down(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    for path in ["docker", f"docker/{CID}"]:
        (root / path).mkdir(parents=True, exist_ok=True)
        for name, text in {**CGROUP_FILES, "cgroup.freeze": "0\n"}.items():
            (root / path / name).write_text(text)
    processes = [{"pid": 201, "gpu": 1, "memory": "10Gi", "cgroup": f"docker/{CID}"}]
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"state_file": str(tmp_path / "state.json")},
            "gpu": {"simulate": node(tmp_path, processes)},
            "tenants": {"a": {"shares": 1}},
            "rules": [{"name": "docker", "match": {"runtime": "docker"}, "tenant": "a"}],
        }
    )
    a = open_agent(spec, CgroupTree(str(root)), dry_run=True)
    docker = StandInDocker({CID: inspect([request(ids=["1"])])}, {CID: "trainer"})
    docker.down = True
    a.rec.runtimes.adapters["docker"] = docker
    a.rec.registry.resync()
    with structlog.testing.capture_logs() as logs:
        first, second = a.tick(), a.tick()
    for record in (first, second):
        assert record.snapshot.gpus is not None and record.snapshot.gpus.holds == ()
        statuses = [n.status for n in record.plan.notes if n.kind == "gpu-violation"]
        assert statuses == ["unassigned"]
    assert [e["event"] for e in logs].count("runtime.gpus_unavailable") == 1


def test_an_adapters_bug_costs_that_container_alone_and_never_the_tick() -> None:
    class Broken(StandInDocker):
        def gpus(self, container_id: str) -> GpuGrant | None:
            self.asked.append(container_id)
            if container_id == CID2:
                raise KeyError("a bug")
            return super().gpus(container_id)

    docker, gpus = Broken({CID: inspect([request(ids=["0"])])}, {}), RuntimeGpus()
    with structlog.testing.capture_logs() as logs:
        holds = gpus.holds(DockerGpus(docker), state(PROCESSES, ()), CONTAINERS, {}, ())
    assert [h.owner for h in holds] == ["docker:trainer"]
    assert [e["event"] for e in logs] == ["runtime.gpus_refused"]
    assert "KeyError" in logs[0]["message"]
