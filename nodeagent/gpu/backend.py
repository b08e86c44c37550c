"""One interface to a node's GPUs, and the backend of a host without any.

A leaf: both backends (nvml, simulated) import it, and `choice` picks one of them. A host
without NVML's library or driver gets a backend with no GPUs and a one-line reason: CPU and
memory management go on without GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from nodeagent.errors import NodeagentError
from nodeagent.gpu.model import Device, GpuProcess, PowerLimit, Telemetry, Topology, XidEvent


class GpuError(NodeagentError):
    """A GPU operation failed: one line naming the GPU and what NVML (or the simulation) said."""


class GpuBackend(Protocol):
    """What nodeagent reads from and does to GPUs. Reads never raise for one bad device:
    a device that fails is reported unhealthy, with the reason."""

    simulated: bool
    source: str
    """Where the GPUs come from, for people: 'NVML, driver 550.54.15' or the simulated file."""
    reason: str
    """Why there are no GPUs, when there are none; empty otherwise."""

    def inventory(self) -> tuple[Device, ...]: ...

    def topology(self) -> Topology: ...

    def telemetry(self) -> tuple[Telemetry, ...]: ...

    def processes(self) -> tuple[GpuProcess, ...]: ...

    def poll_health(self) -> tuple[XidEvent, ...]:
        """Xid events since the last poll, without waiting; critical ones mark their
        device unhealthy for the rest of the backend's life."""
        ...

    def health(self) -> Mapping[str, str]:
        """Why each unhealthy GPU or MIG device (by UUID) is unhealthy, as the backend's
        calls so far found it (a GPU lost fails its next telemetry read). No driver call:
        cheap enough to ask every tick."""
        ...

    def set_power_limit(self, uuid: str, milliwatts: int) -> PowerLimit:
        """Set a GPU's power limit, clamped to the card's constraints, and read it back."""
        ...

    def close(self) -> None: ...


class NoGpus:
    """The backend of a host without usable GPUs: everything is empty, and `reason` says why."""

    simulated = False

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.source = "none"

    def inventory(self) -> tuple[Device, ...]:
        return ()

    def topology(self) -> Topology:
        return Topology()

    def telemetry(self) -> tuple[Telemetry, ...]:
        return ()

    def processes(self) -> tuple[GpuProcess, ...]:
        return ()

    def poll_health(self) -> tuple[XidEvent, ...]:
        return ()

    def health(self) -> Mapping[str, str]:
        return {}

    def set_power_limit(self, uuid: str, milliwatts: int) -> PowerLimit:
        raise GpuError(f"cannot set a power limit on {uuid}: no GPUs ({self.reason})")

    def close(self) -> None:
        return None
