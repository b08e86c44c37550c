"""The metrics collector, rendered from hand-built ticks and read back with the
prometheus-client parser, as Prometheus would read a scrape."""

from __future__ import annotations

import math
import platform
import socket
import subprocess
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from builders import CID2, POD_UID, job
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from promseries import PROMTOOL
from structlog.testing import capture_logs
from ticks import (
    A1,
    A2,
    B1,
    DUE,
    GPU_NODE,
    K8S,
    NOW,
    POLICY,
    REPO,
    WITH_DEADLINE,
    record,
    state,
)

from nodeagent import __version__
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute, CpuWeight
from nodeagent.daemon import open_agent, serve_metrics
from nodeagent.gpu.model import GpuProcess
from nodeagent.gpu.simulated import load_simulated
from nodeagent.metrics.collector import TickCollector
from nodeagent.metrics.families import FAMILIES, WORKLOAD
from nodeagent.policy.base import Assignment
from nodeagent.policyfile.load import load_policy
from nodeagent.policyfile.model import PolicySpec, WorkloadClass
from nodeagent.reach import Reach
from nodeagent.report import TickRecord
from nodeagent.sense.gpus import GpuSensor
from nodeagent.snapshot import CgroupSample, Skipped, WorkloadState
from nodeagent.tables import printable

Samples = dict[str, list[Sample]]


def scrape(collector: TickCollector) -> Samples:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def values(samples: Samples, name: str, **labels: str) -> list[float]:
    return [
        s.value
        for s in samples.get(name, [])
        if all(s.labels.get(k) == v for k, v in labels.items())
    ]


def value(samples: Samples, name: str, **labels: str) -> float:
    (v,) = values(samples, name, **labels)
    return v


def observed(*records: TickRecord | None, misses: int = 0) -> Samples:
    c = TickCollector(lambda: misses)
    for r in records:
        c.observe(r)
    return scrape(c)


def test_each_workload_shows_what_was_applied_and_measured() -> None:
    r = record([state(A1, 1.5), state(A2, 0.5), state(B1, 0.5), state(K8S, 0.25, used_s=3)])
    s = observed(r)
    weights = {cg.path: cg.targets[Attribute.CPU_WEIGHT].value for cg in r.plan.cgroups}
    for path, w in weights.items():
        assert isinstance(w, CpuWeight)
        assert value(s, "nodeagent_workload_cpu_weight", cgroup=path) == w.value
    assert weights[A1] != CpuWeight(100), "the applied weight is the one written, not the old"

    pod = {"cgroup": K8S.path, "tenant": "b", "class": "inference", "rule": "pods"}
    assert value(s, "nodeagent_workload_cpu_max_cores", **pod) == 1.5
    assert value(s, "nodeagent_workload_cpu_max_unlimited", **pod) == 0
    assert value(s, "nodeagent_workload_memory_max_bytes", **pod) == 1 << 30
    assert value(s, "nodeagent_workload_cpu_max_cores", cgroup=A1) == math.inf
    assert value(s, "nodeagent_workload_cpu_max_unlimited", cgroup=A1) == 1
    assert value(s, "nodeagent_workload_memory_high_bytes", cgroup=A1) == math.inf
    assert value(s, "nodeagent_workload_memory_low_bytes", cgroup=A1) == 0
    assert value(s, "nodeagent_workload_memory_min_bytes", cgroup=A1) == 0
    assert value(s, "nodeagent_workload_memory_usage_bytes", cgroup=A1) == 300 << 20
    assert value(s, "nodeagent_workload_frozen", cgroup=A1) == 0

    (info,) = s["nodeagent_workload_info"][3:]
    assert info.labels == {
        **pod,
        "container_id": CID2,
        "pod_uid": POD_UID,
        "kind": "container",
        "runtime": "containerd",
        "owner": "cgroupfs",
        "qos": "burstable",
        "status": "ok",
        # what its runtime says: nothing here (no runtime answers in a unit test)
        "container_name": "",
        "namespace": "",
        "pod": "",
    }
    assert value(s, "nodeagent_workload_cpu_usage_cores", cgroup=A1) == 1.5
    assert value(s, "nodeagent_workload_cpu_usage_seconds_total", cgroup=K8S.path) == 3.0
    assert value(s, "nodeagent_workload_cpu_throttled_ratio", cgroup=A1) == 0.05
    assert value(s, "nodeagent_workload_cpu_throttled_seconds_total", cgroup=A1) == 0.25
    assert value(s, "nodeagent_workload_cpu_psi_some_avg10_ratio", cgroup=A1) == 0.125
    assert value(s, "nodeagent_workload_memory_psi_some_avg10_ratio", cgroup=A1) == 0.015
    assert value(s, "nodeagent_workload_cpu_stall_ratio", cgroup=A1) == 0.02
    assert value(s, "nodeagent_workload_cpu_periods_total", cgroup=A1) == 100
    assert value(s, "nodeagent_workload_cpu_throttled_periods_total", cgroup=A1) == 5
    assert value(s, "nodeagent_workload_cpu_pressure_some_seconds_total", cgroup=A1) == 2.5
    assert value(s, "nodeagent_workload_cpu_pressure_full_seconds_total", cgroup=A1) == 1.0
    assert value(s, "nodeagent_workload_memory_pressure_some_seconds_total", cgroup=A1) == 0.3
    assert value(s, "nodeagent_workload_memory_pressure_full_seconds_total", cgroup=A1) == 0.1
    targets = {p: t.cores for p, t in r.plan.cpu_targets.items()}
    assert value(s, "nodeagent_workload_cpu_target_cores", cgroup=A1) == targets[A1]
    for sample in s["nodeagent_workload_cpu_weight"]:
        assert set(sample.labels) == set(WORKLOAD)


