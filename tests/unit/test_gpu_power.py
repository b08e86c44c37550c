"""Applying GPU power limits (`GpuExecutor.apply`, the act layer's, after each tick's
plan): the limit the plan's decisions want is set through the backend and read back, each
change is one audit event, a limit already in force is not set again, a dry run sets
nothing, and a failure is logged once, not at every tick, and again only when it changes
or comes back after a success.

The executor is tested alone on a plan and a snapshot built here, and through the daemon,
on a plain directory tree with a simulated 2-GPU node with power figures (stand-ins, see
daemon_api); GPU power by class is the `gpu-power` policy (test_gpu_policies has its
choices).
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from builders import snapshot
from daemon_api import ROOT, Daemon, daemon
from structlog.testing import capture_logs

from nodeagent.actgpu import GpuExecutor
from nodeagent.gpu.backend import GpuBackend, GpuError
from nodeagent.gpu.model import PowerLimit
from nodeagent.gpu.simulated import load_simulated
from nodeagent.policy.base import DeviceDecision
from nodeagent.policy.plan import Plan
from nodeagent.sense.gpus import GpuSensor
from nodeagent.snapshot import NodeSnapshot

POWERED = """\
gpus:
  - {index: 0, uuid: GPU-00000000-0000-0000-0000-000000000000, name: Sim, memory: 80Gi,
     numa_node: 0, cpus: 0-3, pci_bus_id: '00000000:17:00.0',
     power: {min: 200, max: 700, default: 700}}
  - {index: 1, uuid: GPU-11111111-1111-1111-1111-111111111111, name: Sim, memory: 80Gi,
     numa_node: 0, cpus: 0-3, pci_bus_id: '00000000:65:00.0',
     power: {min: 200, max: 700, default: 700}}
"""
CAPS = {"power": [{"class": "training", "watts": 300}, {"class": "inference", "watts": 50}]}


def powered(tmp_path: Path, **agent: Any) -> Daemon:
    return daemon(tmp_path, {"gpu": CAPS, "agent": agent}, gpus=POWERED)


def limits(d: Daemon) -> dict[str, int | None]:
    """Each GPU's power limit as the backend reads it now."""
    return {t.uuid: t.power_limit_mw for t in d.agent.rec.gpus.backend.telemetry()}


def reserve(d: Daemon, name: str, cls: str) -> str:
    got = d.call(ROOT, "POST", "/v1/gpus/reservations", {"name": name, "class": cls})
    (uuid,) = got["uuids"]
    return str(uuid)


def power_events(logs: Iterable[Mapping[str, Any]]) -> list[tuple[str, int | None, int, int]]:
    return [
        (e["gpu"], e["old_mw"], e["new_mw"], e["requested_mw"])
        for e in logs
        if e["event"] == "gpu.power_limit"
    ]


@pytest.fixture
def d(tmp_path: Path) -> Daemon:
    return powered(tmp_path)


# --- the executor alone: a plan's decisions, a snapshot's telemetry ------------------------

GPU0, GPU1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"


def node(tmp_path: Path) -> GpuBackend:
    (tmp_path / "gpus.yaml").write_text(textwrap.dedent(POWERED))
    return load_simulated(tmp_path / "gpus.yaml")


def sensed(backend: GpuBackend) -> NodeSnapshot:
    """A snapshot whose GPU state is the backend's as it reads now."""
    return replace(snapshot([]), gpus=GpuSensor(backend).read(()))


def planned(*decisions: DeviceDecision) -> Plan:
    return Plan(1, 0.0, (), {}, devices=decisions)


def cap(uuid: str, mw: int, setting: str = "power_limit_mw") -> DeviceDecision:
    return DeviceDecision(uuid, setting, mw, "gpu-power", f"capped at {mw // 1000} W")


def backend_limits(backend: GpuBackend) -> dict[str, int | None]:
    return {t.uuid: t.power_limit_mw for t in backend.telemetry()}


def test_the_executor_sets_what_the_plan_decides_and_nothing_in_a_dry_run(
    tmp_path: Path,
) -> None:
    backend = node(tmp_path)
    executor = GpuExecutor(backend)
    plan = planned(cap(GPU0, 300_000), cap(GPU1, 250_000, setting="clock_mhz"))
    with capture_logs() as logs:
        executor.apply(plan, sensed(backend), dry_run=True)
    assert backend_limits(backend) == {GPU0: 700_000, GPU1: 700_000}
    assert logs == [], "a dry run sets and says nothing"
    with capture_logs() as logs:
        executor.apply(plan, sensed(backend), dry_run=False)
    assert backend_limits(backend) == {GPU0: 300_000, GPU1: 700_000}, "a setting not a limit"
    assert power_events(logs) == [(GPU0, 700_000, 300_000, 300_000)]
    (event,) = logs
    assert event["reason"] == "capped at 300 W"
    assert event["simulated"] is True
    with capture_logs() as logs:
        executor.apply(plan, sensed(backend), dry_run=False)
    assert logs == [], "the snapshot shows it in force already"
    with capture_logs() as logs:
        executor.apply(planned(), sensed(backend), dry_run=False)
    assert logs == [], "no decision, no change: the executor undoes nothing by itself"
    assert backend_limits(backend) == {GPU0: 300_000, GPU1: 700_000}


