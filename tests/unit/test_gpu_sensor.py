"""The GPU sensor (`sense.gpus.GpuSensor`) each tick: the inventory is read at start and
again after an Xid, not every tick; a backend that fails as a whole gives no GPU state for
that tick, said once in the log (and again only when the failure changes); the first good
read after it says so, and reads the inventory afresh.

The backend is the NVML adapter over the FAKE pynvml of fake_nvml.py (a labelled stand-in);
a driver failing as a whole is the stand-in `Failing` around it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
from daemon_api import ROOT, daemon
from fake_nvml import FakeMig, FakeNvml, dgx_h100
from structlog.testing import capture_logs

from nodeagent.cgroupfs.values import Attribute
from nodeagent.errors import NotFound
from nodeagent.gpu.backend import GpuBackend, GpuError
from nodeagent.gpu.model import Device, GpuState, Telemetry
from nodeagent.gpu.nvml import NvmlBackend, open_nvml
from nodeagent.sense.gpus import GpuSensor

MIG = "MIG-5e1c4b0a-1b2c-5d3e-8f4a-9b0c1d2e3f40"


def reconfigure(fake: FakeNvml, gpu: int) -> None:
    """An operator turns MIG on for `gpu` with one 3g.40gb instance: only a fresh inventory
    shows it."""
    fake.gpus[gpu].mig = [FakeMig(MIG, 0, "3g.40gb", 40 * 1024**3, 2, 0)]


def migs(state: GpuState | None) -> list[list[str]]:
    assert state is not None
    return [[m.uuid for m in d.mig_devices] for d in state.devices]


class Watched:
    """STAND-IN around the real adapter: counts the sensor's asks for the inventory and the
    topology, and plays a driver failing as a whole (its telemetry raises `error` while it
    is set)."""

    def __init__(self, backend: NvmlBackend) -> None:
        self.backend = backend
        self.error: str | None = None
        self.asked = 0
        """How often the sensor read the inventory."""

    def inventory(self) -> tuple[Device, ...]:
        self.asked += 1
        return self.backend.inventory()

    def telemetry(self) -> tuple[Telemetry, ...]:
        if self.error is not None:
            raise GpuError(self.error)
        return self.backend.telemetry()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def watched(fake: FakeNvml) -> Watched:
    opened = open_nvml(nvml=fake)
    assert isinstance(opened, NvmlBackend)
    return Watched(opened)


def sensor_events(logs: Iterable[Mapping[str, Any]]) -> list[tuple[str, str | None]]:
    return [(e["event"], e.get("error")) for e in logs if e["event"].startswith("gpu.read")]


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(dgx_h100()[:4])


def test_the_inventory_is_read_at_start_and_after_an_xid_only(fake: FakeNvml) -> None:
    backend = watched(fake)
    sensor = GpuSensor(backend)
    for _ in range(3):
        assert sensor.read(()) is not None
    assert backend.asked == 1, "at the first read only"
    reconfigure(fake, 1)
    assert migs(sensor.read(())) == [[], [], [], []], "not read again without an Xid"
    assert backend.asked == 1
    fake.xid(2, 79)  # fallen off the bus: critical
    state = sensor.read(())
    assert backend.asked == 2
    assert migs(state) == [[], [MIG], [], []]
    assert state is not None
    health = [(d.index, d.healthy, d.reason) for d in state.devices]
    assert health == [(0, True, ""), (1, True, ""), (2, False, "critical Xid 79"), (3, True, "")]
    fake.xid(3, 31)  # an application's fault: read again, and still healthy
    state = sensor.read(())
    assert state is not None and backend.asked == 3
    assert [d.healthy for d in state.devices] == [True, True, False, True]


def test_a_failing_backend_gives_no_state_said_once_then_recovers(fake: FakeNvml) -> None:
    failing = watched(fake)
    backend: GpuBackend = failing
    sensor = GpuSensor(backend)
    assert sensor.read(()) is not None
    assert failing.asked == 1
    failing.error = "NVML: Driver/library version mismatch"
    with capture_logs() as logs:
        assert [sensor.read(()) for _ in range(3)] == [None, None, None]
    assert sensor_events(logs) == [("gpu.read_failed", failing.error)]
    (event,) = [e for e in logs if e["event"] == "gpu.read_failed"]
    assert (event["log_level"], event["action"]) == ("error", "no GPU state this tick")
    failing.error = "NVML: Unknown Error"
    with capture_logs() as logs:
        assert sensor.read(()) is None
    assert sensor_events(logs) == [("gpu.read_failed", failing.error)], "a new failure is news"
    # it comes back, MIG turned on meanwhile (as a driver reload for that would): read afresh
    reconfigure(fake, 0)
    failing.error = None
    with capture_logs() as logs:
        state = sensor.read(())
        asked = failing.asked
        again = sensor.read(())
    assert sensor_events(logs) == [("gpu.read_recovered", None)]
    assert migs(state) == migs(again) == [[MIG], [], [], []]
    assert failing.asked == asked, "read afresh at the first good read, then kept"
    # and a failure after the recovery is said again
    failing.error = "NVML: Driver/library version mismatch"
    with capture_logs() as logs:
        assert sensor.read(()) is None
    assert sensor_events(logs) == [("gpu.read_failed", failing.error)]


def test_the_daemon_ticks_on_without_gpu_state_while_the_backend_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU and memory management go on: the tick plans and writes the job's limits, with no
    GPU state and no GPU route to place on, until the backend reads again."""
    d = daemon(tmp_path)
    d.start(ROOT, "train", cpus=0.5)

    def broken() -> tuple[Telemetry, ...]:
        raise GpuError("NVML: Driver/library version mismatch")

    monkeypatch.setattr(d.agent.rec.gpus.backend, "telemetry", broken)
    record = d.agent.tick()
    assert record.snapshot.gpus is None and d.agent.rec.gpus.state is None
    planned = {c.path: c.targets for c in record.plan.cgroups}
    assert planned["nodeagent.slice/train"][Attribute.CPU_MAX].render() == "50000 100000"
    e = d.refused(ROOT, "GET", "/v1/gpus/place", query={"count": "1"})
    assert isinstance(e, NotFound)
    monkeypatch.undo()
    assert d.agent.tick().snapshot.gpus is not None
