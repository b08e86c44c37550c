"""The node's GPUs as the CLI and --json show them: one reading of the hardware.

The daemon's view of a GPU adds two keys to each entry of `gpus` here: `assigned`, the
workloads it placed on the GPU, and `violations`, processes running on the GPU from a
cgroup it was not assigned to. A reading of the hardware alone has neither, so neither
key appears here.
"""

from __future__ import annotations

from typing import Any

from nodeagent.gpu.backend import GpuBackend
from nodeagent.gpu.model import Device, GpuProcess, Telemetry, format_cpulist


def _watts(mw: int | None) -> float | None:
    return None if mw is None else mw / 1000


def read_report(backend: GpuBackend) -> dict[str, Any]:
    """Inventory, telemetry, MIG devices and compute processes, per GPU, JSON-ready.

    The inventory is read last, so that a GPU whose telemetry just failed (lost) is shown
    unhealthy in the same answer."""
    telemetry = {t.uuid: t for t in backend.telemetry()}
    processes = backend.processes()
    devices = backend.inventory()
    return {
        "source": backend.source,
        "simulated": backend.simulated,
        "reason": backend.reason,
        "gpus": [_gpu(d, telemetry.get(d.uuid), processes) for d in devices],
    }


def _gpu(d: Device, t: Telemetry | None, processes: tuple[GpuProcess, ...]) -> dict[str, Any]:
    on_gpu = {d.uuid} | {m.uuid for m in d.mig_devices}
    return {
        "index": d.index,
        "uuid": d.uuid,
        "name": d.name,
        "pci_bus_id": d.pci_bus_id,
        "minor": d.minor,
        "numa_node": d.numa_node,
        "cpus": format_cpulist(d.cpus),
        "healthy": d.healthy,
        "reason": d.reason,
        "simulated": d.simulated,
        "memory_total": d.memory_total,
        "memory_used": t.memory_used if t else None,
        "utilization": t.utilization if t else None,
        "temperature_c": t.temperature_c if t else None,
        "power_draw_w": _watts(t.power_draw_mw) if t else None,
        "power_limit_w": _watts(t.power_limit_mw) if t else None,
        "power_min_w": _watts(t.power_min_mw) if t else None,
        "power_max_w": _watts(t.power_max_mw) if t else None,
        "power_default_w": _watts(t.power_default_mw) if t else None,
        "mig_enabled": d.mig_enabled,
        "mig_devices": [
            {
                "uuid": m.uuid,
                "index": m.index,
                "profile": m.profile,
                "memory_total": m.memory_total,
                "healthy": m.healthy,
                "reason": m.reason,
            }
            for m in d.mig_devices
        ],
        "processes": [
            {
                "pid": p.pid,
                "device_uuid": p.device_uuid,
                "used_memory": p.used_memory,
                "cgroup": p.cgroup,
            }
            for p in processes
            if p.device_uuid in on_gpu
        ],
    }
