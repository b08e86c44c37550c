"""The NVML adapter against a FAKE pynvml (tests/unit/fake_nvml.py) describing real hardware:
a missing library means no GPUs, NotSupported is None for one figure, a lost GPU or an
unknown error marks only that GPU unhealthy, NVSwitch peers are NVLink-connected."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest
from fake_nvml import (
    NVSWITCH_BUSES,
    FakeGpu,
    FakeMig,
    FakeNvml,
    dgx1_quad,
    dgx_h100,
    host_nvml,
)

from nodeagent.gpu.backend import GpuError, NoGpus
from nodeagent.gpu.model import PcieLevel
from nodeagent.gpu.nvml import APPLICATION_XIDS, NvmlBackend, open_nvml
from nodeagent.gpualloc.placement import GpuRequest, Holdings, Placement, Refusal, place
from nodeagent.gpualloc.service import node_of
from nodeagent.sense.gpus import GpuSensor


def backend(fake: FakeNvml, tmp_path: Path | None = None, **kw: str) -> NvmlBackend:
    roots = (
        {"proc_root": str(tmp_path / "proc"), "sys_root": str(tmp_path / "sys")} if tmp_path else {}
    )
    opened = open_nvml(nvml=fake, **{**roots, **kw})
    assert isinstance(opened, NvmlBackend), getattr(opened, "reason", opened)
    return opened


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1 not found: no NVIDIA driver"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "no permission"),
        (pynvml.NVML_ERROR_UNKNOWN, "NVML could not start: Unknown Error"),
    ],
)
def test_no_library_or_driver_means_no_gpus_with_a_reason(code: int, says: str) -> None:
    opened = open_nvml(nvml=FakeNvml(dgx_h100(), init_error=code))
    assert isinstance(opened, NoGpus)
    assert says in opened.reason
    assert "\n" not in opened.reason
    assert (opened.inventory(), opened.telemetry(), opened.processes()) == ((), (), ())
    assert opened.topology().links == {}
    with pytest.raises(GpuError, match="no GPUs"):
        opened.set_power_limit("GPU-x", 300_000)


def test_the_real_bindings_on_this_host_say_what_nvml_says() -> None:
    """Whatever this host has (here: no NVIDIA driver; on a GPU host, its GPUs), opening the
    real NVML gives what pynvml, asked directly, says: every GPU, or none and why."""
    count, reason = host_nvml()
    opened = open_nvml()
    try:
        if count:
            assert isinstance(opened, NvmlBackend), opened.reason
            assert len(opened.inventory()) == count
            assert opened.source.startswith("NVML") and opened.reason == ""
        else:
            assert isinstance(opened, NoGpus)
            assert opened.reason == reason
    finally:
        opened.close()


def test_no_gpus_found() -> None:
    opened = open_nvml(nvml=FakeNvml([]))
    assert isinstance(opened, NoGpus)
    assert opened.reason == "NVML found no GPUs"


def test_dgx_h100_inventory() -> None:
    b = backend(FakeNvml(dgx_h100()))
    gpus = b.inventory()
    assert b.source == "NVML, driver 550.54.15"
    assert not b.simulated
    assert [g.index for g in gpus] == list(range(8))
    g0, g5 = gpus[0], gpus[5]
    assert g0.uuid.startswith("GPU-") and g0.pci_bus_id == "00000000:1B:00.0"
    assert g0.name == "NVIDIA H100 80GB HBM3"
    assert g0.memory_total == 81559 * 1024**2
    assert (g0.numa_node, g5.numa_node) == (0, 1)
    assert g0.cpus[:3] == (0, 1, 2) and 112 in g0.cpus and 56 not in g0.cpus
    assert g5.minor == 5
    assert all(g.healthy and g.reason == "" and not g.simulated for g in gpus)
    assert all(g.mig_enabled is False for g in gpus)


def test_nvswitch_peers_are_nvlink_connected() -> None:
    """Each link's far end is a switch, never the peer: every pair gets the fabric's links."""
    topo = backend(FakeNvml(dgx_h100())).topology()
    assert len(topo.links) == 28
    for (a, b), link in topo.links.items():
        assert link.nvswitch and link.nvlinks == 18, (a, b)
    assert topo.link(0, 1).pcie is PcieLevel.PXB
    assert topo.link(0, 2).pcie is PcieLevel.NODE
    assert topo.link(3, 4).pcie is PcieLevel.SYS


def test_separate_switches_are_separate_fabrics() -> None:
    gpus = dgx_h100()[:4]
    switch = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    for g in gpus[2:]:
        g.nvlinks = [("00000000:0A:00.0", switch)] * 6
    topo = backend(FakeNvml(gpus)).topology()
    assert topo.link(0, 1).nvlinks == 18
    assert topo.link(2, 3).nvlinks == 6
    assert topo.link(1, 2).nvlinks == 0 and not topo.link(1, 2).nvswitch


def test_direct_nvlinks_are_counted_per_link() -> None:
    topo = backend(FakeNvml(dgx1_quad())).topology()
    assert {pair: link.nvlinks for pair, link in topo.links.items()} == {
        (0, 1): 1,
        (0, 2): 1,
        (0, 3): 2,
        (1, 2): 2,
        (1, 3): 1,
        (2, 3): 2,
    }
    assert not any(link.nvswitch for link in topo.links.values())


def test_old_driver_without_remote_device_type_finds_switches_by_pci_class(tmp_path: Path) -> None:
    """NCCL's way: an NVSwitch is PCI class 0x068000 in sysfs."""
    for bus in NVSWITCH_BUSES:
        d = tmp_path / "sys/bus/pci/devices" / bus.lower()[-12:]
        d.mkdir(parents=True)
        (d / "class").write_text("0x068000\n")
    fake = FakeNvml(dgx_h100()[:2])
    fake.missing.add("nvmlDeviceGetNvLinkRemoteDeviceType")
    b = backend(fake, tmp_path)
    assert b.topology().link(0, 1).nvlinks == 18
    assert all(g.healthy for g in b.inventory())


