"""A GPU backend's figures as series: each GPU's health and telemetry, each workload's GPU
memory and processes.

Read from the backend at every scrape, on the HTTP server's thread (NVML is thread-safe),
so the figures are as fresh as the scrape. A backend that fails is logged when its error
changes, and that scrape has no GPU series; the rest of the scrape is unaffected.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping

import structlog

from nodeagent.errors import one_line
from nodeagent.gpu.backend import GpuBackend
from nodeagent.gpu.model import Device, GpuProcess, Telemetry
from nodeagent.gpualloc.ledger import EMPTY_VIEW, LedgerView
from nodeagent.metrics.families import Scrape

log = structlog.get_logger("nodeagent")


class GpuMetrics:
    def __init__(
        self, backend: GpuBackend, ledger: Callable[[], LedgerView] = lambda: EMPTY_VIEW
    ) -> None:
        """`ledger`: the GPU ledger as the loop last published it (its queue)."""
        self.backend = backend
        self.ledger = ledger
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
        _queue(out, devices, self.ledger())
        for d in devices:
            _device(out, d)
        for t in telemetry:
            _telemetry(out, t)
        _by_workload(out, devices, processes, workloads)


def _queue(out: Scrape, devices: tuple[Device, ...], ledger: LedgerView) -> None:
    """The requests waiting, by class (0 for none), and the GPUs kept for the head of the
    queue with their expected start."""
    waiting = Counter(w.workload_class for w in ledger.queue())
    for workload_class, n in sorted(waiting.items()):
        out.add("nodeagent_gpu_requests_waiting", (workload_class,), n)
    head = ledger.reserved
    if head is None:
        return
    kept = set(head.uuids)
    for d in devices:
        if d.uuid in kept:
            out.add("nodeagent_gpu_kept_for_queue_head", (str(d.index), d.uuid, head.owner), 1)
    if head.start is not None:
        start = time.time() + head.start - time.monotonic()
        out.add("nodeagent_gpu_queue_head_expected_start_timestamp_seconds", (head.owner,), start)


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
