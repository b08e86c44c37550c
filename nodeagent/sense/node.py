"""Node-wide CPU and memory, from an injectable /proc (psutil reads it via PROCFS_PATH)."""

from __future__ import annotations

import os

import psutil

from nodeagent.snapshot import NodeState


class NodeSensor:
    """Turns /proc/stat's cumulative CPU times into a busy fraction between two reads."""

    def __init__(self, proc_root: str = "/proc") -> None:
        psutil.PROCFS_PATH = proc_root
        self._meminfo = os.path.join(proc_root, "meminfo")
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
        memory_total, memory_available = self._memory()
        return NodeState(
            cpu_count=psutil.cpu_count() or 1,
            cpu_busy=busy,
            memory_total=memory_total,
            memory_available=memory_available,
            page_size=self.page_size,
        )

    def _memory(self) -> tuple[int, int]:
        """MemTotal and MemAvailable in bytes, the two lines found in /proc/meminfo: psutil's
        virtual_memory() parses all fifty-odd of them and derives a dozen figures, the
        largest fixed cost of an idle tick. A kernel without MemAvailable (before 3.14) gets
        psutil's estimate."""
        with open(self._meminfo, "rb") as f:
            text = f.read()
        total, available = _kib(text, b"MemTotal:"), _kib(text, b"MemAvailable:")
        if total is None or available is None:
            mem = psutil.virtual_memory()
            return mem.total, mem.available
        return total, available


def _kib(text: bytes, key: bytes) -> int | None:
    """The value of meminfo's line `key` (in kB, as the kernel prints them) in bytes."""
    start = 0 if text.startswith(key) else text.find(b"\n" + key) + 1
    if start == 0 and not text.startswith(key):
        return None
    end = text.find(b"\n", start)
    fields = text[start + len(key) : None if end < 0 else end].split()
    return int(fields[0]) * 1024 if fields and fields[0].isdigit() else None
