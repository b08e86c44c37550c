"""nodeagent gpus and nodeagent gpus place, on simulated nodes and on a host without GPUs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_cli import assert_one_line_error, nodeagent

from nodeagent.cli import main
from nodeagent.gpu import choice
from nodeagent.gpu.backend import NoGpus
from nodeagent.gpu.simulated import load_simulated

GPUS = Path(__file__).resolve().parents[2] / "config" / "gpus"
H100 = str(GPUS / "dgx-h100-nvswitch.yaml")
PAIRS = str(GPUS / "4x-a100-two-nvlink-pairs.yaml")
MIG = str(GPUS / "h100-mig.yaml")
DGX1 = str(GPUS / "dgx1-v100-hybrid-cube-mesh.yaml")


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("NODEAGENT_GPU_SIM", raising=False)
    return CliRunner()


def run(runner: CliRunner, *args: str, code: int = 0) -> str:
    result = runner.invoke(main, list(args))
    assert result.exit_code == code, result.output
    return result.output


def as_json(runner: CliRunner, *args: str, code: int = 0) -> dict[str, Any]:
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
    # one model on every GPU: named once, not in a column (issue 36, item 7)
    assert head == f"4 GPUs (NVIDIA A100 80GB PCIe), simulated from {PAIRS}"
    assert columns.split()[:5] == ["GPU", "UUID", "HEALTH", "UTIL", "MEMORY"]
    assert " ok      97%   61Gi/80Gi  287/300W  71C   0     0-27,56-83" in rows[0]
    assert "31337  0    GPU-" in out
    assert "nodeagent.slice/research-train" in out


def test_list_as_json_is_marked_simulated(runner: CliRunner) -> None:
    data = as_json(runner, "gpus", "--simulate", PAIRS)
    assert (data["apiVersion"], data["kind"]) == ("nodeagent/v1", "GpuList")
    assert data["simulated"] is True and data["reason"] == ""
    gpus = data["items"]
    assert isinstance(gpus, list) and len(gpus) == 4
    g0 = gpus[0]
    assert g0["simulated"] is True and g0["healthy"] is True
    assert (g0["utilization_percent"], g0["power_draw_watts"], g0["power_limit_watts"]) == (
        97,
        287.0,
        300.0,
    )
    assert (g0["memory_total_bytes"], g0["memory_used_bytes"]) == (80 << 30, 61 << 30)
    assert g0["temperature_celsius"] == 71
    assert g0["cpus"] == "0-27,56-83"
    assert [p["cgroup"] for p in g0["processes"]] == ["nodeagent.slice/research-train"]
    assert g0["processes"][0]["used_memory_bytes"] == 61 << 30
    assert "assigned" not in g0 and "violations" not in g0  # the daemon's view adds these


def test_mig_devices_are_listed(runner: CliRunner) -> None:
    out = run(runner, "gpus", "--simulate", MIG)
    assert "MIG devices:" in out
    assert out.count("1g.10gb") == 2
    data = as_json(runner, "gpus", "--simulate", MIG)
    gpus = data["items"]
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
    assert run(runner, "gpus").startswith(f"8 GPUs (NVIDIA H100 80GB HBM3), simulated from {H100}")


def test_no_gpus_is_one_line(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_gpus(simulate: str | None = None, **_: object) -> NoGpus:
        return NoGpus("libnvidia-ml.so.1 not found: no NVIDIA driver, or a container not given it")

    monkeypatch.setattr(choice, "open_backend", no_gpus)
    assert run(runner, "gpus") == (
        "no GPUs: libnvidia-ml.so.1 not found: no NVIDIA driver, or a container not given it\n"
    )
    data = as_json(runner, "gpus")
    assert (data["kind"], data["items"], data["simulated"], data["source"]) == (
        "GpuList",
        [],
        False,
        "none",
    )
    result = runner.invoke(main, ["gpus", "place"])
    assert result.exit_code == 1
    assert "no GPUs: libnvidia-ml.so.1 not found" in str(result.exception)


def test_place_prints_the_set_the_score_and_why(runner: CliRunner) -> None:
    out = run(runner, "gpus", "place", "--count", "2", "--busy", "0", "--simulate", DGX1)
    lines = out.splitlines()
    assert lines[0] == "would place on GPUs 2, 3 (simulated node; nothing reserved)"
    assert "score 250 (pairs 250 + NUMA 0); 1.00 of the best 2-GPU set" in out
    assert "  2-3  NV2 PIX  250" in lines
    assert lines[-2].startswith("why: score 250, the best now; 2 sets tie on score")
    assert lines[-1] == "(--simulate: no daemon asked, holds not considered)"


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
    assert (data["apiVersion"], data["kind"]) == ("nodeagent/v1", "GpuPlacement")
    assert data["placed"] is True and data["reserved"] is False and data["simulated"] is True
    assert data["indices"] == [2, 3]
    assert data["uuids"] == uuids[2:4]
    assert data["numa_nodes"] == [0]
    assert (data["score"], data["pair_score"], data["numa_bonus_score"]) == (1860, 1840, 20)
    assert data["pairs"] == [
        {"gpus": [2, 3], "pcie": "PXB", "nvlinks": 18, "nvswitch": True, "score": 1840}
    ]
    assert data["score_fraction"] == 1.0
    assert data["request"] == {
        "count": 2,
        "memory_bytes": None,
        "shared": False,
        "mig_profile": None,
        "cpu_numa_nodes": [0],
    }


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
    assert shared["request"]["memory_bytes"] == 70 << 30


def test_place_waits_with_exit_1(runner: CliRunner) -> None:
    out = run(runner, "gpus", "place", "-k", "8", "--busy", "0", "--simulate", H100, code=1)
    assert out == (
        "nothing fits now: no 8 GPUs free now: 7 of 8 eligible (1 held)\n"
        "(--simulate: no daemon asked, holds not considered)\n"
    )
    data = as_json(runner, "gpus", "place", "-k", "3", "--simulate", PAIRS, code=1)
    assert data == {
        "apiVersion": "nodeagent/v1",
        "kind": "GpuPlacement",
        "placed": False,
        "source": f"simulated from {PAIRS}",
        "simulated": True,
        "holds_considered": False,
        "note": "--simulate: no daemon asked, holds not considered",
        "reason": "no 3 GPUs free now: 2 of 4 eligible "
        "(2 busy with compute processes outside any hold)",
    }


def assert_usage_error(proc: subprocess.CompletedProcess[str]) -> str:
    """A usage error: exit 2, one line, no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr.strip()