def test_numa_node_from_sysfs_when_nvml_lacks_it(tmp_path: Path) -> None:
    d = tmp_path / "sys/bus/pci/devices/0000:1b:00.0"
    d.mkdir(parents=True)
    (d / "numa_node").write_text("1\n")
    fake = FakeNvml(dgx_h100()[:2])
    fake.missing.add("nvmlDeviceGetNumaNodeId")
    gpus = backend(fake, tmp_path).inventory()
    assert gpus[0].numa_node == 1
    assert gpus[1].numa_node is None  # no sysfs entry: unknown, not a guess
    assert all(g.healthy for g in gpus)


def test_telemetry() -> None:
    gpus = dgx_h100()[:2]
    gpus[1].utilization, gpus[1].memory_used, gpus[1].temperature = 87, 40 * 1024**3, 61
    t = backend(FakeNvml(gpus)).telemetry()
    assert (t[1].utilization, t[1].memory_used, t[1].temperature_c) == (87, 40 * 1024**3, 61)
    assert (t[0].power_draw_mw, t[0].power_limit_mw) == (112_000, 700_000)
    assert (t[0].power_min_mw, t[0].power_max_mw, t[0].power_default_mw) == (
        200_000,
        700_000,
        700_000,
    )


@pytest.mark.parametrize(
    "code",
    [
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_NO_PERMISSION,
    ],
)
def test_an_unsupported_figure_is_none_and_the_gpu_stays_healthy(code: int) -> None:
    gpus = dgx_h100()[:2]
    gpus[0].errors = {"nvmlDeviceGetPowerUsage": code, "nvmlDeviceGetUtilizationRates": code}
    b = backend(FakeNvml(gpus))
    t0, t1 = b.telemetry()
    assert t0.power_draw_mw is None and t0.utilization is None
    assert t0.temperature_c == 33  # the other figures are read
    assert t1.power_draw_mw == 112_000
    assert all(g.healthy for g in b.inventory())


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (pynvml.NVML_ERROR_GPU_IS_LOST, "GPU is lost"),
        (pynvml.NVML_ERROR_UNKNOWN, "Unknown Error"),
        (pynvml.NVML_ERROR_RESET_REQUIRED, "GPU requires restart"),
    ],
)
def test_a_lost_gpu_is_unhealthy_alone(code: int, says: str) -> None:
    gpus = dgx_h100()[:3]
    b = backend(FakeNvml(gpus))
    gpus[1].errors = {"nvmlDeviceGetMemoryInfo": code}
    t = b.telemetry()
    assert [x.index for x in t] == [0, 1, 2]
    assert t[1].memory_used is None and t[0].memory_used == 0
    health = [(g.healthy, g.reason) for g in b.inventory()]
    assert health[0] == health[2] == (True, "")
    assert health[1] == (False, f"DeviceGetMemoryInfo: {says}")
    gpus[1].errors = {}
    assert not b.inventory()[1].healthy, "a lost GPU stays unhealthy until NVML is reopened"