def test_a_failed_write_leaves_the_kernels_value() -> None:
    s = observed(record([state(A1, 1.0), state(B1, 1.0)], written=False))
    assert value(s, "nodeagent_workload_cpu_weight", cgroup=A1) == 100
    assert value(s, "nodeagent_workload_info", cgroup=A1, status="failed") == 1
    assert value(s, "nodeagent_cgroup_writes_total", attribute="cpu.weight", outcome="failed") == 2


def test_tenant_target_and_achieved_shares() -> None:
    """Shares 2:1; tenant a runs 2 workloads and b 1, all busy: the plan means a to get
    2/3 of the CPU whatever its workload count; a used 2 of the 3 cores measured."""
    s = observed(record([state(A1, 1.5), state(A2, 0.5), state(B1, 1.0)], policy=_no_usage()))
    assert value(s, "nodeagent_tenant_target_share_ratio", tenant="a") == pytest.approx(2 / 3)
    assert value(s, "nodeagent_tenant_target_share_ratio", tenant="b") == pytest.approx(1 / 3)
    assert value(s, "nodeagent_tenant_achieved_share_ratio", tenant="a") == pytest.approx(2 / 3)
    assert value(s, "nodeagent_tenant_achieved_share_ratio", tenant="b") == pytest.approx(1 / 3)
    assert value(s, "nodeagent_tenant_cpu_usage_cores", tenant="a") == 2.0
    assert value(s, "nodeagent_tenant_cpu_target_cores", tenant="a") == pytest.approx(8 * 2 / 3)
    assert value(s, "nodeagent_tenant_workloads", tenant="a") == 2
    assert value(s, "nodeagent_tenant_decayed_usage_cpu_seconds", tenant="a") > 0


def _no_usage() -> PolicySpec:
    """POLICY with a half-life so short that the seeded usage history is forgotten."""
    return POLICY.model_copy(
        update={"fair_share": POLICY.fair_share.model_copy(update={"half_life": 1e-3})}
    )


def test_no_share_before_anything_is_measured() -> None:
    """On a workload's first tick there is no rate: a share of nothing is left out."""
    s = observed(record([state(A1, None), state(B1, None)]))
    assert values(s, "nodeagent_tenant_achieved_share_ratio") == []
    assert value(s, "nodeagent_tenant_cpu_usage_cores", tenant="a") == 0
    assert values(s, "nodeagent_workload_cpu_usage_cores") == []


