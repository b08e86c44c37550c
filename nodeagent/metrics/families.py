"""Every series nodeagent exports, in one table: name, type, help and label names.

Names follow koordlet's: a `nodeagent_` prefix, the unit last (`_cores`, `_bytes`,
`_seconds`, `_ratio` for 0..1), `_total` on counters. A workload's series carry
WORKLOAD's labels; an unset label (a job has no container id, a workload whose runtime said
nothing no container_name) is the empty string. Label
values are shown as the CLI's tables show them, always valid UTF-8: a byte of a cgroup name
that is not UTF-8 reads `\\xff`, a control character `\\n` or `\\x1b`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from nodeagent.tables import printable

WORKLOAD = (
    "cgroup", "tenant", "class", "rule", "container_id", "pod_uid", "container_name",
    "namespace", "pod",
)  # fmt: skip
"""The runtime's names (container_name, namespace, pod) follow from the cgroup: they add no
series, and each value is cut to RUNTIME_NAME_MAX characters."""
RUNTIME_NAME_MAX = 128
GPU = ("gpu", "uuid")
"""A GPU's index and UUID, on every GPU series: the workloads' join the GPUs' on them."""

Kind = Literal["gauge", "counter", "histogram"]


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()

    def empty(self) -> Metric:
        if self.kind == "counter":
            return CounterMetricFamily(self.name, self.help, labels=self.labels)
        if self.kind == "histogram":
            return HistogramMetricFamily(self.name, self.help, labels=self.labels)
        return GaugeMetricFamily(self.name, self.help, labels=self.labels)

    def series(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this family."""
        if self.kind == "histogram":
            return tuple(f"{self.name}_{s}" for s in ("bucket", "sum", "count"))
        return (self.name,)


def _f(name: str, kind: Kind, help: str, *labels: str) -> Family:
    return Family(name, kind, help, labels)


W = WORKLOAD
FAMILIES: tuple[Family, ...] = (
    # the agent
    _f(
        "nodeagent_build_info",
        "gauge",
        "1, with the agent's version and the Python that runs it.",
        "version",
        "python",
    ),
    _f(
        "nodeagent_config_last_reload_successful",
        "gauge",
        "1 when the last reload of the policy file (SIGHUP) applied it, 0 when the agent"
        " kept its last good policy; 1 before any reload (the start-up load applied).",
    ),
    _f(
        "nodeagent_config_last_reload_success_timestamp_seconds",
        "gauge",
        "Unix time the policy in force was loaded (at start or by a reload).",
    ),
    _f(
        "nodeagent_policy_info",
        "gauge",
        "1, with the sha256 of the policy in force (what it says, not its layout; as"
        " `nodeagent validate --json` prints it for a file): which nodes run which policy.",
        "sha256",
    ),
    _f("nodeagent_tick_interval_seconds", "gauge", "agent.interval: the time between ticks."),
    # the loop
    _f("nodeagent_tick_duration_seconds", "histogram", "Time one tick took: sense, plan, act."),
    _f(
        "nodeagent_ticks_total",
        "counter",
        "Ticks by result: ok, or failed (logged as tick.failed; nothing was applied).",
        "result",
    ),
    _f("nodeagent_last_tick_timestamp_seconds", "gauge", "Unix time of the last completed tick."),
    _f("nodeagent_dry_run", "gauge", "1 when the agent runs with --dry-run and writes nothing."),
    _f("nodeagent_managed_workloads", "gauge", "Workloads a rule claims this tick."),
    _f(
        "nodeagent_skipped_cgroups",
        "gauge",
        "Workloads left out of this tick, by the step that failed (sense or plan).",
        "step",
    ),
    _f(
        "nodeagent_policy_failures",
        "gauge",
        "Policies that failed as a whole this tick and were left out (policy.failed).",
    ),
    _f(
        "nodeagent_cgroup_writes_total",
        "counter",
        "Cgroup attribute changes by outcome: written, unchanged, dry-run, read-only,"
        " vanished, unreachable (memory.max above usage) or failed.",
        "attribute",
        "outcome",
    ),
    _f(
        "nodeagent_cgroup_overwritten_total",
        "counter",
        "Values nodeagent wrote that a later read found changed by another writer (the"
        " kubelet, systemd, an operator): a fight over a cgroup shows here.",
        "attribute",
    ),
    # the services the agent asks
    _f(
        "nodeagent_peer_up",
        "gauge",
        "1 when the agent's last exchange with a service it asks succeeded, 0 when it failed:"
        " each container runtime's socket, Slurm's squeue, systemd's bus, the kubelet's"
        " PodResources, the API server's watch of each kind (api-server/pods, ...). Listed"
        " from its first exchange; a runtime whose socket was never there is not listed.",
        "peer",
        "address",
    ),
    _f(
        "nodeagent_peer_last_success_timestamp_seconds",
        "gauge",
        "Unix time of the last exchange with the peer that succeeded; absent until one has.",
        "peer",
    ),
    _f("nodeagent_node_cpu_cores", "gauge", "CPUs on the node."),
    _f("nodeagent_node_cpu_busy_ratio", "gauge", "Busy share of all CPUs over the last tick."),
    # each workload
    _f(
        "nodeagent_workload_info",
        "gauge",
        "1 for each workload a rule claims, with what discovery found and its status this"
        " tick (ok, frozen, skipped, failed).",
        *W,
        "kind",
        "runtime",
        "owner",
        "qos",
        "status",
    ),
    _f("nodeagent_workload_cpu_weight", "gauge", "cpu.weight after this tick's writes.", *W),
    _f(
        "nodeagent_workload_cpu_max_cores",
        "gauge",
        "cpu.max after this tick's writes, as cores (quota / period); +Inf when unlimited.",
        *W,
    ),
    _f(
        "nodeagent_workload_cpu_max_unlimited",
        "gauge",
        "1 when cpu.max is 'max' (no CPU cap).",
        *W,
    ),
    _f(
        "nodeagent_workload_memory_max_bytes",
        "gauge",
        "memory.max after this tick's writes; +Inf when 'max'.",
        *W,
    ),
    _f(
        "nodeagent_workload_memory_high_bytes",
        "gauge",
        "memory.high after this tick's writes; +Inf when 'max'.",
        *W,
    ),
    _f("nodeagent_workload_memory_low_bytes", "gauge", "memory.low after this tick.", *W),
    _f("nodeagent_workload_memory_min_bytes", "gauge", "memory.min after this tick.", *W),
    _f("nodeagent_workload_memory_usage_bytes", "gauge", "memory.current.", *W),
    _f("nodeagent_workload_frozen", "gauge", "1 when cgroup.freeze is set.", *W),
    _f(
        "nodeagent_workload_cpu_usage_cores",
        "gauge",
        "CPU used over the last tick, in cores (absent on a workload's first tick).",
        *W,
    ),
    _f(
        "nodeagent_workload_cpu_usage_seconds_total",
        "counter",
        "CPU time used since the cgroup was made (cpu.stat usage_usec).",
        *W,
    ),
    _f(
        "nodeagent_workload_cpu_throttled_ratio",
        "gauge",
        "Share of CFS periods throttled by cpu.max over the last tick.",
        *W,
    ),
    _f(
        "nodeagent_workload_cpu_throttled_seconds_total",
        "counter",
        "Time throttled by cpu.max since the cgroup was made (cpu.stat throttled_usec).",
        *W,
    ),
    _f(
        "nodeagent_workload_cpu_periods_total",
        "counter",
        "CFS periods in which the workload could run, under a cpu.max (cpu.stat nr_periods).",
        *W,
    ),
    _f(
        "nodeagent_workload_cpu_throttled_periods_total",
        "counter",
        "CFS periods in which cpu.max throttled the workload (cpu.stat nr_throttled).",
        *W,
    ),
    *(
        _f(
            f"nodeagent_workload_{resource}_pressure_{kind}_seconds_total",
            "counter",
            f"Time {who} waited for {what} ({resource}.pressure '{kind}' total=), as of"
            " the workload's last full read (every agent.resync_interval at most; cpu"
            " every tick for protected classes and floors).",
            *W,
        )
        for resource, what in (("cpu", "a CPU"), ("memory", "memory"))
        for kind, who in (
            ("some", "some of the workload's tasks"),
            ("full", "all of its non-idle tasks at once"),
        )
    ),
    _f(
        "nodeagent_workload_cpu_psi_some_avg10_ratio",
        "gauge",
        "cpu.pressure 'some' avg10: share of the last 10 s some task waited for a CPU.",
        *W,
    ),
    _f(
        "nodeagent_workload_memory_psi_some_avg10_ratio",
        "gauge",
        "memory.pressure 'some' avg10: share of the last 10 s some task waited for memory.",
        *W,
    ),
    _f(
        "nodeagent_workload_cpu_stall_ratio",
        "gauge",
        "Share of the last tick some task waited for a CPU (from cpu.pressure's total).",
        *W,
    ),
    _f(
        "nodeagent_workload_cpu_target_cores",
        "gauge",
        "The CPU the plan means the workload to get (floor plus part of the pool), which"
        " its cpu.weight follows.",
        *W,
    ),
    _f(
        "nodeagent_workload_writes_total",
        "counter",
        "This workload's attribute changes by outcome (see nodeagent_cgroup_writes_total).",
        *W,
        "attribute",
        "outcome",
    ),
    # tenants
    _f(
        "nodeagent_tenant_target_share_ratio",
        "gauge",
        "The tenant's part of the CPU the plan hands to active managed workloads.",
        "tenant",
    ),
    _f(
        "nodeagent_tenant_achieved_share_ratio",
        "gauge",
        "The tenant's part of the CPU all managed workloads used over the last tick.",
        "tenant",
    ),
    _f(
        "nodeagent_tenant_cpu_target_cores",
        "gauge",
        "CPU the plan means the tenant's active workloads to get.",
        "tenant",
    ),
    _f(
        "nodeagent_tenant_cpu_usage_cores",
        "gauge",
        "CPU the tenant's workloads used over the last tick.",
        "tenant",
    ),
    _f(
        "nodeagent_tenant_decayed_usage_cpu_seconds",
        "gauge",
        "The tenant's decayed CPU usage, which fair share weighs against its shares.",
        "tenant",
    ),
    _f("nodeagent_tenant_workloads", "gauge", "Workloads the tenant's rules claim.", "tenant"),
    # deadline jobs
    _f(
        "nodeagent_deadline_misses_total",
        "counter",
        "Deadline jobs that missed their deadline (one per job and deadline).",
    ),
    _f("nodeagent_deadline_timestamp_seconds", "gauge", "The job's deadline, unix time.", *W),
    _f("nodeagent_deadline_work_cpu_seconds", "gauge", "CPU time the job declared.", *W),
    _f(
        "nodeagent_deadline_remaining_cpu_seconds",
        "gauge",
        "Declared work less the CPU time used; negative when it overran.",
        *W,
    ),
    _f(
        "nodeagent_deadline_required_rate_cores",
        "gauge",
        "Remaining work over the time left to the deadline.",
        *W,
    ),
    _f(
        "nodeagent_deadline_given_rate_cores",
        "gauge",
        "The CPU floor the deadline policy gave the job this tick.",
        *W,
    ),
    _f(
        "nodeagent_deadline_parallelism_cores",
        "gauge",
        "The most CPUs the job can use at once (declared CPUs, threads, node).",
        *W,
    ),
    _f(
        "nodeagent_deadline_slack_seconds",
        "gauge",
        "Time to the deadline less the time the remaining work needs at full parallelism.",
        *W,
    ),
    _f(
        "nodeagent_deadline_predicted_finish_timestamp_seconds",
        "gauge",
        "When the job finishes at its given (else measured) rate, unix time.",
        *W,
    ),
    _f(
        "nodeagent_deadline_status",
        "gauge",
        "1 for the job's status: on-track, predicted-miss, missed, overrun, done, waiting.",
        *W,
        "status",
    ),
    # the protection controller
    _f(
        "nodeagent_protection_state",
        "gauge",
        "1 for the controller's state: idle, throttling, releasing, freezing.",
        "state",
    ),
    _f(
        "nodeagent_protection_cap_cores",
        "gauge",
        "CPU a throttled class's cgroups may use in all.",
        "class",
    ),
    _f(
        "nodeagent_protection_stalling_cgroups",
        "gauge",
        "Protected cgroups stalling for CPU above the threshold.",
    ),
    _f(
        "nodeagent_protection_frozen_cgroups",
        "gauge",
        "Cgroups the controller holds frozen.",
    ),
    # GPUs (once the daemon has a GPU backend)
    _f(
        "nodeagent_gpu_info",
        "gauge",
        "1 for each GPU; simulated=true when it comes from a node description file.",
        *GPU,
        "name",
        "simulated",
    ),
    _f("nodeagent_gpu_healthy", "gauge", "1 while the GPU is healthy.", *GPU),
    _f(
        "nodeagent_gpu_utilization_ratio",
        "gauge",
        "Share of the last sample period a kernel ran.",
        *GPU,
    ),
    _f("nodeagent_gpu_memory_used_bytes", "gauge", "GPU memory in use.", *GPU),
    _f("nodeagent_gpu_memory_total_bytes", "gauge", "GPU memory in all.", *GPU),
    _f("nodeagent_gpu_power_draw_watts", "gauge", "Power drawn.", *GPU),
    _f("nodeagent_gpu_power_limit_watts", "gauge", "Power limit in force.", *GPU),
    _f("nodeagent_gpu_temperature_celsius", "gauge", "GPU temperature.", *GPU),
    _f(
        "nodeagent_gpu_requests_waiting",
        "gauge",
        "GPU requests in the daemon's queue, by the class they ask for.",
        "class",
    ),
    _f(
        "nodeagent_gpu_kept_for_queue_head",
        "gauge",
        "1 for each GPU kept for the first request in line that fits nowhere now (EASY"
        " backfill): others take it only if expected to give it back before that request's"
        " start.",
        *GPU,
        "owner",
    ),
    _f(
        "nodeagent_gpu_queue_head_expected_start_timestamp_seconds",
        "gauge",
        "When the GPUs kept for the head of the queue are expected free (Unix time); absent"
        " while a hold in its way has no expected end.",
        "owner",
    ),
    _f(
        "nodeagent_gpu_violating_processes",
        "gauge",
        "Compute processes on GPUs their cgroup does not hold, this tick (gpu.violation):"
        " unassigned (it holds none) or wrong-gpu (it holds others).",
        "kind",
    ),
    _f(
        "nodeagent_workload_gpu_memory_bytes",
        "gauge",
        "GPU memory the workload's processes use on one GPU, or one MIG instance of it"
        " (mig_uuid; empty outside MIG).",
        *W,
        *GPU,
        "mig_uuid",
    ),
    _f(
        "nodeagent_workload_gpu_processes",
        "gauge",
        "The workload's compute processes on one GPU, or one MIG instance of it.",
        *W,
        *GPU,
        "mig_uuid",
    ),
)
BY_NAME = {f.name: f for f in FAMILIES}


class Scrape:
    """One scrape's families, filled sample by sample; only families with samples show."""

    def __init__(self) -> None:
        self._made: dict[str, Metric] = {}

    def _family(self, name: str, labels: Sequence[str]) -> Metric:
        spec = BY_NAME[name]
        if len(labels) != len(spec.labels):
            raise ValueError(f"{name} takes labels {spec.labels}, got {tuple(labels)}")
        if name not in self._made:
            self._made[name] = spec.empty()
        return self._made[name]

    def add(self, name: str, labels: Sequence[str], value: float | None) -> None:
        """One sample; None (a figure not known this tick) adds nothing. Label values are
        shown as the CLI's tables show them (`printable`); the value is made a float here,
        so that a reading no float holds fails while its part is rendered, not in the
        encoder, where it would fail the whole scrape."""
        if value is None:
            return
        family = self._family(name, labels)
        assert isinstance(family, GaugeMetricFamily | CounterMetricFamily)
        family.add_metric([printable(v) for v in labels], float(value))

    def histogram(
        self,
        name: str,
        buckets: Sequence[tuple[float, int]],
        total: float,
    ) -> None:
        family = self._family(name, ())
        assert isinstance(family, HistogramMetricFamily)
        family.add_metric([], [(_le(b), c) for b, c in buckets], total)

    def merge(self, part: Scrape) -> None:
        """Add `part`'s samples (one part of the scrape, rendered on its own)."""
        for name, family in part._made.items():
            if name in self._made:
                self._made[name].samples.extend(family.samples)
            else:
                self._made[name] = family

    def put(self, family: Rendered) -> None:
        """A workload family, in its place in FAMILIES' order; no other part adds to it."""
        self._made[family.spec.name] = family

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._made[f.name] for f in FAMILIES if f.name in self._made)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


