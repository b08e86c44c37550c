"""The API's answers as models, one per route, shared by the daemon (whose routes return them)
and the CLI (which reads them by attribute): a field renamed on one side is a mypy error on
the other, not a KeyError at run time.

Every answer is frozen and plain data (strings, numbers, lists, and the nested answers here),
so this module imports nothing of what it serves. The wire format is the model's fields by
their wire names (`class`, not `workload_class`), encoded as `wire.encode` encodes any body:
sorted, compact JSON. A field listed in a model's `_omitted` is left off the wire when it is
None, as the daemon has always left it off (a GPU request's `uuids` until it is granted).

Keys the model does not name are kept (extra="allow"): an answer from a newer daemon with a
key this CLI does not know still validates, and --json documents pass such keys on as they
always did. A key the model needs and the answer lacks (an older daemon; a rename) fails
validation: `client.get_as` says so in one line. Figures that may be whole or not are
`int | float`, so that validation keeps `3` as `3` and `3.5` as `3.5`, and the wire stays
byte for byte what the daemon sent before these models.

Where typing stops (documented in docs/architecture.md): a note's own figures (`Note`
extras: they differ by kind), a deadline job's figures beyond the ones the tables show, what
the sensors read (`Explanation.sensed`) and what a runtime said (`metadata`) are open
mappings.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    SerializerFunctionWrapHandler,
    model_serializer,
)

Number = int | float
"""A figure that is whole or not: kept as the daemon gave it."""


class Answer(BaseModel):
    """An answer, or a part of one: frozen, with the keys it does not name kept."""

    model_config = ConfigDict(frozen=True, extra="allow", populate_by_name=True, defer_build=True)


class _Sparse(Answer):
    """An answer some of whose keys are left off the wire while they are None."""

    _omitted: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _leave_off(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if v is not None or k not in self._omitted}


# -- /v1/status -------------------------------------------------------------------------------


class RuntimeState(Answer):
    """A container runtime the daemon asks for metadata, and whether it answers."""

    socket: str
    answering: bool
    problem: str | None


class PeerState(Answer):
    """A service the daemon asks, as its last exchange left it (Unix times)."""

    name: str
    address: str
    up: bool
    since: float
    """When `up` last changed."""
    last_success: float | None
    error: str | None
    """While down: what failed."""


class ReloadState(Answer):
    """The daemon's last reload of its policy file (SIGHUP, `agent.reload_on_change` or
    `POST /v1/reload`)."""

    file: str
    applied: bool
    at: float
    """When it was tried (Unix time)."""
    problems: list[str] = []
    """Refused: each problem in one line (FILE:LINE:COL: message)."""


class Status(Answer):
    """GET /v1/status: who the daemon is, what it runs with, and what is wrong with it.
    The fields after `peers` are newer: each has a default, so that an older daemon's answer
    still reads (shown as unknown)."""

    pid: int
    dry_run: bool
    policy_file: str | None
    policy_sha256: str | None = None
    """The policy in force's sha256 (what it says, not its layout), as `nodeagent validate
    --json` prints it for a file; None from a daemon older than it."""
    cgroup_root: str
    managed_root: str
    tick: int | None
    """The last tick's number; None before the first."""
    workloads: int
    slurm_problem: str | None
    deadline_misses: int
    runtimes: dict[str, RuntimeState]
    peers: list[PeerState] = []
    """Every service the daemon asks, as of its last tick (none before it; a daemon older
    than the list sends none)."""
    version: str | None = None
    """The daemon's nodeagent version."""
    started: float | None = None
    """When the daemon started (Unix time)."""
    tick_time: float | None = None
    """The wall time of the last tick (Unix time); None before the first."""
    policy_loaded: float | None = None
    """When the policy in force was loaded: at start, or by the last reload that applied."""
    last_reload: ReloadState | None = None
    """None: no reload since the daemon started."""
    problems: list[str] = []
    """What an operator should look at, one line each: services that do not answer, a
    refused reload, missed deadlines, ticks that stopped. Empty when all is well (and from
    a daemon older than the list)."""


class Reloaded(Answer):
    """POST /v1/reload, applied: the policy in force now. A refused reload is an error (409)
    whose message is the problems, one per line."""

    file: str
    policy_sha256: str
    rules: int
    tenants: int
    at: float


# -- /v1/allocations and /v1/explain ----------------------------------------------------------


class Value(Answer):
    """One attribute of a workload: what the kernel holds, what the plan wants, and why."""

    current: str | None
    target: str | None
    policy: str | None
    reason: str | None


class Write(Answer):
    """A write of the last tick."""

    attribute: str
    old: str | None
    new: str | None
    outcome: str
    detail: str


class Note(Answer):
    """A policy's note on a workload or the node; its figures, which differ by kind, are the
    extra keys (`model_extra`)."""

    policy: str
    kind: str
    status: str
    message: str


class DeadlineFigures(Answer):
    """A deadline job's figures, as the deadline table shows them; the deadline policy's
    other figures (work, measured rate, capacity, ...) are extra keys."""

    status: str
    deadline: Number
    remaining: Number
    required_rate: Number | None = None
    rate: Number | None = None
    slack: Number | None = None
    predicted_finish: Number | None = None


class Workload(Answer):
    """A workload as the API shows it (nodeagent.report.describe): who it is, what the runtime
    said about it, and the rule that claims it."""

    cgroup: str
    name: str | None
    kind: str
    runtime: str
    owner: str
    write: str | None
    writable: bool | None
    container_id: str | None
    pod_uid: str | None
    qos: str | None
    job_id: str | None
    account: str | None
    rule: str | None
    tenant: str | None
    workload_class: str | None = Field(alias="class")
    container_name: str | None
    image: str | None
    namespace: str | None
    pod: str | None
    metadata: dict[str, Any] | None
    """What the runtime said (names, image, labels, pod): open."""
    metadata_problem: str | None
    matched: list[str]
    refused: list[str]
    node_critical: str | None = None
    """Why it keeps the node running (kubernetes.node_critical): never lowered, capped or
    frozen. None: it may be."""


class Planned(Workload):
    """What a tick planned for a workload, or why it planned nothing."""

    level: bool
    """A parent level, weighted only for its tenants' shares."""
    status: str
    """ok, frozen, skipped or failed."""
    problem: str | None
    reason: str
    values: dict[str, Value]
    """By attribute (cpu.weight, cpu.max, memory.max, memory.high, pids.max)."""
    cpu_rate: Number | None
    writes: list[Write]
    deadline: DeadlineFigures | None
    notes: list[Note]


class Allocation(Planned):
    """A row of GET /v1/allocations."""

    memory_current: int | None
    gpus: list[int]
    """The indices of the GPUs it holds."""


class Allocations(Answer):
    """GET /v1/allocations: the last tick's plan for every claimed workload."""

    tick: int
    time: Number
    dry_run: bool
    tick_seconds: Number
    tenant_usage: dict[str, Number]
    problems: list[str]
    node_notes: list[Note]
    allocations: list[Allocation]
    deadline_misses: int | None = None
    """The daemon's count; None where the record is read outside one (`run --once`)."""


class Below(Answer):
    """What a parent level holds."""

    workloads: int
    tenants: list[str]


class GpuUse(Answer):
    """The GPUs a workload holds, as `explain` shows them."""

    indices: list[int]
    expected_end: Number | None
    """When its hold is expected back (Unix time); None: unknown, or running late."""
    kept_for: str | None = None
    """The head of the queue some of these GPUs are kept for (EASY backfill): this
    workload was placed on them as expected to give them back before its start."""
    kept_from: Number | None = None
    """That head's expected start (Unix time); None: unknown, or none."""


class Explanation(Planned):
    """GET /v1/explain?cgroup=...: one workload's values, trace and sensed figures."""

    below: Below | None
    tick: int
    dry_run: bool
    trace: list[str]
    sensed: dict[str, Any]
    """What the sensors read this tick (usage, pressure, memory events): open."""
    gpus: GpuUse | None = None
    """The GPUs it holds; None: none."""


# -- /v1/jobs ---------------------------------------------------------------------------------


class Job(Answer):
    """A job `nodeagent exec` started (DELETE /v1/jobs answers the job it finished)."""

    name: str
    cgroup: str
    tenant: str
    workload_class: str
    uid: int
    pid: int
    submitted_at: Number
    deadline: Number | None
    work: Number | None
    cpus: Number | None
    memory: int | None
    gpus: list[str]
    gpu_hold: str | None
    pinned_cpus: list[int]
    """The CPUs its cgroup is pinned to, beside its GPUs (gpu.pin_cpus); none: not pinned."""
    pids: int | None
    """Its pids.max (None: none): as cpus and memory, the tightest of its request and, for a
    caller other than root, the caller's own cgroups' and jobs.per_user_limits'."""
    limits_from: dict[str, str]
    """Where each of cpus, memory and pids came from: 'the request', 'cgroup PATH' (the
    caller's) or 'jobs.per_user_limits'."""


class StartedJob(Job):
    """POST /v1/jobs: the job, and the environment its command gets (its GPUs)."""

    env: dict[str, str]


class Jobs(Answer):
    """GET /v1/jobs."""

    jobs: list[Job]


# -- /v1/gpus ---------------------------------------------------------------------------------


class MigDevice(Answer):
    uuid: str
    index: int
    profile: str
    memory_total: int | None
    healthy: bool
    reason: str


class GpuProcess(Answer):
    pid: int
    device_uuid: str
    used_memory: int | None
    cgroup: str | None


class Assigned(Answer):
    """A hold the daemon placed on a GPU."""

    owner: str
    kind: str
    uid: int
    tenant: str | None
    workload_class: str | None = Field(alias="class")
    cgroup: str | None
    container: str | None
    uuids: list[str]
    shared_memory: int | None


class Violation(Answer):
    """A process on a GPU its cgroup does not hold."""

    pid: int
    cgroup: str | None
    device: str
    kind: str
    holder: str | None


class Gpu(_Sparse):
    """One GPU: inventory, telemetry, MIG devices, compute processes; from the daemon, also
    what it assigned there and the violations (left off a reading of the hardware alone)."""

    _omitted: ClassVar[frozenset[str]] = frozenset({"assigned", "violations"})

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    minor: int | None
    numa_node: int | None
    cpus: str
    healthy: bool
    reason: str
    simulated: bool
    memory_total: int | None
    memory_used: int | None
    utilization: int | None
    temperature_c: int | None
    power_draw_w: Number | None
    power_limit_w: Number | None
    power_min_w: Number | None
    power_max_w: Number | None
    power_default_w: Number | None
    mig_enabled: bool | None
    mig_devices: list[MigDevice]
    processes: list[GpuProcess]
    assigned: list[Assigned] | None = None
    violations: list[Violation] | None = None


class Waiting(Answer):
    """A GPU request in the queue; its id is shown to its asker and root only."""

    id: str | None
    owner: str
    uid: int
    count: int
    workload_class: str = Field(alias="class")
    reason: str
    kept: list[int] = Field(default_factory=list)
    """GPUs kept for it, the head of the queue (EASY backfill); empty for the others."""
    expected_start: float | None = None
    """When the GPUs kept for it are expected free (Unix time); None: not the head, or a
    hold in its way has no expected end."""


class GpuList(_Sparse):
    """GET /v1/gpus (and `nodeagent gpus` without a daemon, without `queue`)."""

    _omitted: ClassVar[frozenset[str]] = frozenset({"queue"})

    source: str
    simulated: bool
    reason: str
    gpus: list[Gpu]
    queue: list[Waiting] | None = None


class GpuGrant(_Sparse):
    """POST and GET /v1/gpus/requests: a GPU request granted, or waiting (its position)."""

    _omitted: ClassVar[frozenset[str]] = frozenset(
        {"uuids", "indices", "position", "score", "fraction", "expected_start"}
    )

    id: str
    status: str
    """granted or waiting."""
    reason: str
    uuids: list[str] | None = None
    indices: list[int] | None = None
    position: int | None = None
    score: Number | None = None
    fraction: Number | None = None
    expected_start: Number | None = None
    """Waiting, first in line, with GPUs kept for it: when they are expected free (Unix
    time); absent otherwise, or while a hold in its way has no expected end."""


class Cancelled(Answer):
    """DELETE /v1/gpus/requests."""

    cancelled: bool


class Reservation(Answer):
    """POST /v1/gpus/reservations: the GPUs held under the name, and until when."""

    name: str
    uuids: list[str]
    indices: list[int]
    score: Number
    fraction: Number
    until: Number
    """Unix time."""
    container: str | None


class Attached(Answer):
    """POST /v1/gpus/reservations/container."""

    name: str
    container: str | None


class Released(Answer):
    """DELETE /v1/gpus/reservations."""

    released: str


class PlacedRequest(Answer):
    count: int
    memory: int | None
    shared: bool
    mig_profile: str | None
    cpu_numa_nodes: list[int]


class PlacedDevice(Answer):
    index: int
    uuid: str
    numa_node: int | None


class Pair(Answer):
    gpus: list[int]
    pcie: str
    nvlinks: int
    nvswitch: bool
    score: Number


class _Placing(_Sparse):
    _omitted: ClassVar[frozenset[str]] = frozenset({"note"})

    source: str
    simulated: bool
    holds_considered: bool
    reason: str
    note: str | None = None
    """Why holds were not considered (`gpus place` without a daemon); never on the wire."""


class Placed(_Placing):
    """Where the request would go: the set, its score and the reasoning."""

    placed: Literal[True]
    reserved: bool
    request: PlacedRequest
    uuids: list[str]
    indices: list[int]
    devices: list[PlacedDevice]
    score: Number
    pair_score: Number
    numa_bonus: Number
    best_possible: Number
    fraction: Number
    pairs: list[Pair]
    numa_nodes: list[int]


class NotPlaced(_Placing):
    """Nothing fits now: the reason, and no set."""

    placed: Literal[False]


class Placement(RootModel[Annotated[Placed | NotPlaced, Field(discriminator="placed")]]):
    """GET /v1/gpus/place (and `gpus place` without a daemon, with its `note`): where a
    request would go now, reserving nothing, or why nothing fits."""

    model_config = ConfigDict(frozen=True)


class Error(Answer):
    """What every refusal carries: its one-line message."""

    error: str