def test_a_workloads_series_go_when_it_does() -> None:
    c = TickCollector()
    c.observe(record([state(A1, 1.0), state(B1, 1.0)], seq=1))
    before = scrape(c)
    assert values(before, "nodeagent_workload_writes_total", cgroup=B1)
    c.observe(record([state(A1, 1.0)], seq=2))
    after = scrape(c)
    for name, samples in after.items():
        gone = [x for x in samples if x.labels.get("cgroup") == B1]
        assert not gone, f"{name} still has {B1}"
    assert {x.labels["tenant"] for x in after["nodeagent_tenant_workloads"]} == {"a"}
    assert values(after, "nodeagent_workload_writes_total", cgroup=A1)
    # the node's write counter keeps counting what the gone workload had
    total = sum(values(after, "nodeagent_cgroup_writes_total"))
    assert total == len(c._record.results) + sum(  # type: ignore[union-attr]
        values(before, "nodeagent_cgroup_writes_total")
    )


def test_a_come_back_starts_its_counters_afresh() -> None:
    c = TickCollector()
    c.observe(record([state(A1, 1.0), state(B1, 1.0)], seq=1))
    c.observe(record([state(A1, 1.0)], seq=2))
    c.observe(record([state(A1, 1.0), state(B1, 1.0, settings={})], seq=3, written=False))
    s = scrape(c)
    by_outcome = {
        x.labels["outcome"]: x.value
        for x in s["nodeagent_workload_writes_total"]
        if x.labels["cgroup"] == B1 and x.labels["attribute"] == "cpu.weight"
    }
    assert by_outcome == {"failed": 1}


def test_ticks_failures_and_the_duration_histogram() -> None:
    s = observed(
        record([state(A1, 1.0)], duration=0.003),
        None,
        record([state(A1, 1.0)], duration=0.3),
    )
    assert value(s, "nodeagent_ticks_total", result="ok") == 2
    assert value(s, "nodeagent_ticks_total", result="failed") == 1
    buckets = {x.labels["le"]: x.value for x in s["nodeagent_tick_duration_seconds_bucket"]}
    assert buckets["0.005"] == 1
    assert buckets["0.25"] == 1
    assert buckets["0.5"] == 2
    assert buckets["+Inf"] == 2
    assert value(s, "nodeagent_tick_duration_seconds_count") == 2
    assert value(s, "nodeagent_tick_duration_seconds_sum") == pytest.approx(0.303)
    assert value(s, "nodeagent_last_tick_timestamp_seconds") == NOW
    assert value(s, "nodeagent_dry_run") == 0


def test_before_the_first_tick_only_the_loop_is_shown() -> None:
    s = observed(None)
    assert value(s, "nodeagent_ticks_total", result="failed") == 1
    assert value(s, "nodeagent_tick_duration_seconds_count") == 0
    assert not any(name.startswith(("nodeagent_workload", "nodeagent_tenant")) for name in s)


def test_skipped_cgroups_by_step() -> None:
    broken = job("nodeagent.slice/a-broken")
    s = observed(record([state(A1, 1.0)], skipped=[Skipped(broken, "sense", "cpu.stat: EACCES")]))
    assert value(s, "nodeagent_skipped_cgroups", step="sense") == 1
    assert value(s, "nodeagent_skipped_cgroups", step="plan") == 0
    info = value(s, "nodeagent_workload_info", cgroup=broken.path, status="skipped", tenant="a")
    assert info == 1
    assert value(s, "nodeagent_managed_workloads") == 2
    assert value(s, "nodeagent_policy_failures") == 0


