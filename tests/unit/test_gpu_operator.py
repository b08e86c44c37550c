"""The GPU path an operator meets, through the daemon's GPU routes on a real Unix socket and
the installed CLI: a simulated node (config/gpus/, a labelled stand-in: no GPU here) whose
GPU 0 runs pid 31337 and GPU 2 pid 4711, neither under any hold.

Busy GPUs are never handed out to exclusive requests (ask, reserve, place); `gpus place`
asks the daemon and says when it could not; an impossible request is refused at once; the
reserve output survives `docker run $(...)` as docs/commands.md writes it, checked by a stand-in
`docker` that records its arguments and parses --gpus as docker's CSV reader does.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cli import REPO, assert_one_line_error, nodeagent

from nodeagent.api import client
from nodeagent.api.client import ApiRefused
from nodeagent.api.server import ApiServer, Routes
from nodeagent.commands import Commands
from nodeagent.gpu.backend import NoGpus
from nodeagent.gpu.simulated import load_simulated
from nodeagent.gpualloc.service import GpuService
from nodeagent.policyfile.model import PolicySpec
from nodeagent.routes.gpus import GpuRoutes
from nodeagent.wakeup import Wakeup

PAIRS = str(REPO / "config" / "gpus" / "4x-a100-two-nvlink-pairs.yaml")
MIG = str(REPO / "config" / "gpus" / "h100-mig.yaml")
SPEC = PolicySpec.model_validate(
    {"version": 1, "tenants": {"research": {"shares": 1}}, "jobs": {"default_tenant": "research"}}
)
UUIDS = [d.uuid for d in load_simulated(PAIRS).inventory()]


def routes(service: GpuService) -> Routes:
    """The /v1/gpus routes over `service`, as the daemon serves them (no fair-share usage)."""
    routes = GpuRoutes(service, lambda: SPEC, lambda tenant: 0.0).routes()
    return Commands(Wakeup()).serve(routes, then=service.publish)


def start(node: str) -> Iterator[tuple[GpuService, str]]:
    """The daemon's GPU side, one tick sensed, serving its routes on a fresh socket."""
    service = GpuService(load_simulated(node), lambda: SPEC, lambda cg: True)
    service.sense(0.0)
    where = Path(tempfile.mkdtemp(prefix="nodeagent-gpu-"))
    server = ApiServer(str(where / "api.sock"), routes(service))
    server.start()
    try:
        yield service, str(where / "api.sock")
    finally:
        server.close()
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def daemon() -> Iterator[tuple[GpuService, str]]:
    yield from start(PAIRS)


def ask(sock: str, name: str, **want: object) -> dict[str, object]:
    answer = client.post(sock, "/v1/gpus/requests", {"name": name, **want})
    assert isinstance(answer, dict)
    return answer


def reserve(sock: str, name: str, **want: object) -> dict[str, object]:
    answer = client.post(sock, "/v1/gpus/reservations", {"name": name, **want})
    assert isinstance(answer, dict)
    return answer


# --- 13.7: busy GPUs -------------------------------------------------------------------


def test_requests_and_reservations_pass_over_gpus_that_other_processes_use(
    daemon: tuple[GpuService, str],
) -> None:
    service, sock = daemon
    first = ask(sock, "train", count=1)  # what `exec --gpus 1` asks
    assert (first["status"], first["uuids"]) == ("granted", [UUIDS[1]])
    web = reserve(sock, "web-1", count=1)
    assert web["uuids"] == [UUIDS[3]]
    more = ask(sock, "more", count=1)
    assert more["status"] == "waiting"
    assert more["reason"] == (
        "no 1 GPU free now: 0 of 4 eligible "
        "(2 busy with compute processes outside any hold, 2 held); first in line: GPU 1 is"
        " kept for it, free once train ends (a hold in the way has no expected end)"
    )
    assert {u for h in service.ledger.holds() for u in h.uuids} == {UUIDS[1], UUIDS[3]}


# --- 13.9: place asks the daemon ---------------------------------------------------------