# --- the workloads' series, written as text -------------------------------------------------
#
# A scrape at 1000 workloads holds some 25000 workload samples, each with WORKLOAD's nine
# labels. Made as prometheus_client Samples and written by its encoder, each label of each
# sample is checked, escaped and formatted again (some 0.5 s of CPU at 1000). Here a
# workload's label text is made once (`Labels`, kept by the collector while the workload's
# labels stay the same), a sample is a row (labels, extra label values, value), and a family
# writes its own sample lines: `Rendered`. The lines are what both formats write (text 0.0.4
# and OpenMetrics with the names as they are: labels sorted by name, values escaped alike);
# the server still checks that against the encoder it was asked for (its first sample, both
# ways) and falls back to the encoder where they differ. Anyone reading `samples` gets
# prometheus_client Samples, made on demand.


def _escaped(value: str) -> str:
    """A label value as both formats write it: as the CLI's tables show it (`printable`),
    then with the exposition's escapes."""
    return printable(value).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@lru_cache(maxsize=4096)
def _piece(name: str, value: str) -> str:
    """`name="value"` for an extra label (an attribute, an outcome, a status: few values)."""
    return f'{name}="{_escaped(value)}"'


@dataclass(frozen=True, slots=True, eq=False)
class Layout:
    """Where a workload family's labels go once sorted by name, as both encoders write
    them: runs of WORKLOAD's labels (by index), and the extra labels between them. One per
    family (LAYOUTS), hashed by identity: it keys each Labels' text."""

    extras: tuple[str, ...]
    slots: tuple[tuple[bool, int], ...]
    """(True, run index) or (False, extra index), in order."""
    runs: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, labels: tuple[str, ...]) -> Layout:
        if labels[: len(WORKLOAD)] != WORKLOAD:
            raise ValueError(f"not a workload family: {labels}")
        extras = labels[len(WORKLOAD) :]
        slots: list[tuple[bool, int]] = []
        runs: list[list[int]] = []
        for i in sorted(range(len(labels)), key=labels.__getitem__):
            if i >= len(WORKLOAD):
                slots.append((False, i - len(WORKLOAD)))
            elif slots and slots[-1][0]:
                runs[-1].append(i)
            else:
                slots.append((True, len(runs)))
                runs.append([i])
        return cls(extras, tuple(slots), tuple(tuple(r) for r in runs))