def test_deadline_jobs_and_misses() -> None:
    running = state(DUE, 1.0, used_s=20.0)
    s = observed(record([running, state(B1, 1.0)], policy=WITH_DEADLINE), misses=3)
    job_ = {"cgroup": "nodeagent.slice/due", "rule": "due", "class": "training"}
    assert value(s, "nodeagent_deadline_timestamp_seconds", **job_) == NOW + 100
    assert value(s, "nodeagent_deadline_work_cpu_seconds", **job_) == 60
    assert value(s, "nodeagent_deadline_remaining_cpu_seconds", **job_) == 40
    assert value(s, "nodeagent_deadline_required_rate_cores", **job_) == pytest.approx(0.4)
    given = value(s, "nodeagent_deadline_given_rate_cores", **job_)
    assert given == pytest.approx(1.1 * 40 / 90)  # headroom 1.1; 10 s of reserve
    # the node's 8 CPUs, each thread planned at the least speed (2 cores busy outside)
    cores = value(s, "nodeagent_deadline_parallelism_cores", **job_)
    assert cores == pytest.approx(8 * 0.9)
    assert value(s, "nodeagent_deadline_slack_seconds", **job_) == pytest.approx(100 - 40 / cores)
    finish = value(s, "nodeagent_deadline_predicted_finish_timestamp_seconds", **job_)
    assert finish == pytest.approx(NOW + 40 / given)
    statuses = {x.labels["status"]: x.value for x in s["nodeagent_deadline_status"]}
    assert statuses == {
        "on-track": 1,
        "predicted-miss": 0,
        "missed": 0,
        "overrun": 0,
        "done": 0,
        "waiting": 0,
    }
    assert value(s, "nodeagent_deadline_misses_total") == 3


def test_the_protection_controller() -> None:
    """The inference pod stalls 40% of the time: batch is capped, and the controller says so."""
    pods = [state(K8S, 0.5, stall=0.4), state(A1, 3.0), state(B1, 3.0)]
    s = observed(record(pods))
    assert value(s, "nodeagent_protection_state", state="throttling") == 1
    assert value(s, "nodeagent_protection_state", state="idle") == 0
    cap = value(s, "nodeagent_protection_cap_cores", **{"class": "batch"})
    assert 0 < cap < 6
    assert value(s, "nodeagent_workload_cpu_max_cores", cgroup=A1) == pytest.approx(cap / 2)
    assert value(s, "nodeagent_protection_stalling_cgroups") == 1
    assert value(s, "nodeagent_protection_frozen_cgroups") == 0


def test_gpus_once_the_daemon_has_a_backend(tmp_path: Path) -> None:
    """Driven by a simulated node (labelled as such in the series)."""
    (tmp_path / "node.yaml").write_text(GPU_NODE)
    c = TickCollector()
    c.observe(record([state(A1, 1.0)]))
    assert not any(name.startswith("nodeagent_gpu") for name in scrape(c))
    c.watch_gpus(load_simulated(tmp_path / "node.yaml"))
    s = scrape(c)
    gpu = {"gpu": "0", "uuid": "GPU-00000000-0000-4000-8000-000000000000"}
    assert value(s, "nodeagent_gpu_info", **gpu, simulated="true") == 1
    assert value(s, "nodeagent_gpu_healthy", **gpu) == 1
    assert value(s, "nodeagent_gpu_utilization_ratio", **gpu) == 0.6
    assert value(s, "nodeagent_gpu_memory_total_bytes", **gpu) == 80 << 30
    assert value(s, "nodeagent_gpu_memory_used_bytes", **gpu) == 4 << 30
    assert value(s, "nodeagent_gpu_power_draw_watts", **gpu) == 350
    assert value(s, "nodeagent_gpu_power_limit_watts", **gpu) == 700
    assert value(s, "nodeagent_gpu_temperature_celsius", **gpu) == 51
    mine = {"cgroup": A1, **gpu, "mig_uuid": ""}
    assert value(s, "nodeagent_workload_gpu_memory_bytes", **mine) == 3 << 30
    assert value(s, "nodeagent_workload_gpu_processes", **mine) == 2
    assert len(s["nodeagent_workload_gpu_processes"]) == 1, "unclaimed cgroups have none"


def test_gpu_violations_by_kind(tmp_path: Path) -> None:
    """No GPU is held: every compute process on the node is one (the gpu-checks policy's
    notes), counted whether or not a rule claims its cgroup."""
    (tmp_path / "node.yaml").write_text(GPU_NODE)
    gpus = GpuSensor(load_simulated(tmp_path / "node.yaml")).read(())
    s = observed(record([state(A1, 1.0)], gpus=gpus))
    assert value(s, "nodeagent_gpu_violating_processes", kind="unassigned") == 3
    assert value(s, "nodeagent_gpu_violating_processes", kind="wrong-gpu") == 0
    assert values(observed(record([state(A1, 1.0)])), "nodeagent_gpu_violating_processes") == []


