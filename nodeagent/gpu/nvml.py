"""NVML, through nvidia-ml-py (`pynvml`): the only module that talks to the driver.

NVML is initialised once and kept for the backend's life. Errors follow nvitop's
nvmlQuery: a figure a device does not support (NOT_SUPPORTED and its kin) is None for
that one figure; any other failure (GPU_IS_LOST, UNKNOWN, ...) marks only that device
unhealthy, with the reason, and the other devices carry on. Unhealthy stays unhealthy
until the backend is reopened, as NVIDIA's device plugin does: a lost GPU comes back
only after a reset.

Topology follows nvidia-smi topo -m. NVLinks are counted per link from the remote end's
PCI address; on NVSwitch systems that end is a switch, not the peer GPU (go-gpuallocator
misses this and sees no NVLink at all), so every GPU behind one switch fabric counts as
NVLink-connected to every other, with the fewer of the two GPUs' links to the fabric.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pynvml

from nodeagent.gpu.backend import GpuBackend, GpuError, NoGpus
from nodeagent.gpu.model import (
    Device,
    GpuProcess,
    Link,
    MigDevice,
    PcieLevel,
    PowerLimit,
    Telemetry,
    Topology,
    XidEvent,
)
from nodeagent.gpu.procs import cgroup_of

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""Xids that an application causes, which leave the GPU healthy: the list NVIDIA's
k8s-device-plugin ignores (internal/rm/health.go): graphics engine exception, GPU memory
page fault, GPU stopped processing, preemptive cleanup, video processor exception,
context switch timeout."""

_NO_INSTANCE = 0xFFFFFFFF
"""gpuInstanceId/computeInstanceId of an event or process that is not in a MIG instance."""
_PCI_CLASS_NVSWITCH = "0x068000"
"""'Bridge / other': the PCI class NCCL uses to recognise an NVSwitch."""
_MAX_EVENTS_PER_POLL = 1024

_LEVELS = {
    0: PcieLevel.PIX,  # NVML_TOPOLOGY_INTERNAL: two GPUs on one board
    10: PcieLevel.PIX,  # NVML_TOPOLOGY_SINGLE
    20: PcieLevel.PXB,  # NVML_TOPOLOGY_MULTIPLE
    30: PcieLevel.PHB,  # NVML_TOPOLOGY_HOSTBRIDGE
    40: PcieLevel.NODE,  # NVML_TOPOLOGY_NODE
    50: PcieLevel.SYS,  # NVML_TOPOLOGY_SYSTEM
}


def open_nvml(proc_root: str = "/proc", sys_root: str = "/sys", nvml: Any = pynvml) -> GpuBackend:
    """NVML's GPUs, or NoGpus with the reason when NVML cannot start on this host.

    `nvml` is the pynvml module; tests pass a stand-in with the same functions.
    """
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return NoGpus(_init_failure(nvml, e))
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError as e:
        nvml.nvmlShutdown()
        return NoGpus(f"NVML started but cannot count GPUs: {e}")
    if count == 0:
        nvml.nvmlShutdown()
        return NoGpus("NVML found no GPUs")
    return NvmlBackend(nvml, count, proc_root, sys_root)


def _init_failure(nvml: Any, e: Exception) -> str:
    value = getattr(e, "value", None)
    if value == nvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return "libnvidia-ml.so.1 not found: no NVIDIA driver, or a container not given it"
    if value == nvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return "the NVIDIA driver is not loaded (nvidia.ko)"
    if value == nvml.NVML_ERROR_NO_PERMISSION:
        return "no permission to open the NVIDIA devices (/dev/nvidia*)"
    return f"NVML could not start: {e}"