def usage(option: str, message: str) -> str:
    return (
        f"nodeagent gpus place: error: Invalid value for {option}: {message} "
        "(see 'nodeagent gpus place --help')"
    )


@pytest.mark.parametrize(
    ("node", "args", "message"),
    [
        (
            H100,
            ["--busy", "0,9"],
            usage("--busy", "no GPU or MIG device '9' on this node (indices 0-7)"),
        ),
        (
            H100,
            ["--busy", "GPU-nope"],
            usage("--busy", "no GPU or MIG device 'GPU-nope' on this node (indices 0-7)"),
        ),
        (
            PAIRS,
            ["--busy", "9"],
            usage("--busy", "no GPU or MIG device '9' on this node (indices 0-3)"),
        ),
        (
            H100,
            ["--memory", "lots"],
            usage(
                "--memory", "expected a size such as 512Mi, 4Gi or a number of bytes, got 'lots'"
            ),
        ),
        (
            H100,
            ["--numa", "one"],
            usage("--numa", "expected NUMA node numbers such as 0 or 0,1, got 'one'"),
        ),
        (
            PAIRS,
            ["--numa", "5"],
            usage("--numa", "no GPU is on NUMA node 5 (they are on NUMA nodes 0, 1)"),
        ),
        (
            PAIRS,
            ["--shared"],
            usage("--shared", "a shared request needs the memory it uses (--memory)"),
        ),
    ],
)
def test_input_errors_are_usage_errors_not_capacity_answers(
    node: str, args: list[str], message: str
) -> None:
    proc = nodeagent("gpus", "place", "--simulate", node, *args)
    assert assert_usage_error(proc) == message


@pytest.mark.parametrize(
    ("node", "args", "message"),
    [
        (PAIRS, ["--count", "9"], usage("--count", "this node has 4 GPUs")),
        (
            PAIRS,
            ["--memory", "100Gi"],
            usage("--memory", "no GPU on this node has 100.0Gi: the largest has 80.0Gi"),
        ),
        (
            MIG,
            ["--mig", "7g.80gb"],
            usage(
                "--mig",
                "this node has no MIG instances of profile 7g.80gb "
                "(its profiles: 1g.10gb, 2g.20gb, 3g.40gb)",
            ),
        ),
        (
            MIG,
            ["--mig", "3g.40gb", "-k", "2"],
            usage("--count", "this node has 1 MIG instance(s) of profile 3g.40gb"),
        ),
        (
            PAIRS,
            ["--mig", "1g.10gb"],
            usage(
                "--mig",
                "this node has no MIG instances of profile 1g.10gb (no GPU here is in MIG mode)",
            ),
        ),
    ],
)
def test_a_request_the_node_could_never_satisfy_is_a_usage_error(
    node: str, args: list[str], message: str
) -> None:
    proc = nodeagent("gpus", "place", "--simulate", node, *args)
    assert assert_usage_error(proc) == message


def test_place_passes_over_gpus_other_processes_use(runner: CliRunner) -> None:
    """GPU 0 of the shipped pairs node is 97% busy with pid 31337, GPU 2 runs pid 4711."""
    data = as_json(runner, "gpus", "place", "--count", "1", "--simulate", PAIRS)
    assert data["indices"] == [1]
    assert "passed over busy GPU 0 (pid 31337), GPU 2 (pid 4711)" in str(data["reason"])
    out = run(runner, "gpus", "place", "--count", "2", "--simulate", PAIRS)
    assert out.startswith("would place on GPUs 1, 3 ")


def test_a_bad_simulation_file_is_located(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus:\n  - {index: 0, uuid: GPU-a, name: T, memory: 1Gi, numa_node: x}\n")
    line = assert_one_line_error(nodeagent("gpus", "--simulate", str(bad)))
    assert line == (
        f"nodeagent: error: {bad}:2:62: gpus[0].numa_node: must be a whole number, got 'x'"
    )
    bad.write_text("gpus:\n  - {index: 0, uuid: GPU-a, name: T, memory: 1Gi, numa: 0}\n")
    proc = nodeagent("gpus", "place", "--simulate", str(bad))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"nodeagent: error: {bad}:2:5: missing required key 'numa_node' in gpus[0]",
        f"{bad}:2:51: unknown key 'numa' in gpus[0]",
    ]