class BrokenGpus:
    simulated, source, reason = False, "NVML", ""

    def inventory(self) -> tuple[()]:
        raise OSError("NVML_ERROR_DRIVER_NOT_LOADED")


def test_a_failing_gpu_backend_costs_only_the_gpu_series() -> None:
    c = TickCollector()
    c.observe(record([state(A1, 1.0)]))
    c.watch_gpus(BrokenGpus())  # type: ignore[arg-type]
    s = scrape(c)
    assert not any(name.startswith("nodeagent_gpu") for name in s)
    assert values(s, "nodeagent_workload_cpu_weight", cgroup=A1)


PEERS = (
    Reach("containerd", "/run/containerd/containerd.sock", False, NOW - 30, NOW - 31,
          "containerd does not answer: connection refused"),
    Reach("slurm", "squeue", True, NOW - 600, NOW - 1, None),
    Reach("api-server/pods", "https://10.0.0.1:443", False, NOW - 5, None, "401 Unauthorized"),
)  # fmt: skip


def test_each_peer_is_up_or_down_with_its_last_success() -> None:
    """containerd down since a restart, Slurm answering, the API server never answered:
    up 0/1 by peer and address, and the last success where there was one."""
    s = observed(replace(record([state(A1, 1.0)]), peers=PEERS))
    up = {(x.labels["peer"], x.labels["address"]): x.value for x in s["nodeagent_peer_up"]}
    assert up == {
        ("containerd", "/run/containerd/containerd.sock"): 0,
        ("slurm", "squeue"): 1,
        ("api-server/pods", "https://10.0.0.1:443"): 0,
    }
    last = {x.labels["peer"]: x.value for x in s["nodeagent_peer_last_success_timestamp_seconds"]}
    assert last == {"containerd": NOW - 31, "slurm": NOW - 1}


def test_every_family_is_described_and_named_koordlet_style() -> None:
    c = TickCollector()
    assert [m.name for m in c.describe()] == [f.name.removesuffix("_total") for f in FAMILIES]
    units = ("_cores", "_bytes", "_seconds", "_ratio", "_total", "_watts", "_celsius")
    unitless = {
        "nodeagent_build_info",
        "nodeagent_policy_info",
        "nodeagent_config_last_reload_successful",
        "nodeagent_dry_run",
        "nodeagent_managed_workloads",
        "nodeagent_skipped_cgroups",
        "nodeagent_policy_failures",
        "nodeagent_workload_info",
        "nodeagent_workload_cpu_weight",
        "nodeagent_workload_cpu_max_unlimited",
        "nodeagent_workload_frozen",
        "nodeagent_tenant_workloads",
        "nodeagent_deadline_status",
        "nodeagent_protection_state",
        "nodeagent_protection_stalling_cgroups",
        "nodeagent_protection_frozen_cgroups",
        "nodeagent_gpu_info",
        "nodeagent_gpu_healthy",
        "nodeagent_workload_gpu_processes",
        "nodeagent_gpu_violating_processes",
        "nodeagent_gpu_requests_waiting",
        "nodeagent_gpu_kept_for_queue_head",
        "nodeagent_peer_up",
    }
    for f in FAMILIES:
        assert f.name.startswith("nodeagent_")
        assert f.name.endswith(units) or f.name in unitless, f.name
        assert (f.kind == "counter") == f.name.endswith("_total"), f.name


