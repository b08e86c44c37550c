"""`nodeagent gpus reserve`, `gpus attach` and `gpus release` against the daemon's own GPU
routes, served on a real Unix socket (the daemon on a plain tree with a simulated node, as
in daemon_api; the caller is this process, root)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_api import CID, ROOT, Daemon, daemon, mkdirs
from test_cli import nodeagent

from nodeagent.api.server import ApiServer


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Daemon, str]]:
    d = daemon(tmp_path)
    sockdir = Path(tempfile.mkdtemp(prefix="nodeagent-reserve-"))
    server = ApiServer(str(sockdir / "api.sock"), d.agent.routes())
    server.start()
    try:
        yield d, server.socket_path
    finally:
        server.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def cli(*args: str, code: int = 0) -> str:
    """The CLI in its own process (this one's log lines are the daemon's); what it printed."""
    proc = nodeagent(*args)
    assert proc.returncode == code, proc.stderr
    return proc.stdout + proc.stderr


def test_reserve_names_its_container_and_release_gives_it_back(
    served: tuple[Daemon, str],
) -> None:
    d, sock = served
    out = cli("gpus", "reserve", "--socket", sock, "--name", "web", "--container", CID[:12],
              "--class", "inference", "--format", "json")  # fmt: skip
    got = json.loads(out)
    assert (got["apiVersion"], got["kind"]) == ("nodeagent/v1", "GpuReservation")
    assert got["container"] == CID[:12] and len(got["uuids"]) == 1
    (hold,) = d.agent.rec.gpus.ledger.holds()
    assert (hold.container, hold.workload_class, hold.tenant) == (CID[:12], "inference", "research")
    assert cli("gpus", "release", "--socket", sock, "web") == "released web\n"
    assert d.holds() == []


def test_attach_names_the_container_later(served: tuple[Daemon, str]) -> None:
    d, sock = served
    cli("gpus", "reserve", "--socket", sock, "--name", "web", "--format", "env")
    assert cli("gpus", "attach", "--socket", sock, "web", CID) == f"reservation web is for {CID}\n"
    mkdirs(d.root, f"system.slice/docker-{CID}.scope")
    d.agent.rec.registry.resync()
    d.agent.tick()
    assert d.agent.rec.gpus.ledger.holds()[0].cgroup == f"system.slice/docker-{CID}.scope"
    out = cli("gpus", "attach", "--socket", sock, "web", CID, code=1)
    assert "is bound to system.slice/docker-" in out


def test_a_jobs_gpus_are_not_released_by_name(served: tuple[Daemon, str]) -> None:
    d, sock = served
    grant = d.ask(ROOT, "train")
    d.start(ROOT, "train", gpu_request=grant["id"])
    out = cli("gpus", "release", "--socket", sock, "train", code=1)
    assert "only reservations are released by name" in out
    assert d.holds() == [("train", "job")]


def test_reserve_prints_docker_arguments_or_an_env_file_for_the_held_gpus(
    served: tuple[Daemon, str],
) -> None:
    d, sock = served
    out = cli("gpus", "reserve", "--socket", sock, "--name", "web", "--count", "2")
    (hold,) = d.agent.rec.gpus.ledger.holds()
    assert len(hold.uuids) == 2
    assert out == f'--gpus "device={",".join(hold.uuids)}"\n'  # quoted: one word for docker
    cli("gpus", "release", "--socket", sock, "web")
    out = cli("gpus", "reserve", "--socket", sock, "--name", "infer", "--format", "env")
    (hold,) = d.agent.rec.gpus.ledger.holds()
    (gpu,) = hold.uuids
    assert out == (
        f"CUDA_VISIBLE_DEVICES={gpu}\nNVIDIA_VISIBLE_DEVICES={gpu}\nCUDA_DEVICE_ORDER=PCI_BUS_ID\n"
    )


def test_a_reservation_that_does_not_fit_is_one_line_and_holds_nothing(
    served: tuple[Daemon, str],
) -> None:
    d, sock = served
    cli("gpus", "reserve", "--socket", sock, "--name", "all", "--count", "2")
    proc = nodeagent("gpus", "reserve", "--socket", sock, "--name", "more")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("nodeagent: error: no GPUs fit now: ")
    assert proc.stderr.count("\n") == 1
    proc = nodeagent("gpus", "release", "--socket", sock, "nothing")
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "nothing" in proc.stderr
    assert d.holds() == [("all", "reservation")]