def test_the_executor_without_gpu_state_sets_each_decision_with_no_old_limit(
    tmp_path: Path,
) -> None:
    """A tick whose GPU read failed has no telemetry: nothing says a limit is in force, so
    the decisions are set (the backend reads each back)."""
    backend = node(tmp_path)
    with capture_logs() as logs:
        GpuExecutor(backend).apply(planned(cap(GPU1, 400_000)), snapshot([]), dry_run=False)
    assert power_events(logs) == [(GPU1, None, 400_000, 400_000)]
    assert backend_limits(backend)[GPU1] == 400_000


# --- through the daemon ---------------------------------------------------------------------


def test_a_class_cap_is_set_read_back_audited_once_and_undone_when_the_hold_goes(
    d: Daemon,
) -> None:
    gpu = reserve(d, "train", "training")
    (other,) = set(limits(d)) - {gpu}
    assert limits(d) == {gpu: 700_000, other: 700_000}
    with capture_logs() as logs:
        d.agent.tick()
    assert limits(d) == {gpu: 300_000, other: 700_000}
    assert power_events(logs) == [(gpu, 700_000, 300_000, 300_000)]
    (event,) = [e for e in logs if e["event"] == "gpu.power_limit"]
    assert event["reason"] == "class training holds it: capped at 300 W"
    assert event["simulated"] is True
    with capture_logs() as logs:
        d.agent.tick()
        d.agent.tick()
    assert power_events(logs) == [], "in force already: not set again"
    d.call(ROOT, "DELETE", "/v1/gpus/reservations", {"name": "train"})
    with capture_logs() as logs:
        d.agent.tick()
    assert limits(d) == {gpu: 700_000, other: 700_000}
    assert power_events(logs) == [(gpu, 300_000, 700_000, 700_000)]


def test_what_the_card_applies_is_what_is_audited(d: Daemon, monkeypatch: Any) -> None:
    """The audit says the limit read back from the card, beside the one asked for."""
    gpu = reserve(d, "web", "inference")  # 50 W: the policy clamps it to the card's 200 W
    backend = d.agent.rec.gpus.backend
    real = backend.set_power_limit

    def firmware(uuid: str, mw: int) -> PowerLimit:  # a card that applies 5 W more
        got = real(uuid, mw + 5_000)
        return PowerLimit(uuid, mw, got.applied_mw, got.min_mw, got.max_mw, got.simulated)

    monkeypatch.setattr(backend, "set_power_limit", firmware)
    with capture_logs() as logs:
        d.agent.tick()
    assert power_events(logs) == [(gpu, 700_000, 205_000, 200_000)]
    assert limits(d)[gpu] == 205_000


def test_a_dry_run_sets_no_power_limit(tmp_path: Path) -> None:
    d = powered(tmp_path)
    d.agent.rec.dry_run = True
    gpu = reserve(d, "train", "training")
    with capture_logs() as logs:
        record = d.agent.tick()
    assert [(x.uuid, x.value) for x in record.plan.devices] == [(gpu, 300_000)]
    assert limits(d)[gpu] == 700_000
    assert power_events(logs) == []


def test_a_failure_is_logged_once_and_again_only_when_it_changes_or_returns(
    d: Daemon, monkeypatch: Any
) -> None:
    gpu = reserve(d, "train", "training")
    backend = d.agent.rec.gpus.backend
    real = backend.set_power_limit
    failing: list[str] = ["GPU 0: setting the power limit: Insufficient Permissions"]

    def flaky(uuid: str, mw: int) -> PowerLimit:
        if failing:
            raise GpuError(failing[0])
        return real(uuid, mw)

    monkeypatch.setattr(backend, "set_power_limit", flaky)

    def ticks(n: int) -> tuple[list[tuple[str, int | None, int, int]], list[tuple[str, int, str]]]:
        """n ticks: the limits set (gpu.power_limit) and the failures logged."""
        with capture_logs() as logs:
            for _ in range(n):
                d.agent.tick()
        failed = [
            (e["gpu"], e["target_mw"], e["error"]) for e in logs if e["event"] == "gpu.power_failed"
        ]
        return power_events(logs), failed

    refused = failing[0]
    assert ticks(3) == ([], [(gpu, 300_000, refused)]), "tried every tick, logged once"
    assert limits(d)[gpu] == 700_000
    failing[0] = lost = "GPU 0: setting the power limit: GPU is lost"
    assert ticks(2) == ([], [(gpu, 300_000, lost)]), "a new error is news"
    failing.clear()
    assert ticks(1) == ([(gpu, 700_000, 300_000, 300_000)], []), "set at last, and audited"
    assert limits(d)[gpu] == 300_000
    d.call(ROOT, "DELETE", "/v1/gpus/reservations", {"name": "train"})
    failing.append(lost)  # the same error as before the success
    assert ticks(2) == ([], [(gpu, 700_000, lost)]), "a failure after a success is news"
    assert limits(d)[gpu] == 300_000