def full_scrape() -> CollectorRegistry:
    """Every kind of series at once: a deadline job, a stalling inference pod that has
    batch throttled, GPUs (a simulated node) with a process no hold covers, the reload
    result, the interval and the peers."""
    c = TickCollector(lambda: 1, reload=lambda: (False, NOW), interval=lambda: 1.0)
    stalling = state(K8S, 0.5, stall=0.4)
    due = state(DUE, 1.0, used_s=20.0)
    backend = load_simulated(REPO / "config" / "gpus" / "dgx-h100-nvswitch.yaml")
    gpus = GpuSensor(backend).read(())
    assert gpus is not None
    gpus = replace(gpus, processes=(GpuProcess(4242, gpus.devices[0].uuid, 1 << 30, A1),))
    workloads = [stalling, due, state(A1, 3.0), state(B1, 3.0)]
    c.observe(replace(record(workloads, policy=WITH_DEADLINE, gpus=gpus), peers=PEERS))
    c.watch_gpus(backend)
    registry = CollectorRegistry()
    registry.register(c)
    return registry


def test_a_full_scrape_is_valid_exposition() -> None:
    """Through both parsers: the Prometheus text format and OpenMetrics."""
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om

    registry = full_scrape()
    text = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    names = {f.name for f in om(openmetrics(registry).decode())}
    assert names == text
    for family in (
        "deadline_status",
        "protection_state",
        "gpu_info",
        "ticks",
        "build_info",
        "config_last_reload_successful",
        "gpu_violating_processes",
    ):
        assert f"nodeagent_{family}" in names


def test_promtool_accepts_a_full_scrape() -> None:
    """promtool's lint (names, types, units, help); the kernel test checks a real daemon's
    scrape the same way."""
    assert PROMTOOL.exists(), f"no {PROMTOOL}: ./scripts/test installs it"
    check = subprocess.run(
        [str(PROMTOOL), "check", "metrics"],
        input=generate_latest(full_scrape()),
        capture_output=True,
        check=False,
    )
    assert (check.returncode, check.stdout, check.stderr) == (0, b"", b"")


def test_a_missing_figure_adds_no_sample() -> None:
    bare = WorkloadState(job(A1), CgroupSample(populated=True), None)
    s = observed(record([bare], written=False))
    assert value(s, "nodeagent_workload_info", cgroup=A1) == 1
    for name in (
        "nodeagent_workload_cpu_weight",
        "nodeagent_workload_memory_usage_bytes",
        "nodeagent_workload_cpu_psi_some_avg10_ratio",
    ):
        assert values(s, name, cgroup=A1) == [], name


def test_an_exec_job_has_its_own_rule_label() -> None:
    r = record([state(A1, 1.0)])
    exec_job = Assignment("exec:train", "a", WorkloadClass.TRAINING)
    cgroups = tuple(replace(cg, assignment=exec_job) for cg in r.plan.cgroups)
    s = observed(replace(r, plan=replace(r.plan, cgroups=cgroups)))
    assert value(s, "nodeagent_workload_cpu_weight", cgroup=A1, rule="exec:train") > 0


def test_hostile_cgroup_names_are_escaped() -> None:
    """A cgroup name may hold quotes, backslashes and newlines: they stay label values, the
    newline written `\\n` as the CLI's tables write it."""
    odd = 'nodeagent.slice/a-"x"\\y\nz} 1'
    s = observed(record([state(odd, 1.0)]))
    shown = 'nodeagent.slice/a-"x"\\y\\nz} 1'
    assert value(s, "nodeagent_workload_cpu_usage_cores", cgroup=shown) == 1.0
    assert value(s, "nodeagent_managed_workloads") == 1


def test_a_cgroup_name_that_is_not_utf8_is_shown_as_the_tables_show_it() -> None:
    """os.scandir hands a name's non-UTF-8 bytes over as lone surrogates, which no encoder
    takes: the scrape stays valid UTF-8 (both formats) and the bytes read as `\\xff`, as in
    the CLI's tables, so a matcher copied from `nodeagent workloads` finds the series."""
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

    raw = "nodeagent.slice/a-\udcff\udcfe"
    shown = printable(raw)
    assert shown == "nodeagent.slice/a-\\xff\\xfe"
    c = TickCollector()
    c.observe(record([state(raw, 1.0), state(B1, 0.5)]))
    registry = CollectorRegistry()
    registry.register(c)
    openmetrics(registry).decode("utf-8")  # strict: raised UnicodeEncodeError before
    s = scrape(c)
    assert value(s, "nodeagent_workload_cpu_usage_cores", cgroup=shown) == 1.0
    assert value(s, "nodeagent_workload_cpu_usage_cores", cgroup=B1) == 0.5
    assert value(s, "nodeagent_managed_workloads") == 2


