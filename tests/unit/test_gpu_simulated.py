"""Simulated GPU nodes (config/gpus/): the shipped topologies, the backend choice, and every
problem in a description reported as FILE:LINE:COL: message."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fake_nvml import host_nvml
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.gpu.backend import GpuError, NoGpus
from nodeagent.gpu.choice import open_backend
from nodeagent.gpu.model import PcieLevel, format_cpulist, parse_cpulist
from nodeagent.gpu.simulated import WHAT, SimulatedBackend, load_simulated, parse_node
from nodeagent.policyfile.yamlfile import PolicyError

REPO = Path(__file__).resolve().parents[2]
GPUS = REPO / "config" / "gpus"
SHIPPED = sorted(p.name for p in GPUS.glob("*.yaml"))


def load(name: str) -> SimulatedBackend:
    return load_simulated(GPUS / name)


def test_the_shipped_topologies() -> None:
    assert SHIPPED == [
        "4x-a100-two-nvlink-pairs.yaml",
        "8x-l40s-pcie-dual-socket.yaml",
        "dgx-h100-nvswitch.yaml",
        "dgx1-v100-hybrid-cube-mesh.yaml",
        "h100-mig.yaml",
        "hgx2-16x-v100-nvswitch.yaml",
    ]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_file_is_marked_simulated(name: str) -> None:
    b = load(name)
    assert b.simulated and b.source == f"simulated from {GPUS / name}"
    assert b.topology().simulated
    assert all(d.simulated for d in b.inventory())
    assert all(m.simulated for d in b.inventory() for m in d.mig_devices)
    assert all(t.simulated for t in b.telemetry())
    uuids = [d.uuid for d in b.inventory()] + [m.uuid for d in b.inventory() for m in d.mig_devices]
    assert len(set(uuids)) == len(uuids)


def nvlink_matrix(b: SimulatedBackend) -> list[list[int]]:
    n = len(b.inventory())
    return [[b.topology().link(a, c).nvlinks if a != c else 0 for c in range(n)] for a in range(n)]


def test_dgx_h100_is_one_nvswitch_fabric() -> None:
    b = load("dgx-h100-nvswitch.yaml")
    topo = b.topology()
    for a in range(8):
        for c in range(a + 1, 8):
            link = topo.link(a, c)
            assert (link.nvlinks, link.nvswitch) == (18, True)
            expected = (
                PcieLevel.SYS
                if a // 4 != c // 4
                else PcieLevel.PXB
                if a // 2 == c // 2
                else PcieLevel.NODE
            )
            assert link.pcie is expected, (a, c)
    assert [d.numa_node for d in b.inventory()] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert format_cpulist(b.inventory()[0].cpus) == "0-55,112-167"


def test_dgx1_hybrid_cube_mesh() -> None:
    m = nvlink_matrix(load("dgx1-v100-hybrid-cube-mesh.yaml"))
    assert m == [
        [0, 1, 1, 2, 2, 0, 0, 0],
        [1, 0, 2, 1, 0, 2, 0, 0],
        [1, 2, 0, 2, 0, 0, 1, 0],
        [2, 1, 2, 0, 0, 0, 0, 1],
        [2, 0, 0, 0, 0, 1, 1, 2],
        [0, 2, 0, 0, 1, 0, 2, 1],
        [0, 0, 1, 0, 1, 2, 0, 2],
        [0, 0, 0, 1, 2, 1, 2, 0],
    ]
    assert all(sum(row) == 6 for row in m)  # V100 has six NVLinks
    assert all(sum(1 for x in row if x) == 4 for row in m)  # each GPU links to four others


def test_two_nvlink_pairs_and_the_pcie_node() -> None:
    pairs = load("4x-a100-two-nvlink-pairs.yaml")
    assert nvlink_matrix(pairs) == [[0, 12, 0, 0], [12, 0, 0, 0], [0, 0, 0, 12], [0, 0, 12, 0]]
    pcie = load("8x-l40s-pcie-dual-socket.yaml")
    assert not any(any(row) for row in nvlink_matrix(pcie))
    assert {d.numa_node for d in pcie.inventory()} == {0, 1}
    assert pcie.topology().link(0, 1).pcie is PcieLevel.PIX
    assert pcie.topology().link(0, 7).pcie is PcieLevel.SYS


def test_mig_node() -> None:
    (gpu,) = load("h100-mig.yaml").inventory()
    assert gpu.mig_enabled
    assert [m.profile for m in gpu.mig_devices] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert all(m.uuid.startswith("MIG-") and m.parent_uuid == gpu.uuid for m in gpu.mig_devices)
    assert [m.memory_total for m in gpu.mig_devices] == [40 * 10**9, 20 * 10**9, 10**10, 10**10]


def test_sixteen_gpus_on_one_fabric() -> None:
    b = load("hgx2-16x-v100-nvswitch.yaml")
    assert len(b.inventory()) == 16
    assert all(b.topology().link(0, c).nvlinks == 6 for c in range(1, 16))


MINIMAL = """\
gpus:
  - {index: 0, uuid: GPU-a, name: T, memory: 16Gi, numa_node: 0,
     power: {min: 100, max: 300, default: 250}}
  - {index: 1, uuid: GPU-b, name: T, memory: 16Gi, numa_node: 0, nvswitch: true, nvswitch_links: 4}
  - {index: 2, uuid: GPU-c, name: T, memory: 16Gi, numa_node: 1, nvswitch: true, nvswitch_links: 6}