class Labels:
    """One workload's WORKLOAD label values, as given (`values`, which the GPU series take),
    as shown (`shown`) and as text, made once per layout."""

    __slots__ = ("_pieces", "_runs", "shown", "values")

    def __init__(self, values: tuple[str, ...]) -> None:
        if len(values) != len(WORKLOAD):
            raise ValueError(f"workload labels {WORKLOAD}, got {values}")
        self.values = values
        self.shown = tuple(printable(v) for v in values)
        self._pieces = tuple(f'{n}="{_escaped(v)}"' for n, v in zip(WORKLOAD, values, strict=True))
        self._runs: dict[Layout, tuple[str, ...]] = {}

    def runs(self, layout: Layout) -> tuple[str, ...]:
        made = self._runs.get(layout)
        if made is None:
            made = tuple(",".join(self._pieces[i] for i in run) for run in layout.runs)
            self._runs[layout] = made
        return made

    def text(self, layout: Layout, extras: tuple[str, ...]) -> str:
        """The labels between the braces, sorted by name."""
        runs = self.runs(layout)
        if not extras:
            return runs[0]
        names = layout.extras
        return ",".join(
            [runs[i] if run else _piece(names[i], extras[i]) for run, i in layout.slots]
        )


_GO_FLOAT: Callable[[float], str] = floatToGoString
_SPECIAL = {"inf": "+Inf", "-inf": "-Inf", "nan": "NaN"}