def test_one_workloads_bad_data_costs_only_its_own_series() -> None:
    """A reading no float holds (a bogus 2**1100 bytes): that workload's series are left
    out of the scrape, with one line in the log, and every other series is there."""
    bogus = replace(state(A2, 1.0), sample=replace(state(A2, 1.0).sample, memory_current=1 << 1100))
    c = TickCollector()
    c.observe(record([state(A1, 1.0), bogus, state(B1, 0.5)]))
    with capture_logs() as logs:
        first = scrape(c)
        again = scrape(c)
    assert first == again
    for name, samples in first.items():
        assert not [x for x in samples if x.labels.get("cgroup") == A2], name
    assert value(first, "nodeagent_workload_cpu_usage_cores", cgroup=A1) == 1.0
    assert value(first, "nodeagent_workload_memory_usage_bytes", cgroup=B1) == 300 << 20
    assert value(first, "nodeagent_tenant_workloads", tenant="a") == 2
    assert value(first, "nodeagent_ticks_total", result="ok") == 1
    failed = [e for e in logs if e["event"] == "metrics.render_failed"]
    assert len(failed) == 1, "logged once, not at every scrape"
    assert failed[0]["cgroup"] == A2
    assert "OverflowError" in failed[0]["error"]


def test_a_failing_part_of_the_scrape_costs_only_that_part() -> None:
    def misses() -> int:
        raise RuntimeError("the note log is broken")

    c = TickCollector(misses)
    c.observe(record([state(A1, 1.0)]))
    with capture_logs() as logs:
        s = scrape(c)
    assert values(s, "nodeagent_ticks_total") == []
    assert value(s, "nodeagent_workload_cpu_usage_cores", cgroup=A1) == 1.0
    assert value(s, "nodeagent_tenant_workloads", tenant="a") == 1
    (failed,) = [e for e in logs if e["event"] == "metrics.render_failed"]
    assert (failed["series"], failed["error"]) == ("loop", "RuntimeError: the note log is broken")


COUNTERS = (
    "nodeagent_workload_cpu_usage_seconds_total",
    "nodeagent_workload_cpu_periods_total",
    "nodeagent_workload_cpu_throttled_periods_total",
    "nodeagent_workload_cpu_throttled_seconds_total",
    "nodeagent_workload_cpu_pressure_some_seconds_total",
    "nodeagent_workload_cpu_pressure_full_seconds_total",
    "nodeagent_workload_memory_pressure_some_seconds_total",
    "nodeagent_workload_memory_pressure_full_seconds_total",
)


def test_the_kernels_totals_are_counters_that_rate_can_use() -> None:
    """Throttling and pressure as the kernel counts them (cpu.stat nr_periods, nr_throttled,
    throttled_usec; the PSI files' total=), typed counter: the last tick's ratios alias
    under a 15 s scrape, a rate() over the totals does not. A kernel without cpu.pressure's
    'full' line (before 5.13) has no full series."""
    c = TickCollector()
    c.observe(record([state(A1, 1.0), state(B1, 1.0, cpu_full_us=None)]))
    registry = CollectorRegistry()
    registry.register(c)
    types = {
        s.name: f.type
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
    }
    for name in COUNTERS:
        assert types[name] == "counter", name
    s = scrape(c)
    assert values(s, "nodeagent_workload_cpu_pressure_full_seconds_total", cgroup=B1) == []
    assert value(s, "nodeagent_workload_cpu_pressure_some_seconds_total", cgroup=B1) == 2.5


