"""A GPU backend's figures as series: each GPU's health and telemetry, each workload's GPU
memory and processes.

Read from the backend at every scrape, on the HTTP server's thread (NVML is thread-safe),
so the figures are as fresh as the scrape. A backend that fails is logged when its error
changes, and that scrape has no GPU series; the rest of the scrape is unaffected.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import structlog

from nodeagent.errors import one_line
from nodeagent.gpu.backend import GpuBackend
from nodeagent.gpu.model import Device, GpuProcess, Telemetry
from nodeagent.metrics.families import Scrape

log = structlog.get_logger("nodeagent")


class GpuMetrics:
    def __init__(self, backend: GpuBackend) -> None:
        self.backend = backend
        self._error: str | None = None

    def render(self, out: Scrape, workloads: Mapping[str, tuple[str, ...]]) -> None:
        """`workloads`: each claimed workload's labels, by cgroup path."""
        try:
            devices = self.backend.inventory()
            telemetry = self.backend.telemetry()
            processes = self.backend.processes() if workloads else ()
        except Exception as e:  # NVML gone, a driver reload: the CPU series still count
            if one_line(e) != self._error:
                self._error = one_line(e)
                log.warning("metrics.gpus_unreadable", error=self._error)
            return
        self._error = None
        for d in devices:
            _device(out, d)
        for t in telemetry:
            _telemetry(out, t)
        _by_workload(out, devices, processes, workloads)


def _device(out: Scrape, d: Device) -> None:
    gpu = (str(d.index), d.uuid)
    out.add("nodeagent_gpu_info", (*gpu, d.name, "true" if d.simulated else "false"), 1)
    out.add("nodeagent_gpu_healthy", gpu, int(d.healthy))


def _telemetry(out: Scrape, t: Telemetry) -> None:
    gpu = (str(t.index), t.uuid)
    out.add("nodeagent_gpu_utilization_ratio", gpu, _scaled(t.utilization, 100))
    out.add("nodeagent_gpu_memory_used_bytes", gpu, t.memory_used)
    out.add("nodeagent_gpu_memory_total_bytes", gpu, t.memory_total)
    out.add("nodeagent_gpu_power_draw_watts", gpu, _scaled(t.power_draw_mw, 1000))
    out.add("nodeagent_gpu_power_limit_watts", gpu, _scaled(t.power_limit_mw, 1000))
    out.add("nodeagent_gpu_temperature_celsius", gpu, t.temperature_c)


def _scaled(value: int | None, per: int) -> float | None:
    return None if value is None else value / per


def _by_workload(
    out: Scrape,
    devices: tuple[Device, ...],
    processes: tuple[GpuProcess, ...],
    workloads: Mapping[str, tuple[str, ...]],
) -> None:
    """A process belongs to the claimed workload whose cgroup holds it, at any depth, and
    to the GPU it runs on, or whose MIG instance it runs in."""
    where = {d.uuid: (str(d.index), d.uuid, "") for d in devices}
    where.update((m.uuid, (str(d.index), d.uuid, m.uuid)) for d in devices for m in d.mig_devices)
    memory: dict[tuple[str, str], int] = defaultdict(int)
    count: dict[tuple[str, str], int] = defaultdict(int)
    for p in processes:
        path = p.cgroup
        while path and path not in workloads:
            path = path.rpartition("/")[0]
        if path:
            count[path, p.device_uuid] += 1
            memory[path, p.device_uuid] += p.used_memory or 0
    for (path, device), n in sorted(count.items()):
        # a device the inventory lacks (it changed since): its UUID, without an index
        labels = (*workloads[path], *where.get(device, ("", device, "")))
        out.add("nodeagent_workload_gpu_processes", labels, n)
        out.add("nodeagent_workload_gpu_memory_bytes", labels, memory[path, device])
