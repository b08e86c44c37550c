"""Node-wide CPU and memory, from an injectable /proc (psutil reads it via PROCFS_PATH)."""

from __future__ import annotations

import os

import psutil

from nodeagent.snapshot import NodeState


class NodeSensor:
    """Turns /proc/stat's cumulative CPU times into a busy fraction between two reads."""

    def __init__(self, proc_root: str = "/proc") -> None:
        psutil.PROCFS_PATH = proc_root
        self._last: tuple[float, float] | None = None
        self.page_size = os.sysconf("SC_PAGE_SIZE")

    def read(self) -> NodeState:
        times = psutil.cpu_times()
        idle = times.idle + getattr(times, "iowait", 0.0)
        total = sum(times)
        busy: float | None = None
        if self._last is not None:
            d_total, d_idle = total - self._last[0], idle - self._last[1]
            busy = max(0.0, min(1.0, 1 - d_idle / d_total)) if d_total > 0 else 0.0
        self._last = (total, idle)
        mem = psutil.virtual_memory()
        return NodeState(
            cpu_count=psutil.cpu_count() or 1,
            cpu_busy=busy,
            memory_total=mem.total,
            memory_available=mem.available,
            page_size=self.page_size,
        )