def test_gpu_and_workload_gpu_series_name_the_gpu_alike(tmp_path: Path) -> None:
    """One label for a GPU's UUID (`uuid`, with its index `gpu`) on every GPU series, so a
    workload's GPU memory joins the GPU's total `on (instance, uuid)`; a process in a MIG
    instance counts for its GPU, the instance in `mig_uuid`."""
    mig = "MIG-8cdb305f-dd2e-4609-ae36-aab0d1bc52d9"
    node = (REPO / "config" / "gpus" / "h100-mig.yaml").read_text()
    (tmp_path / "node.yaml").write_text(
        node + "processes:\n"
        f"  - {{pid: 4242, gpu: {mig}, memory: 2Gi, cgroup: {A1}}}\n"
        f"  - {{pid: 4243, gpu: 0, memory: 1Gi, cgroup: {A1}}}\n"
    )
    c = TickCollector()
    c.observe(record([state(A1, 1.0)]))
    c.watch_gpus(load_simulated(tmp_path / "node.yaml"))
    s = scrape(c)
    gpu = {"gpu": "0", "uuid": "GPU-66d22876-72fd-4202-aa96-fb1a14a0f9e7"}
    assert value(s, "nodeagent_gpu_memory_total_bytes", **gpu) == 81559 << 20
    assert value(s, "nodeagent_workload_gpu_memory_bytes", **gpu, mig_uuid=mig) == 2 << 30
    assert value(s, "nodeagent_workload_gpu_memory_bytes", **gpu, mig_uuid="") == 1 << 30
    assert value(s, "nodeagent_workload_gpu_processes", **gpu, cgroup=A1, mig_uuid=mig) == 1
    for name, samples in s.items():
        if "gpu" in name:
            assert all("device_uuid" not in x.labels for x in samples), name


def test_build_info() -> None:
    s = observed(None)
    info = {"version": __version__, "python": platform.python_version()}
    assert value(s, "nodeagent_build_info", **info) == 1


RELOADED = """\
version: 1
agent:
  interval: {interval}
  state_file: {tmp}/state.json
  metrics: {{listen: "127.0.0.1:{port}"}}
tenants:
  research: {{shares: 2}}
"""


def test_the_daemons_reload_result_and_interval(tmp_path: Path) -> None:
    """Through the daemon: the start-up load counts as a success; a bad file fails the
    reload (the agent keeps its last good policy) until a good one is loaded."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    policy = tmp_path / "policy.yaml"
    policy.write_text(RELOADED.format(interval="2s", tmp=tmp_path, port=port))
    (tmp_path / "cgroup").mkdir()
    before = time.time()
    agent = open_agent(
        load_policy(policy), CgroupTree(str(tmp_path / "cgroup")), config_path=str(policy)
    )
    server = serve_metrics(agent)
    assert server is not None
    server.cache_seconds = 0  # each scrape renders: a reload does not wait for a tick
    try:

        def get() -> Samples:
            url = f"http://127.0.0.1:{server.port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as r:  # loopback only
                text = r.read().decode()
            out: Samples = {}
            for family in text_string_to_metric_families(text):
                for x in family.samples:
                    out.setdefault(x.name, []).append(x)
            return out

        ok, at = (
            "nodeagent_config_last_reload_successful",
            ("nodeagent_config_last_reload_success_timestamp_seconds"),
        )
        s = get()
        assert value(s, ok) == 1
        started = value(s, at)
        assert before <= started <= time.time()
        assert value(s, "nodeagent_tick_interval_seconds") == 2

        policy.write_text("version: 1\ntenants:\n  research: {shares: -2}\n")
        agent.reload()
        s = get()
        assert (value(s, ok), value(s, at)) == (0, started)

        policy.write_text(RELOADED.format(interval="5s", tmp=tmp_path, port=port))
        agent.reload()
        s = get()
        assert value(s, ok) == 1
        assert value(s, at) >= started
        assert value(s, "nodeagent_tick_interval_seconds") == 5
    finally:
        server.close()


def test_failed_writes_count_from_zero() -> None:
    """Every attribute's failed count is there at 0 before the first failure: increase()
    cannot see a counter's first step (the series would appear at 1), so an alert on
    failed writes would miss it."""
    s = observed(None)
    failed = {x.labels["attribute"]: x.value for x in s["nodeagent_cgroup_writes_total"]}
    assert failed == dict.fromkeys(map(str, Attribute), 0)