def _value(d: float) -> str:
    """A float as both encoders write it (floatToGoString), without its checks where
    Python's repr is already Go's."""
    s = repr(d)
    if s[-1] in "fn":
        return _SPECIAL[s]
    if d > 0 and s.find(".") > 6:
        return _GO_FLOAT(d)
    return s


Row = tuple[Labels, tuple[str, ...], float]
"""One workload sample: its labels, the values of the family's extra labels, the value."""
LAYOUTS = {f.name: Layout.of(f.labels) for f in FAMILIES if f.labels[: len(WORKLOAD)] == WORKLOAD}
"""Every family whose labels start with WORKLOAD's."""


class WorkloadPart:
    """One workload's rows, rendered on its own (see collector._isolated): a row is checked
    here (its family, its label count, a value a float holds), so a bad one fails its
    workload's part, never the scrape."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: list[tuple[str, Row]] = []

    def add(self, name: str, labels: Labels, value: float | None, *extras: str) -> None:
        """None (a figure not known this tick) adds nothing."""
        if value is None:
            return
        if len(extras) != len(LAYOUTS[name].extras):
            raise ValueError(f"{name} takes labels {BY_NAME[name].labels}, got {extras}")
        self.rows.append((name, (labels, extras, float(value))))


class Rendered(Metric):
    """A workload family: its samples as rows, writing its own sample lines (`body`).
    `samples` are made from the rows when asked for; setting them makes it a plain family
    (the server's fallback copies it so)."""

    def __init__(self, spec: Family, rows: list[Row]) -> None:
        name = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
        super().__init__(name, spec.help, spec.kind)
        self.spec = spec
        self._layout = LAYOUTS[spec.name]
        self._rows: list[Row] | None = rows
        self._made: list[Sample] | None = None
        self._body: bytes | None = None

    @property
    def samples(self) -> list[Sample]:
        if self._made is None:
            self._made = [self._sample(row) for row in self._rows or ()]
        return self._made

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        self._made, self._rows, self._body = samples, None, None

    def _sample(self, row: Row) -> Sample:
        labels, extras, value = row
        shown = (*labels.shown, *(printable(v) for v in extras))
        return Sample(self.spec.name, dict(zip(self.spec.labels, shown, strict=True)), value)

    def empty(self) -> Metric:
        return self.spec.empty()

    def first(self) -> tuple[Metric, bytes] | None:
        """A plain family with the first sample only, and the line `body` writes for it;
        None once the samples were set."""
        if not self._rows:
            return None
        one = self.spec.empty()
        one.samples = [self._sample(self._rows[0])]
        return one, self._lines(self._rows[:1])

    def body(self) -> bytes | None:
        """Every sample line, made once; None once the samples were set."""
        if self._rows is None:
            return None
        if self._body is None:
            self._body = self._lines(self._rows)
        return self._body

    def _lines(self, rows: Iterable[Row]) -> bytes:
        name, layout, value = self.spec.name, self._layout, _value
        return "".join(
            [f"{name}{{{labels.text(layout, extras)}}} {value(v)}\n" for labels, extras, v in rows]
        ).encode("utf-8")


def rendered(parts: Iterable[WorkloadPart]) -> list[Rendered]:
    """The workload families of `parts` (each workload's, in order), in FAMILIES' order."""
    rows: dict[str, list[Row]] = defaultdict(list)
    for part in parts:
        for name, row in part.rows:
            rows[name].append(row)
    return [Rendered(f, rows[f.name]) for f in FAMILIES if f.name in rows]
