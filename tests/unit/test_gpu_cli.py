"""nodeagent gpus and nodeagent gpus place, on simulated nodes and on a host without GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_cli import assert_one_line_error, nodeagent

from nodeagent.cli import main
from nodeagent.gpu import backend as backend_module
from nodeagent.gpu.backend import NoGpus
from nodeagent.gpu.simulated import load_simulated

GPUS = Path(__file__).resolve().parents[2] / "config" / "gpus"
H100 = str(GPUS / "dgx-h100-nvswitch.yaml")
PAIRS = str(GPUS / "4x-a100-two-nvlink-pairs.yaml")
MIG = str(GPUS / "h100-mig.yaml")


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("NODEAGENT_GPU_SIM", raising=False)
    return CliRunner()


def run(runner: CliRunner, *args: str, code: int = 0) -> str:
    result = runner.invoke(main, list(args))
    assert result.exit_code == code, result.output
    return result.output


def as_json(runner: CliRunner, *args: str, code: int = 0) -> dict[str, object]:
    data = json.loads(run(runner, *args, "--json", code=code))
    assert isinstance(data, dict)
    return data


@pytest.mark.parametrize(
    ("command", "mentions"),
    [
        (["gpus"], ["--simulate", "--json", "NODEAGENT_GPU_SIM", "place", "MIG"]),
        (
            ["gpus", "place"],
            ["--count", "--busy", "--memory", "--shared", "--mig", "--numa", "reserves nothing"],
        ),
    ],
)
def test_help(runner: CliRunner, command: list[str], mentions: list[str]) -> None:
    out = run(runner, *command, "--help")
    for word in mentions:
        assert word in out
    assert "gpus" in run(runner, "--help")


def test_list_a_simulated_node(runner: CliRunner) -> None:
    out = run(runner, "gpus", "--simulate", PAIRS)
    head, columns, *rows = out.splitlines()
    assert head == f"4 GPUs, simulated from {PAIRS}"
    assert columns.split()[:6] == ["GPU", "UUID", "NAME", "HEALTH", "UTIL", "MEMORY"]
    assert " ok      97%   61Gi/80Gi  287/300W  71C   0     0-27,56-83" in rows[0]
    assert "31337  0    GPU-" in out
    assert "nodeagent.slice/research-train" in out


def test_list_as_json_is_marked_simulated(runner: CliRunner) -> None:
    data = as_json(runner, "gpus", "--simulate", PAIRS)
    assert data["simulated"] is True and data["reason"] == ""
    gpus = data["gpus"]
    assert isinstance(gpus, list) and len(gpus) == 4
    g0 = gpus[0]
    assert g0["simulated"] is True and g0["healthy"] is True
    assert (g0["utilization"], g0["power_draw_w"], g0["power_limit_w"]) == (97, 287.0, 300.0)
    assert g0["cpus"] == "0-27,56-83"
    assert [p["cgroup"] for p in g0["processes"]] == ["nodeagent.slice/research-train"]
    assert "assigned" not in g0 and "violations" not in g0  # the daemon's view adds these


def test_mig_devices_are_listed(runner: CliRunner) -> None:
    out = run(runner, "gpus", "--simulate", MIG)
    assert "MIG devices:" in out
    assert out.count("1g.10gb") == 2
    data = as_json(runner, "gpus", "--simulate", MIG)
    gpus = data["gpus"]
    assert isinstance(gpus, list)
    assert [m["profile"] for m in gpus[0]["mig_devices"]] == [
        "3g.40gb",
        "2g.20gb",
        "1g.10gb",
        "1g.10gb",
    ]


def test_the_environment_variable_names_the_simulation(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NODEAGENT_GPU_SIM", H100)
    assert run(runner, "gpus").startswith(f"8 GPUs, simulated from {H100}")


def test_no_gpus_is_one_line(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_gpus(simulate: str | None = None, **_: object) -> NoGpus:
        return NoGpus("no NVIDIA driver: the NVML library libnvidia-ml.so.1 is not installed")

    monkeypatch.setattr(backend_module, "open_backend", no_gpus)
    assert run(runner, "gpus") == (
        "no GPUs: no NVIDIA driver: the NVML library libnvidia-ml.so.1 is not installed\n"
    )
    data = as_json(runner, "gpus")
    assert (data["gpus"], data["simulated"], data["source"]) == ([], False, "none")
    result = runner.invoke(main, ["gpus", "place"])
    assert result.exit_code == 1
    assert "no GPUs: no NVIDIA driver" in str(result.exception)


def test_place_prints_the_set_the_score_and_why(runner: CliRunner) -> None:
    out = run(runner, "gpus", "place", "--count", "2", "--busy", "2", "--simulate", PAIRS)
    lines = out.splitlines()
    assert lines[0] == "would place on GPUs 0, 1 (simulated node; nothing reserved)"
    assert "score 1220 (pairs 1220 + NUMA 0); 1.00 of the best 2-GPU set" in out
    assert "  0-1  NV12 NODE  1220" in lines
    assert lines[-1].startswith("why: score 1220")


def test_place_as_json(runner: CliRunner) -> None:
    b = load_simulated(H100)
    uuids = [d.uuid for d in b.inventory()]
    data = as_json(
        runner,
        "gpus",
        "place",
        "-k",
        "2",
        "--busy",
        f"0,{uuids[1]}",
        "--numa",
        "0",
        "--simulate",
        H100,
    )
    assert data["placed"] is True and data["reserved"] is False and data["simulated"] is True
    assert data["indices"] == [2, 3]
    assert data["uuids"] == uuids[2:4]
    assert data["numa_nodes"] == [0]
    assert data["numa_bonus"] == 20
    assert data["pairs"] == [
        {"gpus": [2, 3], "pcie": "PXB", "nvlinks": 18, "nvswitch": True, "score": 1840}
    ]
    assert data["fraction"] == 1.0


def test_place_mig_and_shared(runner: CliRunner) -> None:
    b = load_simulated(MIG)
    migs = [m.uuid for m in b.inventory()[0].mig_devices]
    data = as_json(
        runner, "gpus", "place", "--mig", "1g.10gb", "--busy", migs[2], "--simulate", MIG
    )
    assert data["uuids"] == [migs[3]]
    out = run(runner, "gpus", "place", "--mig", "1g.10gb", "-k", "2", "--simulate", MIG)
    assert out.startswith("would place on 2 MIG instances (1g.10gb) on GPU 0")
    shared = as_json(runner, "gpus", "place", "--shared", "--memory", "70Gi", "--simulate", PAIRS)
    assert shared["indices"] == [1]  # GPUs 0 and 2 have less than 70Gi free


def test_place_waits_with_exit_1(runner: CliRunner) -> None:
    out = run(runner, "gpus", "place", "-k", "8", "--busy", "0", "--simulate", H100, code=1)
    assert out == "nothing fits now: no 8 GPUs free now: 7 of 8 eligible (1 held)\n"
    data = as_json(runner, "gpus", "place", "--shared", "--simulate", PAIRS, code=1)
    assert data == {
        "placed": False,
        "source": f"simulated from {PAIRS}",
        "simulated": True,
        "reason": "a shared request needs a memory size, to pack it",
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--busy", "0,9"],
            "nodeagent: error: --busy: no GPU or MIG device '9' on this node (indices 0-7)",
        ),
        (
            ["--busy", "GPU-nope"],
            "nodeagent: error: --busy: no GPU or MIG device 'GPU-nope' on this node (indices 0-7)",
        ),
        (
            ["--memory", "lots"],
            "nodeagent: error: --memory: expected a size such as 512Mi, 4Gi or a number of "
            "bytes, got 'lots'",
        ),
        (
            ["--numa", "one"],
            "nodeagent: error: --numa: expected NUMA node numbers such as 0 or 0,1, got 'one'",
        ),
    ],
)
def test_bad_arguments_are_one_line(args: list[str], message: str) -> None:
    proc = nodeagent("gpus", "place", "--simulate", H100, *args)
    assert assert_one_line_error(proc) == message


def test_a_bad_simulation_file_is_located(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus:\n  - {index: 0, uuid: GPU-a, name: T, memory: 1Gi, numa_node: x}\n")
    line = assert_one_line_error(nodeagent("gpus", "--simulate", str(bad)))
    assert line == (
        f"nodeagent: error: {bad}:2:62: gpus[0].numa_node: "
        "must be a valid integer, unable to parse string as an integer"
    )
    bad.write_text("gpus:\n  - {index: 0, uuid: GPU-a, name: T, memory: 1Gi, numa: 0}\n")
    proc = nodeagent("gpus", "place", "--simulate", str(bad))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"nodeagent: error: {bad}:2:5: missing required key 'numa_node' in gpus[0]",
        f"{bad}:2:51: unknown key 'numa' in gpus[0]",
    ]