links:
  - {gpus: [1, 0], pcie: PIX, nvlinks: 2}
processes:
  - {pid: 4242, gpu: 0, memory: 2Gi, cgroup: nodeagent.slice/job-1}
  - {pid: 4243, gpu: GPU-c, memory: 1Gi}
"""


def backend_of(text: str, tmp_path: Path, name: str = "node.yaml") -> SimulatedBackend:
    path = tmp_path / name
    path.write_text(text)
    return load_simulated(path, proc_root=str(tmp_path / "proc"))


def test_links_default_to_sys_and_nvswitch_peers_connect(tmp_path: Path) -> None:
    topo = backend_of(MINIMAL, tmp_path).topology()
    assert topo.link(0, 1).nvlinks == 2 and topo.link(0, 1).pcie is PcieLevel.PIX
    assert not topo.link(0, 1).nvswitch
    assert (topo.link(1, 2).nvlinks, topo.link(1, 2).nvswitch) == (4, True)
    assert topo.link(1, 2).pcie is PcieLevel.SYS
    assert topo.link(0, 2).nvlinks == 0


def test_processes_and_memory_used(tmp_path: Path) -> None:
    (tmp_path / "proc/4243").mkdir(parents=True)
    (tmp_path / "proc/4243/cgroup").write_text("0::/system.slice/docker-1.scope\n")
    b = backend_of(MINIMAL, tmp_path)
    procs = b.processes()
    assert [(p.pid, p.device_uuid, p.cgroup, p.simulated) for p in procs] == [
        (4242, "GPU-a", "nodeagent.slice/job-1", True),
        (4243, "GPU-c", "system.slice/docker-1.scope", True),
    ]
    assert [t.memory_used for t in b.telemetry()] == [2 * 1024**3, 0, 1024**3]


def test_simulated_power_limits(tmp_path: Path) -> None:
    b = backend_of(MINIMAL, tmp_path)
    assert b.telemetry()[0].power_limit_mw == 250_000
    result = b.set_power_limit("GPU-a", 400_000)
    assert (result.applied_mw, result.clamped, result.simulated) == (300_000, True, True)
    assert b.telemetry()[0].power_limit_mw == 300_000
    with pytest.raises(GpuError, match=r"GPU 1 \(GPU-b\) has no simulated power limits"):
        b.set_power_limit("GPU-b", 200_000)


def test_backend_choice(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text(MINIMAL)
    other = GPUS / "dgx-h100-nvswitch.yaml"
    assert open_backend(str(path), environ={}).source == f"simulated from {path}"
    chosen = open_backend(str(path), environ={"NODEAGENT_GPU_SIM": str(other)})
    assert chosen.source == f"simulated from {path}", "an explicit file wins over the variable"
    assert open_backend(None, environ={"NODEAGENT_GPU_SIM": str(other)}).source.endswith(
        "dgx-h100-nvswitch.yaml"
    )
    count, reason = host_nvml()  # nothing named: the host's own NVML, as pynvml says
    real = open_backend(None, environ={})
    try:
        assert not real.simulated
        if count:
            assert real.source.startswith("NVML") and len(real.inventory()) == count
        else:
            assert isinstance(real, NoGpus) and real.reason == reason
    finally:
        real.close()


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_node(text, "n.yaml")
    return [str(p) for p in info.value.problems]


GPU0 = "  - {index: 0, uuid: GPU-a, name: T, memory: 16Gi, numa_node: 0}\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ["n.yaml:1:1: the file is empty; expected " + WHAT]),
        ("- 1\n", ["n.yaml:1:1: expected " + WHAT]),
        ("gpus: []\n", ["n.yaml:1:7: a node needs at least one GPU"]),
        (
            "gpus:\n  - {index: 0, uuid: GPU-a, name: T, memory: 16Gi}\n",
            ["n.yaml:2:5: missing required key 'numa_node' in gpus[0]"],
        ),
        (
            "gpus:\n  - {index: 0, uuid: GPU-a, name: T, memory: 16Gi, numa_node: 0, nvlink: 3}\n",
            ["n.yaml:2:66: unknown key 'nvlink' in gpus[0]"],
        ),
        (
            "gpus:\n  - {index: 0, uuid: GPU-a, name: T, memory: lots, numa_node: 0}\n",
            [
                "n.yaml:2:46: gpus[0].memory: expected a size such as 512Mi, "
                "4Gi or a number of bytes, got 'lots'"
            ],
        ),
        (
            "gpus:\n  - {index: 0, uuid: a, name: T, memory: 1Gi, numa_node: 0}\n",
            [
                "n.yaml:2:22: gpus[0].uuid: must be a GPU UUID as nvidia-smi -L prints it "
                "(GPU-7e62aa0a-1df9-...), got 'a'"
            ],
        ),
        (
            "gpus:\n  - {index: 0, uuid: GPU-a, name: T, memory: 1Gi, numa_node: 0, cpus: 4-2}\n",
            ["n.yaml:2:71: gpus[0].cpus: CPU range '4-2' runs backwards"],
        ),
        (
            # YAML 1.1 reads an unquoted 00000000:17:00.0 as a number in base 60
            "gpus:\n  - {index: 0, uuid: GPU-a, name: T, memory: 1Gi, numa_node: 0,"
            " pci_bus_id: 00000000:17:00.0}\n",
            ["n.yaml:2:77: gpus[0].pci_bus_id: must be a string; quote it: '00000000:17:00.0'"],
        ),
        (
            "gpus:\n" + GPU0 + "links:\n  - {gpus: [0, 1], pcie: PCI}\n",
            ["n.yaml:4:26: links[0].pcie: must be 'PIX', 'PXB', 'PHB', 'NODE' or 'SYS'"],
        ),
        (
            "gpus:\n" + GPU0 + "links:\n  - {gpus: [0, 1], pcie: PIX}\n",
            ["n.yaml:4:12: no GPU with index 1"],
        ),
        (
            "gpus:\n" + GPU0 + GPU0.replace("GPU-a", "GPU-b"),
            ["n.yaml:3:13: duplicate GPU index 0"],
        ),
        (
            "gpus:\n" + GPU0.replace("index: 0", "index: 3"),
            ["n.yaml:2:13: index 3 with 1 GPUs: indices run 0..0"],
        ),
        (
            "gpus:\n" + GPU0 + GPU0.replace("index: 0", "index: 1"),
            ["n.yaml:3:22: duplicate UUID GPU-a"],
        ),
        (
            "gpus:\n" + GPU0 + "links:\n  - {gpus: [0, 0], pcie: PIX}\n",
            ["n.yaml:4:12: a link joins two GPUs, got GPU 0 twice"],
        ),
        (
            "gpus:\n"
            + GPU0
            + GPU0.replace("index: 0, uuid: GPU-a", "index: 1, uuid: GPU-b")
            + "links:\n  - {gpus: [0, 1], pcie: PIX}\n  - {gpus: [1, 0], pcie: SYS}\n",
            ["n.yaml:6:12: a second entry for GPUs 0 and 1"],
        ),
        (
            "gpus:\n" + GPU0 + "processes:\n  - {pid: 1, gpu: GPU-z}\n",
            ["n.yaml:4:19: no GPU or MIG device 'GPU-z'"],
        ),
        (
            "gpus:\n  - {index: 0, uuid: GPU-a, name: T, memory: 1Gi, numa_node: 0,"
            " power: {min: 300, max: 200, default: 250}}\n",
            ["n.yaml:2:72: power needs min <= default <= max"],
        ),
        (
            "gpus:\n  - {index: 0, uuid: GPU-a, name: T, memory: 16Gi, numa_node: 0,"
            " mig: [{uuid: GPU-x, profile: 1g.10gb}]}\n",
            [
                "n.yaml:2:79: gpus[0].mig[0].uuid: must be a MIG device UUID as nvidia-smi -L "
                "prints it (MIG-...), got 'GPU-x'"
            ],
        ),
        (
            "gpus:\n  - {index: 0, uuid: GPU-a, name: T, memory: 16Gi, numa_node: 0,"
            " mig: [{uuid: MIG-x, profile: 7g.80gb}]}\n",
            ["n.yaml:2:71: the MIG devices hold more memory than the GPU has"],
        ),
        (
            "gpus:\n" + GPU0 + GPU0,
            ["n.yaml:3:13: duplicate GPU index 0", "n.yaml:3:22: duplicate UUID GPU-a"],
        ),
    ],
)
def test_problems_are_located(text: str, expected: list[str]) -> None:
    assert problems(text) == expected


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (
            "mig: [{uuid: MIG-x, profile: big}]",
            "gpus[0].mig[0].profile: must be a MIG profile such as 1g.10gb or 3g.40gb, got 'big'",
        ),
        (
            "pci_bus_id: '1B:00.0'",
            "gpus[0].pci_bus_id: must be a PCI bus ID such as '00000000:1B:00.0', got '1B:00.0'",
        ),
        ("utilization: 140", "gpus[0].utilization: must be at most 100, got 140"),
        ("nvswitch_links: 0", "gpus[0].nvswitch_links: must be at least 1, got 0"),
        ("nvswitch: maybe", "gpus[0].nvswitch: must be true or false, got 'maybe'"),
        ("unhealthy: ''", "gpus[0].unhealthy: must be a string that is not empty, got ''"),
        (
            "power: 300",
            "gpus[0].power: must be power figures: a mapping with min, max and default (watts)",
        ),
    ],
)
def test_schema_problems_are_in_our_words(entry: str, expected: str) -> None:
    text = "gpus:\n" + GPU0.replace("numa_node: 0}", f"numa_node: 0, {entry}}}")
    (found,) = problems(text)
    assert found.split(": ", 1)[1] == expected


def test_link_and_list_problems_are_in_our_words() -> None:
    two = "gpus:\n" + GPU0 + GPU0.replace("index: 0, uuid: GPU-a", "index: 1, uuid: GPU-b")
    (found,) = problems(two + "links:\n  - {gpus: [0, 1, 1], pcie: PIX}\n")
    assert found == "n.yaml:5:12: links[0].gpus: a link joins two GPUs: gpus: [A, B]"
    (found,) = problems("gpus: 4\n")
    assert found == "n.yaml:1:7: gpus: must be a list, got 4"
    (found,) = problems("gpus:\n  - GPU-a\n")
    assert found == (
        "n.yaml:2:5: gpus[0]: must be a GPU: a mapping with index, uuid, name, memory and numa_node"
    )


def test_the_loader_guards_name_the_node_file_not_the_policy(tmp_path: Path) -> None:
    """The policy loader's guards (alias bombs, nesting) are shared; their words are not."""
    bomb = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 7)
    ]
    for text in ("\n".join(bomb) + "\n", "x: " + "[" * 5000 + "]" * 5000 + "\n"):
        path = tmp_path / "node.yaml"
        path.write_text(text)
        with pytest.raises(PolicyError) as info:
            load_simulated(path)
        (line,) = str(info.value).splitlines()
        assert line.startswith(f"{path}:1:1: the GPU node description ")
        assert "policy" not in line