def test_a_gpu_without_a_handle_is_listed_unhealthy() -> None:
    gpus = dgx_h100()[:2]
    gpus[1].errors = {"nvmlDeviceGetHandleByIndex": pynvml.NVML_ERROR_GPU_IS_LOST}
    b = backend(FakeNvml(gpus))
    g0, g1 = b.inventory()
    assert g0.healthy
    assert (g1.index, g1.healthy, g1.uuid) == (1, False, "")
    assert "GPU is lost" in g1.reason
    assert [t.index for t in b.telemetry()] == [0]
    assert set(b.topology().links) == set()


def write_cgroup(tmp_path: Path, pid: int, path: str) -> None:
    d = tmp_path / "proc" / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(f"0::/{path}\n")


def test_processes_with_their_cgroups(tmp_path: Path) -> None:
    gpus = dgx_h100()[:2]
    gpus[1].processes = [
        (4242, 20 * 1024**3, 0xFFFFFFFF, 0xFFFFFFFF),
        (4243, 1024, 0xFFFFFFFF, 0xFFFFFFFF),
    ]
    write_cgroup(tmp_path, 4242, "nodeagent.slice/job-1")
    procs = backend(FakeNvml(gpus), tmp_path).processes()
    assert [(p.pid, p.device_uuid, p.used_memory, p.cgroup) for p in procs] == [
        (4242, gpus[1].uuid, 20 * 1024**3, "nodeagent.slice/job-1"),
        (4243, gpus[1].uuid, 1024, None),  # exited: no /proc entry
    ]


def test_processes_fall_back_to_v2_on_older_drivers(tmp_path: Path) -> None:
    gpus = dgx_h100()[:1]
    gpus[0].processes = [(77, None, 0xFFFFFFFF, 0xFFFFFFFF)]  # type: ignore[list-item]
    fake = FakeNvml(gpus)
    fake.missing.add("nvmlDeviceGetComputeRunningProcesses_v3")
    write_cgroup(tmp_path, 77, "system.slice/docker-abc.scope")
    b = backend(fake, tmp_path)
    (p,) = b.processes()
    assert (p.pid, p.used_memory, p.cgroup) == (77, None, "system.slice/docker-abc.scope")
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in fake.calls
    assert b.inventory()[0].healthy


MIG_1G = "MIG-11111111-2222-4333-8444-555555555555"
MIG_3G = "MIG-66666666-7777-4888-8999-aaaaaaaaaaaa"


def mig_gpu() -> FakeGpu:
    gpu = dgx_h100()[0]
    gpu.mig = [
        FakeMig(MIG_3G, 0, "3g.40gb", 40192 * 1024**2, gpu_instance=2, compute_instance=0),
        FakeMig(MIG_1G, 3, "1g.10gb", 9856 * 1024**2, gpu_instance=9, compute_instance=0),
    ]
    return gpu


def test_mig_devices_with_their_own_uuids(tmp_path: Path) -> None:
    gpu = mig_gpu()
    gpu.processes = [(500, 2 * 1024**3, 9, 0)]
    write_cgroup(tmp_path, 500, "kubepods/pod1/c1")
    b = backend(FakeNvml([gpu]), tmp_path)
    (g,) = b.inventory()
    assert g.mig_enabled is True
    assert [(m.uuid, m.index, m.profile, m.gpu_instance) for m in g.mig_devices] == [
        (MIG_3G, 0, "3g.40gb", 2),
        (MIG_1G, 3, "1g.10gb", 9),
    ]
    assert all(m.parent_uuid == g.uuid for m in g.mig_devices)
    (p,) = b.processes()
    assert (p.device_uuid, p.cgroup) == (MIG_1G, "kubepods/pod1/c1")


def test_critical_xid_marks_one_gpu_and_application_xids_do_not() -> None:
    assert {13, 31, 43, 45, 68, 109} == APPLICATION_XIDS
    fake = FakeNvml(dgx_h100()[:3])
    b = backend(fake)
    assert b.poll_health() == ()
    fake.xid(0, 31)  # GPU memory page fault: the application's fault
    fake.xid(2, 79)  # GPU has fallen off the bus
    events = b.poll_health()
    assert [(e.device_uuid, e.xid, e.critical) for e in events] == [
        (fake.gpus[0].uuid, 31, False),
        (fake.gpus[2].uuid, 79, True),
    ]
    health = [(g.healthy, g.reason) for g in b.inventory()]
    assert health == [(True, ""), (True, ""), (False, "critical Xid 79")]
    assert b.poll_health() == ()


