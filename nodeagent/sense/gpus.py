"""Reads the node's GPUs once per tick through the one GPU backend.

The inventory and topology are read at start and again whenever the driver reports an
Xid, so a GPU lost or recovered shows in the next tick; telemetry and compute processes
are read every tick. A backend that fails as a whole (the driver gone) gives no GPU
state for that tick, said once in the log: CPU and memory management go on.
"""

from __future__ import annotations

import structlog

from nodeagent.errors import one_line
from nodeagent.gpu.backend import GpuBackend
from nodeagent.gpu.model import Device, GpuState, Hold, Topology

log = structlog.get_logger("nodeagent.gpu")


class GpuSensor:
    def __init__(self, backend: GpuBackend) -> None:
        self.backend = backend
        self._devices: tuple[Device, ...] = ()
        self._topology = Topology()
        self._read_inventory = True
        self._failing: str | None = None

    def read(self, holds: tuple[Hold, ...]) -> GpuState | None:
        try:
            if self.backend.poll_health():
                self._read_inventory = True
            if self._read_inventory:
                self._devices = self.backend.inventory()
                self._topology = self.backend.topology()
                self._read_inventory = False
            if not self._devices:
                return None
            state = GpuState(
                self._devices,
                self._topology,
                self.backend.telemetry(),
                self.backend.processes(),
                holds,
                self.backend.source,
                self.backend.simulated,
            )
        except Exception as e:  # a driver that fails as a whole: no GPUs this tick
            message = one_line(e)
            if message != self._failing:
                log.error("gpu.read_failed", error=message, action="no GPU state this tick")
                self._failing = message
            self._read_inventory = True
            return None
        if self._failing is not None:
            log.info("gpu.read_recovered")
            self._failing = None
        return state