def test_yaml_problems_and_duplicate_keys_come_from_the_policy_loader() -> None:
    (syntax,) = problems("gpus: [\n")
    assert syntax.startswith("n.yaml:2:1: ")
    (dup,) = problems("gpus:\n" + GPU0 + "gpus:\n" + GPU0)
    assert dup == "n.yaml:3:1: duplicate key 'gpus' (first at line 1)"


def test_file_problems(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_simulated(tmp_path / "missing.yaml")
    assert str(info.value) == f"{tmp_path}/missing.yaml:1:1: cannot read: No such file or directory"
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\0\1")
    with pytest.raises(PolicyError, match="NUL bytes"):
        load_simulated(binary)
    with pytest.raises(PolicyError, match="cannot read"):
        open_backend(str(tmp_path / "missing.yaml"), environ={})


def test_cpulist() -> None:
    assert parse_cpulist("0-2,5, 7-8") == (0, 1, 2, 5, 7, 8)
    assert parse_cpulist("") == ()
    assert format_cpulist([8, 7, 5, 0, 1, 2]) == "0-2,5,7-8"
    for bad in ("a", "3-1", "1--2"):
        with pytest.raises(ValueError, match="CPU"):
            parse_cpulist(bad)


KEYS = ["gpus", "links", "processes", "index", "uuid", "name", "memory", "numa_node", "mig"]
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 70)
    | st.sampled_from(["GPU-a", "MIG-b", "PIX", "SYS", "1g.10gb", "16Gi", "0-3", "x", ""])
)
DOCS = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=200), DOCS.map(yaml.safe_dump)))
def test_any_input_gives_a_node_or_located_problems(text: str) -> None:
    try:
        parse_node(text, "n.yaml")
    except PolicyError as e:
        assert e.problems
        assert all(str(p).startswith("n.yaml:") and "\n" not in p.message for p in e.problems)
        for p in e.problems:  # our words, never pydantic's
            assert not any(w in p.message for w in ("should", "Input", "instance of", "Sim")), p