def test_a_critical_xid_in_a_mig_instance_marks_that_instance() -> None:
    fake = FakeNvml([mig_gpu()])
    b = backend(fake)
    fake.xid(0, 94, gi=9, ci=0)  # contained ECC error, in the 1g.10gb instance
    (event,) = b.poll_health()
    assert (event.device_uuid, event.critical) == (MIG_1G, True)
    (g,) = b.inventory()
    assert g.healthy
    assert [(m.uuid, m.healthy) for m in g.mig_devices] == [(MIG_3G, True), (MIG_1G, False)]


def test_a_broken_event_wait_marks_every_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(dgx_h100()[:2])
    b = backend(fake)

    def broken_wait(*_: object) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(fake, "nvmlEventSetWait", broken_wait)
    assert b.poll_health() == ()
    assert [g.healthy for g in b.inventory()] == [False, False]


def test_power_limit_is_clamped_and_read_back() -> None:
    fake = FakeNvml(dgx_h100()[:2])
    b = backend(fake)
    uuid = fake.gpus[1].uuid
    result = b.set_power_limit(uuid, 450_000)
    assert (result.applied_mw, result.clamped) == (450_000, False)
    low = b.set_power_limit(uuid, 50_000)
    assert (low.requested_mw, low.applied_mw, low.min_mw, low.clamped) == (
        50_000,
        200_000,
        200_000,
        True,
    )
    assert b.telemetry()[1].power_limit_mw == 200_000
    assert b.telemetry()[0].power_limit_mw == 700_000


def test_power_limit_errors_are_one_line() -> None:
    fake = FakeNvml(dgx_h100()[:1])
    fake.gpus[0].errors = {"nvmlDeviceSetPowerManagementLimit": pynvml.NVML_ERROR_NO_PERMISSION}
    b = backend(fake)
    with pytest.raises(GpuError) as info:
        b.set_power_limit(fake.gpus[0].uuid, 300_000)
    uuid = fake.gpus[0].uuid
    assert str(info.value) == (
        f"GPU 0 ({uuid}): setting the power limit: Insufficient Permissions (needs root)"
    )
    with pytest.raises(GpuError, match="no GPU with UUID 'GPU-nope'"):
        b.set_power_limit("GPU-nope", 300_000)


def test_close_frees_the_event_set_and_shuts_nvml_down_once() -> None:
    fake = FakeNvml(dgx_h100()[:1])
    b = backend(fake)
    assert fake.initialised == 1
    b.close()
    b.close()
    assert fake.initialised == 0
    assert fake.calls.count("nvmlEventSetFree") == 1


def lost() -> dict[str, int]:
    """Every call on a GPU that fell off the bus fails GPU_IS_LOST, as NVML's do."""
    return {n: pynvml.NVML_ERROR_GPU_IS_LOST for n in dir(FakeNvml) if n.startswith("nvmlDevice")}


def test_a_gpu_lost_without_an_xid_is_unhealthy_the_next_tick_and_never_placed() -> None:
    fake = FakeNvml(dgx_h100())
    sensor = GpuSensor(backend(fake))
    first = sensor.read(())
    assert first is not None and all(d.healthy for d in first.devices)
    fake.gpus[3].errors = lost()  # no Xid arrives: the event set stays empty
    before = len(fake.calls)
    state = sensor.read(())
    assert state is not None
    health = [(d.index, d.healthy, d.reason) for d in state.devices if not d.healthy]
    assert health == [(3, False, "DeviceGetUtilizationRates: GPU is lost")]
    node = node_of(state)
    assert node is not None
    for k in range(1, 8):
        result = place(GpuRequest(count=k), node, Holdings())
        assert isinstance(result, Placement) and 3 not in result.indices, k
    refused = place(GpuRequest(count=8), node, Holdings())
    assert isinstance(refused, Refusal) and "1 unhealthy" in refused.reason
    # cheap: the tick read telemetry and processes, not the inventory or the topology again
    again = fake.calls[before:]
    assert "nvmlDeviceGetTopologyCommonAncestor" not in again
    assert "nvmlDeviceGetPciInfo" not in again
    fake.gpus[3].errors = {}
    later = sensor.read(())
    assert later is not None and not later.devices[3].healthy, "lost until NVML is reopened"