def _text(value: object) -> str:
    """Strings come back from pynvml as str or, inside structures, as bytes."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _bus_key(bus_id: str) -> str:
    """'00000000:1B:00.0' as sysfs spells it: '0000:1b:00.0'."""
    return bus_id.strip().lower()[-12:]


class NvmlBackend:
    """The GPUs NVML reports. Static facts (UUIDs, PCI addresses, memory size, NUMA) are
    read once; MIG devices, telemetry and processes on every call; topology on first use."""

    simulated = False
    reason = ""

    def __init__(self, nvml: Any, count: int, proc_root: str, sys_root: str) -> None:
        self._nv = nvml
        self._proc_root = proc_root
        self._sys_root = sys_root
        self._unhealthy: dict[str, str] = {}
        """Reason per unhealthy GPU (by index, as str) or MIG device (by UUID)."""
        self._closed = False
        driver = self._call(None, "nvmlSystemGetDriverVersion")
        self.source = f"NVML, driver {_text(driver)}" if driver is not None else "NVML"
        self._handles: list[Any] = []
        for index in range(count):
            self._handles.append(self._call(str(index), "nvmlDeviceGetHandleByIndex", index))
        self._static = [self._describe(i, h) for i, h in enumerate(self._handles)]
        self._topology: Topology | None = None
        self._events = self._watch_xids()

    # --- error handling (nvitop's nvmlQuery) ------------------------------------------------

    def _absent(self, e: Exception) -> bool:
        """Errors that mean 'this device does not report that', not 'this device failed'."""
        nv = self._nv
        return getattr(e, "value", None) in (
            nv.NVML_ERROR_NOT_SUPPORTED,
            nv.NVML_ERROR_FUNCTION_NOT_FOUND,
            nv.NVML_ERROR_NO_PERMISSION,
            nv.NVML_ERROR_NO_DATA,
        )

    def _call(self, key: str | None, name: str, *args: object) -> Any:
        """NVML's `name`(*args); None when it fails. A failure other than 'not supported'
        marks the device `key` (a GPU index, or a MIG UUID) unhealthy."""
        try:
            return getattr(self._nv, name)(*args)
        except self._nv.NVMLError as e:
            if key is not None and not self._absent(e):
                self._mark(key, f"{name.removeprefix('nvml')}: {e}")
            return None

    def _mark(self, key: str, reason: str) -> None:
        self._unhealthy.setdefault(key, reason)

    # --- inventory -------------------------------------------------------------------------

    def _describe(self, index: int, handle: Any) -> Device:
        key = str(index)
        if handle is None:
            return Device(index, "", "", "", None, None, None, (), None, healthy=False)
        uuid = _text(self._call(key, "nvmlDeviceGetUUID", handle) or "")
        pci = self._call(key, "nvmlDeviceGetPciInfo", handle)
        bus_id = _text(pci.busId) if pci is not None else ""
        memory = self._call(key, "nvmlDeviceGetMemoryInfo", handle)
        numa = self._call(key, "nvmlDeviceGetNumaNodeId", handle)
        return Device(
            index=index,
            uuid=uuid,
            name=_text(self._call(key, "nvmlDeviceGetName", handle) or ""),
            pci_bus_id=bus_id,
            minor=self._call(key, "nvmlDeviceGetMinorNumber", handle),
            memory_total=int(memory.total) if memory is not None else None,
            numa_node=numa if isinstance(numa, int) and numa >= 0 else self._sysfs_numa(bus_id),
            cpus=self._cpus(key, handle),
            mig_enabled=None,
        )

    def _sysfs_numa(self, bus_id: str) -> int | None:
        """Older drivers lack nvmlDeviceGetNumaNodeId; the kernel knows the PCI device's node."""
        if not bus_id:
            return None
        path = os.path.join(self._sys_root, "bus/pci/devices", _bus_key(bus_id), "numa_node")
        try:
            with open(path, encoding="ascii") as f:
                node = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return node if node >= 0 else None

    def _cpus(self, key: str, handle: Any) -> tuple[int, ...]:
        words = ((os.cpu_count() or 1) + 63) // 64
        mask = self._call(key, "nvmlDeviceGetCpuAffinity", handle, words)
        if mask is None:
            return ()
        return tuple(
            w * 64 + bit for w, word in enumerate(mask) for bit in range(64) if int(word) >> bit & 1
        )

    def inventory(self) -> tuple[Device, ...]:
        out = []
        for device, handle in zip(self._static, self._handles, strict=True):
            key = str(device.index)
            mig_enabled: bool | None = None
            migs: tuple[MigDevice, ...] = ()
            if handle is not None:
                mode = self._call(key, "nvmlDeviceGetMigMode", handle)
                if mode is not None:
                    mig_enabled = int(mode[0]) == self._nv.NVML_DEVICE_MIG_ENABLE
                if mig_enabled:
                    migs = self._mig_devices(device, handle)
            reason = self._unhealthy.get(key, "")
            out.append(
                replace(
                    device,
                    mig_enabled=mig_enabled,
                    mig_devices=migs,
                    healthy=not reason and handle is not None,
                    reason=reason or ("" if handle is not None else "no NVML handle"),
                )
            )
        return tuple(out)

    def _mig_devices(self, parent: Device, handle: Any) -> tuple[MigDevice, ...]:
        key = str(parent.index)
        slots = self._call(key, "nvmlDeviceGetMaxMigDeviceCount", handle) or 0
        out = []
        for slot in range(int(slots)):
            try:
                mig = self._nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except self._nv.NVMLError:
                continue  # an empty slot: NOT_FOUND or INVALID_ARGUMENT
            uuid = _text(self._call(key, "nvmlDeviceGetUUID", mig) or "")
            if not uuid:
                continue
            name = _text(self._call(uuid, "nvmlDeviceGetName", mig) or "")
            memory = self._call(uuid, "nvmlDeviceGetMemoryInfo", mig)
            reason = self._unhealthy.get(uuid, "")
            out.append(
                MigDevice(
                    uuid=uuid,
                    parent_uuid=parent.uuid,
                    index=slot,
                    profile=name.rpartition(" MIG ")[2] if " MIG " in name else name,
                    memory_total=int(memory.total) if memory is not None else None,
                    gpu_instance=self._call(uuid, "nvmlDeviceGetGpuInstanceId", mig),
                    compute_instance=self._call(uuid, "nvmlDeviceGetComputeInstanceId", mig),
                    healthy=not reason,
                    reason=reason,
                )
            )
        return tuple(out)

    # --- topology --------------------------------------------------------------------------

    def topology(self) -> Topology:
        if self._topology is None:
            self._topology = self._read_topology()
        return self._topology

    def _read_topology(self) -> Topology:
        present = [
            (d.index, h) for d, h in zip(self._static, self._handles, strict=True) if h is not None
        ]
        by_bus = {_bus_key(d.pci_bus_id): d.index for d in self._static if d.pci_bus_id}
        direct: dict[tuple[int, int], int] = {}
        switch_ports: dict[int, list[str]] = {}
        for index, handle in present:
            for to_switch, remote in self._nvlink_remotes(index, handle, by_bus):
                if to_switch:
                    switch_ports.setdefault(index, []).append(remote)
                elif remote in by_bus:
                    direct[index, by_bus[remote]] = direct.get((index, by_bus[remote]), 0) + 1
        fabric = _fabrics(switch_ports)
        links: dict[tuple[int, int], Link] = {}
        for i, (a, ha) in enumerate(present):
            for b, hb in present[i + 1 :]:
                level = self._call(str(a), "nvmlDeviceGetTopologyCommonAncestor", ha, hb)
                nvlinks = min(direct.get((a, b), 0), direct.get((b, a), 0))
                shared = a in fabric and fabric.get(a) == fabric.get(b)
                if shared:
                    nvlinks += min(len(switch_ports[a]), len(switch_ports[b]))
                links[a, b] = Link(_LEVELS.get(level, PcieLevel.SYS), nvlinks, shared)
        return Topology(links)

    def _nvlink_remotes(
        self, index: int, handle: Any, gpus: dict[str, int]
    ) -> list[tuple[bool, str]]:
        """The far end of each active NVLink: (True, the switch's bus key, '' if unknown) for
        an NVSwitch, (False, the GPU's bus key) for a GPU.

        Links a GPU does not have answer NOT_SUPPORTED or INVALID_ARGUMENT; links to an
        IBM NPU (a POWER9 CPU) are not GPU-to-GPU and are left out.
        """
        nv = self._nv
        out: list[tuple[bool, str]] = []
        for link in range(int(nv.NVML_NVLINK_MAX_LINKS)):
            try:
                if int(nv.nvmlDeviceGetNvLinkState(handle, link)) != nv.NVML_FEATURE_ENABLED:
                    continue
            except nv.NVMLError as e:
                if self._absent(e) or e.value == nv.NVML_ERROR_INVALID_ARGUMENT:
                    continue
                self._mark(str(index), f"DeviceGetNvLinkState({link}): {e}")
                break
            pci = self._call(str(index), "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
            remote = _bus_key(_text(pci.busId)) if pci is not None else ""
            kind = self._call(None, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
            if kind == nv.NVML_NVLINK_DEVICE_TYPE_IBMNPU:
                continue
            if kind == nv.NVML_NVLINK_DEVICE_TYPE_GPU or (kind is None and remote in gpus):
                out.append((False, remote))
            elif kind == nv.NVML_NVLINK_DEVICE_TYPE_SWITCH or self._is_switch(remote):
                out.append((True, remote))
        return out

    def _is_switch(self, bus_key: str) -> bool:
        """Without the remote device type (older drivers), ask the kernel for the PCI class."""
        path = os.path.join(self._sys_root, "bus/pci/devices", bus_key, "class")
        try:
            with open(path, encoding="ascii") as f:
                return f.read().strip() == _PCI_CLASS_NVSWITCH
        except OSError:
            return False

    # --- telemetry and processes -----------------------------------------------------------

    def telemetry(self) -> tuple[Telemetry, ...]:
        out = []
        for device, handle in zip(self._static, self._handles, strict=True):
            if handle is None:
                continue
            key = str(device.index)

            def read(name: str, *args: object, key: str = key, handle: Any = handle) -> Any:
                return self._call(key, name, handle, *args)

            util = read("nvmlDeviceGetUtilizationRates")
            memory = read("nvmlDeviceGetMemoryInfo")
            limits = read("nvmlDeviceGetPowerManagementLimitConstraints")
            out.append(
                Telemetry(
                    uuid=device.uuid,
                    index=device.index,
                    utilization=int(util.gpu) if util is not None else None,
                    memory_used=int(memory.used) if memory is not None else None,
                    memory_total=int(memory.total) if memory is not None else None,
                    power_draw_mw=read("nvmlDeviceGetPowerUsage"),
                    power_limit_mw=read("nvmlDeviceGetPowerManagementLimit"),
                    power_min_mw=int(limits[0]) if limits is not None else None,
                    power_max_mw=int(limits[1]) if limits is not None else None,
                    power_default_mw=read("nvmlDeviceGetPowerManagementDefaultLimit"),
                    temperature_c=read("nvmlDeviceGetTemperature", self._nv.NVML_TEMPERATURE_GPU),
                )
            )
        return tuple(out)

    def processes(self) -> tuple[GpuProcess, ...]:
        out = []
        for device in self.inventory():
            handle = self._handles[device.index]
            if handle is None:
                continue
            instances = {(m.gpu_instance, m.compute_instance): m.uuid for m in device.mig_devices}
            for p in self._compute_processes(str(device.index), handle):
                uuid = device.uuid
                if p.gpuInstanceId != _NO_INSTANCE:
                    uuid = instances.get((p.gpuInstanceId, p.computeInstanceId), device.uuid)
                memory = p.usedGpuMemory
                out.append(
                    GpuProcess(
                        pid=int(p.pid),
                        device_uuid=uuid,
                        used_memory=int(memory) if memory is not None else None,
                        cgroup=cgroup_of(int(p.pid), self._proc_root),
                    )
                )
        return tuple(out)

    def _compute_processes(self, key: str, handle: Any) -> list[Any]:
        """The v3 call (driver 510+), else v2 on older drivers."""
        try:
            return list(self._nv.nvmlDeviceGetComputeRunningProcesses_v3(handle))
        except self._nv.NVMLError as e:
            if e.value != self._nv.NVML_ERROR_FUNCTION_NOT_FOUND:
                if not self._absent(e):
                    self._mark(key, f"DeviceGetComputeRunningProcesses: {e}")
                return []
        return list(self._call(key, "nvmlDeviceGetComputeRunningProcesses_v2", handle) or [])

    # --- health ----------------------------------------------------------------------------

    def _watch_xids(self) -> Any:
        """An event set with every GPU that can report critical Xid errors."""
        nv = self._nv
        events = self._call(None, "nvmlEventSetCreate")
        if events is None:
            return None
        for index, handle in enumerate(self._handles):
            if handle is None:
                continue
            supported = self._call(str(index), "nvmlDeviceGetSupportedEventTypes", handle) or 0
            if int(supported) & nv.nvmlEventTypeXidCriticalError:
                self._call(
                    str(index),
                    "nvmlDeviceRegisterEvents",
                    handle,
                    nv.nvmlEventTypeXidCriticalError,
                    events,
                )
        return events

    def poll_health(self) -> tuple[XidEvent, ...]:
        nv, out = self._nv, []
        if self._events is None:
            return ()
        by_uuid = {d.uuid: d.index for d in self._static}
        for _ in range(_MAX_EVENTS_PER_POLL):
            try:
                event = nv.nvmlEventSetWait(self._events, 0)
            except nv.NVMLError as e:
                if e.value != nv.NVML_ERROR_TIMEOUT:
                    # As NVIDIA's device plugin does: a broken event wait says nothing
                    # good about any GPU.
                    for d in self._static:
                        self._mark(str(d.index), f"Xid event wait failed: {e}")
                break
            if int(event.eventType) != nv.nvmlEventTypeXidCriticalError:
                continue
            xid = int(event.eventData)
            uuid = _text(self._call(None, "nvmlDeviceGetUUID", event.device) or "")
            critical = xid not in APPLICATION_XIDS
            key = self._event_device(uuid, by_uuid, event)
            if critical and key is not None:
                self._mark(key, f"critical Xid {xid}")
            mig = key if key is not None and key.startswith("MIG-") else None
            out.append(XidEvent(device_uuid=mig or uuid, xid=xid, critical=critical))
        return tuple(out)

    def health(self) -> dict[str, str]:
        """`_unhealthy` by UUID: GPUs are keyed there by index, MIG devices by UUID."""
        out = {}
        for key, reason in self._unhealthy.items():
            uuid = self._static[int(key)].uuid if key.isdigit() else key
            if uuid:
                out[uuid] = reason
        return out

    def _event_device(self, uuid: str, by_uuid: dict[str, int], event: Any) -> str | None:
        """The health key an event belongs to: its MIG device when it names one, else its GPU."""
        if uuid not in by_uuid:
            return None
        index = by_uuid[uuid]
        gi, ci = int(event.gpuInstanceId), int(event.computeInstanceId)
        if _NO_INSTANCE not in (gi, ci) and self._handles[index] is not None:
            for mig in self._mig_devices(self._static[index], self._handles[index]):
                if (mig.gpu_instance, mig.compute_instance) == (gi, ci):
                    return mig.uuid
        return str(index)

    # --- power -----------------------------------------------------------------------------

    def set_power_limit(self, uuid: str, milliwatts: int) -> PowerLimit:
        nv = self._nv
        device = next((d for d in self._static if d.uuid == uuid and uuid), None)
        if device is None or self._handles[device.index] is None:
            raise GpuError(f"no GPU with UUID {uuid!r} on this node")
        handle = self._handles[device.index]

        def attempt(what: str, fn: Callable[..., Any], *args: object) -> Any:
            try:
                return fn(handle, *args)
            except nv.NVMLError as e:
                hint = " (needs root)" if e.value == nv.NVML_ERROR_NO_PERMISSION else ""
                raise GpuError(f"GPU {device.index} ({uuid}): {what}: {e}{hint}") from None

        low, high = (
            int(v)
            for v in attempt(
                "reading power limit constraints", nv.nvmlDeviceGetPowerManagementLimitConstraints
            )
        )
        target = min(max(milliwatts, low), high)
        attempt("setting the power limit", nv.nvmlDeviceSetPowerManagementLimit, target)
        applied = int(attempt("reading back the power limit", nv.nvmlDeviceGetPowerManagementLimit))
        return PowerLimit(uuid, milliwatts, applied, low, high)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._events is not None:
            self._call(None, "nvmlEventSetFree", self._events)
        self._call(None, "nvmlShutdown")


def _fabrics(switch_ports: dict[int, list[str]]) -> dict[int, int]:
    """GPUs grouped into NVSwitch fabrics: two GPUs share a fabric when their links reach a
    common switch. Switches of unknown address are taken to be one fabric."""
    parent = {g: g for g in switch_ports}

    def root(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    owner: dict[str, int] = {}
    for gpu, ports in sorted(switch_ports.items()):
        for port in ports:
            if port in owner:
                parent[root(gpu)] = root(owner[port])
            else:
                owner[port] = gpu
    return {g: root(g) for g in switch_ports}