def test_place_asks_the_daemon_and_places_against_its_holds(
    daemon: tuple[GpuService, str],
) -> None:
    service, sock = daemon
    reserve(sock, "web-1", count=1)  # GPU 1
    before = service.ledger.holds()
    proc = nodeagent("gpus", "place", "--socket", sock, "--count", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "would place on GPU 3 (simulated node; nothing reserved)"
    assert lines[-1].startswith("why: "), "no note: the daemon's holds were considered"
    assert service.ledger.holds() == before, "read-only"
    answer = client.get(sock, "/v1/gpus/place", {"count": "2"})
    assert isinstance(answer, dict)
    assert (answer["placed"], answer["holds_considered"]) == (False, True)
    assert answer["reason"] == (
        "no 2 GPUs free now: 1 of 4 eligible "
        "(2 busy with compute processes outside any hold, 1 held)"
    )
    proc = nodeagent("gpus", "place", "--socket", sock, "--count", "2")
    assert proc.returncode == 1 and proc.stdout.startswith("nothing fits now: no 2 GPUs free now")


def test_place_with_the_daemon_refuses_bad_input_as_a_usage_error(
    daemon: tuple[GpuService, str],
) -> None:
    _, sock = daemon
    proc = nodeagent("gpus", "place", "--socket", sock, "--busy", "9")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr == (
        "nodeagent gpus place: error: Invalid value for --busy: no GPU or MIG device '9' on this"
        " node (indices 0-3) (see 'nodeagent gpus place --help')\n"
    )
    proc = nodeagent("gpus", "place", "--socket", sock, "--count", "9")
    assert proc.returncode == 2 and "Invalid value for --count: this node has 4 GPUs" in proc.stderr
    with pytest.raises(ApiRefused, match=r"^numa: no GPU is on NUMA node 5") as info:
        client.get(sock, "/v1/gpus/place", {"numa": "5"})
    assert info.value.status == 400
    with pytest.raises(ApiRefused, match=r"^colour: not a placement question's key"):
        client.get(sock, "/v1/gpus/place", {"colour": "red"})


def test_place_without_a_daemon_says_holds_were_not_considered(tmp_path: Path) -> None:
    proc = nodeagent(
        "gpus", "place", "--socket", str(tmp_path / "none.sock"), NODEAGENT_GPU_SIM=PAIRS
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "would place on GPU 1 (simulated node; nothing reserved)"
    assert lines[-1] == "(no daemon: holds not considered)"


# --- 13.10: impossible requests are refused at once --------------------------------------


@pytest.mark.parametrize(
    ("node", "want", "message"),
    [
        (PAIRS, {"count": 9}, "this node has 4 GPUs"),
        (PAIRS, {"memory": 100 << 30}, "no GPU on this node has 100.0Gi: the largest has 80.0Gi"),
        (
            MIG,
            {"mig": "7g.80gb"},
            "this node has no MIG instances of profile 7g.80gb (its profiles: 1g.10gb, 2g.20gb, "
            "3g.40gb)",
        ),
        (MIG, {"count": 1}, "this node has 1 GPU, 1 in MIG mode (given out only as MIG instances)"),
    ],
)
def test_an_impossible_request_is_refused_at_once(
    node: str, want: dict[str, object], message: str
) -> None:
    for service, sock in start(node):
        for route in ("/v1/gpus/requests", "/v1/gpus/reservations"):
            with pytest.raises(ApiRefused) as info:
                client.post(sock, route, {"name": "big", **want})
            assert info.value.status == 400
            assert str(info.value).startswith(message), str(info.value)
            assert str(info.value).endswith("; the request can never be placed here")
        assert service.ledger.queue() == [] and service.ledger.holds() == ()


def test_exec_of_more_gpus_than_the_node_has_fails_at_once(
    daemon: tuple[GpuService, str],
) -> None:
    _, sock = daemon
    proc = nodeagent("exec", "--socket", sock, "--gpus", "9", "--gpu-timeout", "5s", "--", "true")
    assert assert_one_line_error(proc) == (
        "nodeagent: error: this node has 4 GPUs; the request can never be placed here"
    )


# --- 13.8: the reserve output survives a shell -------------------------------------------


def go_csv_record(text: str) -> list[str]:
    """One record as Go's encoding/csv reads it (docker parses --gpus so): a field that
    starts with a double quote runs to the closing one ("" inside is a quote); a quote in
    any other field is 'bare " in non-quoted-field'."""
    fields, i = [], 0
    while True:
        if text.startswith('"', i):
            value, i = "", i + 1
            while True:
                end = text.find('"', i)
                if end < 0:
                    raise ValueError('extraneous or missing " in quoted-field')
                value += text[i:end]
                if text.startswith('""', end):
                    value, i = value + '"', end + 2
                    continue
                i = end + 1
                break
            if i < len(text) and text[i] != ",":
                raise ValueError('extraneous or missing " in quoted-field')
        else:
            end = text.find(",", i)
            value = text[i:] if end < 0 else text[i:end]
            if '"' in value:
                raise ValueError('bare " in non-quoted-field')
            i = len(text) if end < 0 else end
        fields.append(value)
        if i >= len(text):
            return fields
        i += 1


def docker_gpu_ids(argv: list[str]) -> list[str]:
    """The device IDs `docker run` would take from its --gpus argument (opts/gpus.go)."""
    value = argv[argv.index("--gpus") + 1]
    ids: list[str] = []
    for field in go_csv_record(value):
        key, _, val = field.partition("=")
        assert key == "device", field
        ids += val.split(",")
    return ids


@pytest.fixture
def fake_docker(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A stand-in `docker` first on PATH that writes its arguments, NUL-separated."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv"
    script = bin_dir / "docker"
    script.write_text(f'#!/bin/sh\nfor a in "$@"; do printf \'%s\\0\' "$a"; done > {record}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    here = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k != "NODEAGENT_SOCKET"}
    env["PATH"] = f"{bin_dir}:{here}:{env.get('PATH', '/usr/bin:/bin')}"
    return env, record


def through_sh(command: str, env: dict[str, str], record: Path) -> list[str]:
    proc = subprocess.run(
        ["sh", "-c", command], env=env, capture_output=True, text=True, check=False, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return record.read_text().split("\0")[:-1]


@pytest.mark.parametrize("count", [1, 2])
def test_reserve_output_reaches_docker_as_its_gpus(
    daemon: tuple[GpuService, str], fake_docker: tuple[dict[str, str], Path], count: int
) -> None:
    service, sock = daemon
    env, record = fake_docker
    argv = through_sh(
        f"docker run $(nodeagent gpus reserve --socket {sock} --name web-1 --count {count}) img",
        env,
        record,
    )
    (hold,) = service.ledger.holds()
    assert argv[0] == "run" and argv[-1] == "img"  # docker create takes the same arguments
    assert docker_gpu_ids(argv) == list(hold.uuids) == [UUIDS[1], UUIDS[3]][:count]


def test_the_readme_recipe_runs(
    daemon: tuple[GpuService, str], fake_docker: tuple[dict[str, str], Path]
) -> None:
    service, sock = daemon
    env, record = fake_docker
    readme = (REPO / "docs" / "commands.md").read_text() + (REPO / "docs" / "gpus.md").read_text()
    recipes = set(
        re.findall(
            r"docker (?:run|create) \$\(nodeagent gpus reserve --name [^)`]*\) [A-Z]+", readme
        )
    )
    assert recipes, "docs/commands.md shows docker create $(nodeagent gpus reserve ...)"
    for recipe in sorted(recipes):
        argv = through_sh(recipe, env | {"NODEAGENT_SOCKET": sock}, record)
        (hold,) = service.ledger.holds()
        assert docker_gpu_ids(argv) == list(hold.uuids), recipe
        client.delete(sock, "/v1/gpus/reservations", {"name": hold.owner})


def test_the_old_single_quoted_form_is_what_docker_refused() -> None:
    """The stand-in parser says what docker said (rc 125) to the output before the fix."""
    with pytest.raises(ValueError, match='bare " in non-quoted-field'):
        go_csv_record("'\"device=GPU-a,GPU-b\"'")
    assert go_csv_record('"device=GPU-a,GPU-b"') == ["device=GPU-a,GPU-b"]


def test_reserve_json_and_env(daemon: tuple[GpuService, str]) -> None:
    _, sock = daemon
    proc = nodeagent("gpus", "reserve", "--socket", sock, "--name", "a", "--json")
    assert proc.returncode == 0, proc.stderr
    import json

    data = json.loads(proc.stdout)
    assert (data["apiVersion"], data["kind"]) == ("nodeagent/v1", "GpuReservation")
    assert (data["name"], data["uuids"], data["indices"]) == ("a", [UUIDS[1]], [1])
    assert time.time() < data["until_timestamp_seconds"] <= time.time() + 600
    assert 0 < data["score_fraction"] <= 1
    alias = nodeagent("gpus", "reserve", "--socket", sock, "--name", "b", "--format", "json")
    same = json.loads(alias.stdout)
    assert same["uuids"] == [UUIDS[3]]
    assert list(same) == list(data), "--format json is --json"
    client.delete(sock, "/v1/gpus/reservations", {"name": "a"})
    env = nodeagent("gpus", "reserve", "--socket", sock, "--name", "c", "--format", "env")
    assert env.stdout.splitlines() == [
        f"CUDA_VISIBLE_DEVICES={UUIDS[1]}",
        f"NVIDIA_VISIBLE_DEVICES={UUIDS[1]}",
        "CUDA_DEVICE_ORDER=PCI_BUS_ID",
    ]


def test_place_beside_a_daemon_without_gpus_reads_the_gpus_itself() -> None:
    service = GpuService(NoGpus("NVML found no GPUs"), lambda: SPEC, lambda c: True)
    service.sense(0.0)
    where = Path(tempfile.mkdtemp(prefix="nodeagent-gpu-"))
    with ApiServer(str(where / "api.sock"), routes(service)):
        sock = str(where / "api.sock")
        proc = nodeagent("gpus", "place", "--socket", sock, NODEAGENT_GPU_SIM=PAIRS)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1] == (
            "(the daemon gave no placement (this node has no GPUs the agent can use "
            "(NVML found no GPUs)): holds not considered)"
        )
    shutil.rmtree(where, ignore_errors=True)


# --- issue 18.7: durations ------------------------------------------------------------


def test_a_request_s_deadline_work_and_cpus_say_when_its_gpus_come_back(
    daemon: tuple[GpuService, str],
) -> None:
    """What `exec --gpus 1 --deadline +1h --work 1800 --cpus 2` asks: 1800 CPU-seconds on 2
    CPUs end in 900 s, before the deadline; the grant's hold expects its GPU back then."""
    service, sock = daemon
    before = time.monotonic()
    got = ask(sock, "train", count=1, deadline=time.time() + 3600, work=1800, cpus=2)
    assert got["status"] == "granted"
    (hold,) = service.ledger.holds()
    assert hold.since is not None and hold.expected_end is not None
    assert before <= hold.since <= time.monotonic()
    assert hold.expected_end - hold.since == pytest.approx(900.0)
    with pytest.raises(ApiRefused, match="work"):
        ask(sock, "bad", count=1, work=-1)
