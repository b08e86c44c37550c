"""FAKE NVML: a stand-in for the `pynvml` module, for hosts without an NVIDIA GPU.

Labelled fake, at the pynvml boundary only: nodeagent.gpu.nvml calls these functions
exactly as it calls pynvml's, and they raise pynvml's own NVMLError classes with NVML's
error codes. What they return is driven by data describing real hardware: a DGX H100
(H100 80GB HBM3 on four third-generation NVSwitches; nvidia-smi -q and topo -m figures)
and the first four GPUs of a DGX-1V (direct NVLinks, counts from NVIDIA/nccl issue 671).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

MIB = 1024**2


@dataclass
class FakeGpu:
    """One GPU as NVML reports it; `errors` maps an NVML function name to the error code it
    raises for this GPU (pynvml.NVML_ERROR_*)."""

    uuid: str
    bus_id: str
    name: str = "NVIDIA H100 80GB HBM3"
    minor: int = 0
    memory_total: int = 81559 * MIB
    memory_used: int = 0
    numa_node: int = 0
    cpus: tuple[int, ...] = ()
    nvlinks: list[tuple[str, int]] = field(default_factory=list)
    """Active links: (remote PCI bus id, NVML_NVLINK_DEVICE_TYPE_*)."""
    power_limit: int = 700_000
    power_min: int = 200_000
    power_max: int = 700_000
    power_default: int = 700_000
    power_draw: int = 112_000
    temperature: int = 33
    utilization: int = 0
    mig: list[FakeMig] = field(default_factory=list)
    processes: list[tuple[int, int, int, int]] = field(default_factory=list)
    """Compute processes: (pid, used bytes, GPU instance, compute instance)."""
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class FakeMig:
    uuid: str
    slot: int
    profile: str
    memory_total: int
    gpu_instance: int
    compute_instance: int


@dataclass(frozen=True)
class Handle:
    gpu: int
    mig: int | None = None


class FakeNvml:
    """Module-like: NVML's constants and error classes are pynvml's own."""

    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: list[FakeGpu], *, init_error: int | None = None) -> None:
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlEventType")):
                setattr(self, name, getattr(pynvml, name))
        self.gpus = gpus
        self.init_error = init_error
        self.missing: set[str] = set()
        """Functions this 'library' lacks (an older driver): FUNCTION_NOT_FOUND."""
        self.events: list[SimpleNamespace] = []
        self.calls: list[str] = []
        self.initialised = 0

    def _gpu(self, handle: Handle, name: str) -> FakeGpu:
        self.calls.append(name)
        if name in self.missing:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        gpu = self.gpus[handle.gpu]
        if name in gpu.errors:
            raise pynvml.NVMLError(gpu.errors[name])
        return gpu

    # --- library ---
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        self._gpu(Handle(index), "nvmlDeviceGetHandleByIndex")
        return Handle(index)

    # --- inventory ---
    def nvmlDeviceGetUUID(self, h: Handle) -> str:
        gpu = self._gpu(h, "nvmlDeviceGetUUID")
        return gpu.mig[h.mig].uuid if h.mig is not None else gpu.uuid

    def nvmlDeviceGetName(self, h: Handle) -> str:
        gpu = self._gpu(h, "nvmlDeviceGetName")
        return f"{gpu.name} MIG {gpu.mig[h.mig].profile}" if h.mig is not None else gpu.name

    def nvmlDeviceGetPciInfo(self, h: Handle) -> SimpleNamespace:
        return SimpleNamespace(busId=self._gpu(h, "nvmlDeviceGetPciInfo").bus_id.encode())

    def nvmlDeviceGetMinorNumber(self, h: Handle) -> int:
        return self._gpu(h, "nvmlDeviceGetMinorNumber").minor

    def nvmlDeviceGetMemoryInfo(self, h: Handle) -> SimpleNamespace:
        gpu = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        total = gpu.mig[h.mig].memory_total if h.mig is not None else gpu.memory_total
        return SimpleNamespace(total=total, used=gpu.memory_used, free=total - gpu.memory_used)

    def nvmlDeviceGetNumaNodeId(self, h: Handle) -> int:
        return self._gpu(h, "nvmlDeviceGetNumaNodeId").numa_node

    def nvmlDeviceGetCpuAffinity(self, h: Handle, words: int) -> list[int]:
        gpu = self._gpu(h, "nvmlDeviceGetCpuAffinity")
        mask = [0] * max(words, 4)
        for cpu in gpu.cpus:
            mask[cpu // 64] |= 1 << (cpu % 64)
        return mask

    def nvmlDeviceGetMigMode(self, h: Handle) -> list[int]:
        gpu = self._gpu(h, "nvmlDeviceGetMigMode")
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Handle) -> int:
        self._gpu(h, "nvmlDeviceGetMaxMigDeviceCount")
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Handle, slot: int) -> Handle:
        gpu = self._gpu(h, "nvmlDeviceGetMigDeviceHandleByIndex")
        for i, m in enumerate(gpu.mig):
            if m.slot == slot:
                return Handle(h.gpu, i)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetGpuInstanceId(self, h: Handle) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetGpuInstanceId")
        assert h.mig is not None
        return gpu.mig[h.mig].gpu_instance

    def nvmlDeviceGetComputeInstanceId(self, h: Handle) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetComputeInstanceId")
        assert h.mig is not None
        return gpu.mig[h.mig].compute_instance

    # --- topology ---
    def nvmlDeviceGetTopologyCommonAncestor(self, a: Handle, b: Handle) -> int:
        ga = self._gpu(a, "nvmlDeviceGetTopologyCommonAncestor")
        gb = self.gpus[b.gpu]
        if ga.numa_node != gb.numa_node:
            return int(pynvml.NVML_TOPOLOGY_SYSTEM)
        return int(
            pynvml.NVML_TOPOLOGY_MULTIPLE if a.gpu // 2 == b.gpu // 2 else pynvml.NVML_TOPOLOGY_NODE
        )

    def _link(self, h: Handle, link: int, name: str) -> tuple[str, int]:
        gpu = self._gpu(h, name)
        if link >= len(gpu.nvlinks):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.nvlinks[link]

    def nvmlDeviceGetNvLinkState(self, h: Handle, link: int) -> int:
        self._link(h, link, "nvmlDeviceGetNvLinkState")
        return int(pynvml.NVML_FEATURE_ENABLED)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: Handle, link: int) -> SimpleNamespace:
        return SimpleNamespace(
            busId=self._link(h, link, "nvmlDeviceGetNvLinkRemotePciInfo")[0].encode()
        )

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: Handle, link: int) -> int:
        return self._link(h, link, "nvmlDeviceGetNvLinkRemoteDeviceType")[1]

    # --- telemetry ---
    def nvmlDeviceGetUtilizationRates(self, h: Handle) -> SimpleNamespace:
        return SimpleNamespace(
            gpu=self._gpu(h, "nvmlDeviceGetUtilizationRates").utilization, memory=0
        )

    def nvmlDeviceGetPowerUsage(self, h: Handle) -> int:
        return self._gpu(h, "nvmlDeviceGetPowerUsage").power_draw

    def nvmlDeviceGetPowerManagementLimit(self, h: Handle) -> int:
        return self._gpu(h, "nvmlDeviceGetPowerManagementLimit").power_limit

    def nvmlDeviceGetPowerManagementLimitConstraints(self, h: Handle) -> list[int]:
        gpu = self._gpu(h, "nvmlDeviceGetPowerManagementLimitConstraints")
        return [gpu.power_min, gpu.power_max]

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: Handle) -> int:
        return self._gpu(h, "nvmlDeviceGetPowerManagementDefaultLimit").power_default

    def nvmlDeviceGetTemperature(self, h: Handle, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(h, "nvmlDeviceGetTemperature").temperature

    def nvmlDeviceSetPowerManagementLimit(self, h: Handle, limit: int) -> None:
        gpu = self._gpu(h, "nvmlDeviceSetPowerManagementLimit")
        if not gpu.power_min <= limit <= gpu.power_max:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu.power_limit = limit

    # --- processes ---
    def _processes(self, h: Handle, name: str) -> list[SimpleNamespace]:
        gpu = self._gpu(h, name)
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=gi, computeInstanceId=ci)
            for pid, used, gi, ci in gpu.processes
        ]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: Handle) -> list[SimpleNamespace]:
        return self._processes(h, "nvmlDeviceGetComputeRunningProcesses_v3")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: Handle) -> list[SimpleNamespace]:
        return self._processes(h, "nvmlDeviceGetComputeRunningProcesses_v2")

    # --- events ---
    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, h: Handle) -> int:
        self._gpu(h, "nvmlDeviceGetSupportedEventTypes")
        return int(pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError)

    def nvmlDeviceRegisterEvents(self, h: Handle, types: int, events: str) -> None:
        self._gpu(h, "nvmlDeviceRegisterEvents")

    def nvmlEventSetWait(self, events: str, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0, "the daemon's tick must never wait on NVML"
        if not self.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def nvmlEventSetFree(self, events: str) -> None:
        self.calls.append("nvmlEventSetFree")

    def xid(self, gpu: int, xid: int, gi: int = 0xFFFFFFFF, ci: int = 0xFFFFFFFF) -> None:
        """Queue an Xid event, as the driver would after an error on `gpu`."""
        self.events.append(
            SimpleNamespace(
                device=Handle(gpu),
                eventType=pynvml.nvmlEventTypeXidCriticalError,
                eventData=xid,
                gpuInstanceId=gi,
                computeInstanceId=ci,
            )
        )


# DGX H100: 8 GPUs, each with 18 NVLinks spread over 4 NVSwitches (5+4+4+5 links, as in
# the HGX H100 baseboard), GPU PCI addresses from the DGX H100 user guide, NUMA 0 and 1.
H100_BUSES = ["1B", "43", "52", "61", "9D", "C3", "D1", "DF"]
NVSWITCH_BUSES = ["00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0"]
_SWITCH_LINKS = [5, 4, 4, 5]


def dgx_h100() -> list[FakeGpu]:
    links = [
        (bus, pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)
        for bus, n in zip(NVSWITCH_BUSES, _SWITCH_LINKS, strict=True)
        for _ in range(n)
    ]
    return [
        FakeGpu(
            uuid=f"GPU-h100000{i}-0000-4000-8000-00000000000{i}",
            bus_id=f"00000000:{bus}:00.0",
            minor=i,
            numa_node=i // 4,
            cpus=tuple(range(0, 56)) + tuple(range(112, 168))
            if i < 4
            else tuple(range(56, 112)) + tuple(range(168, 224)),
            nvlinks=copy.copy(links),
        )
        for i, bus in enumerate(H100_BUSES)
    ]


# DGX-1V, GPUs 0-3: direct NVLinks GPU to GPU (0-1: 1, 0-2: 1, 0-3: 2, 1-2: 2, 1-3: 1,
# 2-3: 2), PCI addresses from NCCL's topology dump of a DGX-1V.
V100_BUSES = ["00000000:06:00.0", "00000000:07:00.0", "00000000:0A:00.0", "00000000:0B:00.0"]
_V100_LINKS = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (1, 2): 2, (1, 3): 1, (2, 3): 2}


def dgx1_quad() -> list[FakeGpu]:
    gpus = [
        FakeGpu(
            uuid=f"GPU-v100000{i}-0000-4000-8000-00000000000{i}",
            bus_id=bus,
            name="Tesla V100-SXM2-32GB",
            minor=i,
            memory_total=32510 * MIB,
            power_limit=300_000,
            power_min=150_000,
            power_max=300_000,
            power_default=300_000,
        )
        for i, bus in enumerate(V100_BUSES)
    ]
    gpu_type = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
    for (a, b), n in _V100_LINKS.items():
        gpus[a].nvlinks += [(V100_BUSES[b], gpu_type)] * n
        gpus[b].nvlinks += [(V100_BUSES[a], gpu_type)] * n
    return gpus


# --- the real NVML of the host the tests run on --------------------------------------------

NO_NVML = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "libnvidia-ml.so.1 not found: no NVIDIA driver, or a container not given it"
    ),
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA driver is not loaded (nvidia.ko)",
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission to open the NVIDIA devices (/dev/nvidia*)",
}
"""The one-line reason nodeagent gives for each way NVML fails to start."""


def host_nvml() -> tuple[int, str]:
    """What this host's NVML says, asked through the real pynvml directly (not through
    nodeagent): its GPU count and "" when it starts, else 0 and the reason nodeagent must
    give for its failure (the line of NO_NVML, or NVML's own words after "NVML could not
    start: ")."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return 0, NO_NVML.get(getattr(e, "value", None), f"NVML could not start: {e}")
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()
    return count, "" if count else "NVML found no GPUs"
