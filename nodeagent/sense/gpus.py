"""Reads the node's GPUs once per tick through the one GPU backend.

The inventory and topology are read at start and again whenever the driver reports an
Xid; telemetry and compute processes are read every tick, and then the backend's health
(what those reads found: a lost GPU fails its telemetry), so a GPU lost without an Xid is
unhealthy in the same tick's state and placement passes it over. A backend that fails as
a whole (the driver gone) gives no GPU state for that tick, said once in the log: CPU and
memory management go on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

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
            telemetry = self.backend.telemetry()
            processes = self.backend.processes()
            state = GpuState(
                with_health(self._devices, self.backend.health()),
                self._topology,
                telemetry,
                processes,
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


def with_health(devices: tuple[Device, ...], unhealthy: Mapping[str, str]) -> tuple[Device, ...]:
    """The devices, each GPU and MIG device in `unhealthy` marked so with its reason."""
    if not unhealthy:
        return devices
    out = []
    for d in devices:
        migs = tuple(
            replace(m, healthy=False, reason=unhealthy[m.uuid])
            if m.healthy and m.uuid in unhealthy
            else m
            for m in d.mig_devices
        )
        lost = d.healthy and d.uuid in unhealthy
        out.append(
            replace(
                d,
                mig_devices=migs,
                healthy=d.healthy and not lost,
                reason=unhealthy[d.uuid] if lost else d.reason,
            )
        )
    return tuple(out)
