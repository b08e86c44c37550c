"""The policy schema. Frozen, so that policies can hold it without being able to change it."""

from __future__ import annotations

import contextlib
import enum
import math
import re
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)
from pydantic_core import PydanticCustomError

from nodeagent.identity import Kind, Owner, QosTier, Runtime
from nodeagent.policyfile.glob import compile_glob
from nodeagent.policyfile.listen import DEFAULT_SOCKET, parse_listen, unix_path
from nodeagent.policyfile.units import parse_duration, parse_size
from nodeagent.policyfile.when import parse_cpu_amount, parse_instant

MAX: Literal["max"] = "max"
SHARES_MIN, SHARES_MAX = 0.001, 1_000_000
HALF_LIFE_MAX = 365 * 86400.0  # a year: longer means the history never fades in practice
SOCKET_PATH_MAX = 107  # bytes in sockaddr_un.sun_path, less its terminating NUL
# Kernel filesystems: a "file" there is a device, a FIFO or endless (/dev/zero), never storage.
_KERNEL_TREES = frozenset({"dev", "proc", "sys"})
# A plain decimal number, as YAML 1.2 reads one; digit runs are bounded like the units'.
_NUMBER_TEXT = re.compile(r"[-+]?(?:\d{1,20}(?:\.\d{0,20})?|\.\d{1,20})(?:[eE][-+]?\d{1,4})?")


def _size_or_max(value: object) -> object:
    return MAX if value == MAX else parse_size(value)


def _cores_or_max(value: object) -> object:
    """Cores as a positive finite float, or 'max'.

    Checked here rather than by the union: a union reports one error per member, and
    plain float coercion would take `true` as 1 core and a negative quota the kernel rejects.
    """
    if value == MAX:
        return MAX
    cores = math.nan
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        with contextlib.suppress(ValueError, OverflowError):
            cores = float(value)
    if not 0 < cores < math.inf:
        raise ValueError(
            f"expected a positive number of cores such as 1.5, or 'max', got {value!r}"
        )
    return cores


def _instant(value: object) -> float:
    return parse_instant(value)


def _version(value: object) -> object:
    """`true` and `1.0` equal 1 in Python, so Literal[1] alone would take them."""
    if type(value) is not int:
        raise PydanticCustomError("version", "must be 1")
    return value


def _number(value: object) -> object:
    """A number, never a boolean (`true` is 1 in Python) nor bytes. A string that spells a
    plain number is read as one: YAML 1.1 makes `1e6` a string, and an operator means 1e6.
    Infinity and NaN pass on to the float check, which names them."""
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticCustomError("float_type", "must be a number")
    return value


def _shares(value: object) -> object:
    """Shares from 0.001 to 1e6: any two tenants differ by at most 1e9 times.

    Fair share computes s = shares / total and F = 2^(-u/s) with u in [0, 1]. With this
    floor and ceiling, s >= 0.001 / (n x 1e6) for n tenants, so s is never 0 (1e-320 / 1e6
    is) and u/s <= n x 1e9 stays finite: F is always defined. 0.001 is finer than any real
    split (one part in a million of the largest share).
    """
    number = _number(value)
    # an int is finite however long (isfinite would overflow converting it to a float)
    if not isinstance(number, float | int) or (
        isinstance(number, float) and not math.isfinite(number)
    ):
        return number
    if not SHARES_MIN <= number <= SHARES_MAX:
        raise PydanticCustomError(
            "shares_range",
            f"must be greater than or equal to {SHARES_MIN} and less than or equal to {SHARES_MAX}",
        )
    return number


def _not_bytes(value: object) -> object:
    """pydantic would take `!!binary` bytes for a str enum; a policy's text is never bytes."""
    if isinstance(value, bytes):
        raise PydanticCustomError("string_type", "must be a string")
    return value


def _listen(text: str) -> str:
    path = unix_path(text)
    if path is None:
        parse_listen(text)
    else:
        _socket_path(_host_path(path))
    return text


def _glob(pattern: str) -> str:
    compile_glob(pattern)  # refuses what is too long to match quickly, and warms the cache
    return pattern


def _host_path(path: str) -> str:
    """An absolute, clean path outside the kernel's filesystems.

    The daemon's cwd is /, so a relative path would land in an unexpected place; a NUL byte
    cannot reach the kernel at all; and under /dev, /proc or /sys a state file would be read
    from a device (/dev/zero never ends) or written into a kernel interface.
    """
    if "\0" in path:
        raise ValueError("must not contain a NUL byte")
    parts = path.split("/")
    if parts[0] or len(parts) < 2 or any(p in ("", ".", "..") for p in parts[1:]):
        raise ValueError(f"must be an absolute path without '.', '..' or empty parts, got {path!r}")
    if parts[1] in _KERNEL_TREES:
        raise ValueError(
            f"must not be under /{parts[1]}, where files are devices or kernel interfaces,"
            f" got {path!r}"
        )
    return path


def _socket_path(path: str) -> str:
    if len(path.encode()) > SOCKET_PATH_MAX:
        raise ValueError(
            f"a socket path is at most {SOCKET_PATH_MAX} bytes (the kernel's limit),"
            f" got {len(path.encode())} bytes"
        )
    return path


Name = Annotated[StrictStr, Field(min_length=1)]
Glob = Annotated[StrictStr, AfterValidator(_glob)]
Listen = Annotated[StrictStr, AfterValidator(_listen)]
"""HOST:PORT, [IPV6]:PORT (see `spec.listen`) or unix:PATH."""
HostPath = Annotated[StrictStr, AfterValidator(_host_path)]
SocketPath = Annotated[HostPath, AfterValidator(_socket_path)]
Number = Annotated[StrictFloat, BeforeValidator(_number)]
Shares = Annotated[StrictFloat, BeforeValidator(_shares)]
Duration = Annotated[float, BeforeValidator(parse_duration)]
Instant = Annotated[float, BeforeValidator(_instant)]
"""An absolute time with a UTC offset, as unix seconds."""
CpuAmount = Annotated[tuple[float, bool], BeforeValidator(parse_cpu_amount)]
"""Cores, or (with is_fraction) a share of the node's CPUs."""
Size = Annotated[int | Literal["max"], BeforeValidator(_size_or_max)]
Cores = Annotated[float | Literal["max"], BeforeValidator(_cores_or_max)]


class WorkloadClass(enum.StrEnum):
    """What kind of work runs in a cgroup; later policies treat each class differently."""

    INFERENCE = "inference"
    TRAINING = "training"
    BATCH = "batch"
    BESTEFFORT = "besteffort"


class _Strict(BaseModel):
    # allow_inf_nan=False: `.inf` shares or thresholds would make the fair-share arithmetic NaN.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class MetricsSettings(_Strict):
    """The Prometheus endpoint: off unless `listen` is set."""

    listen: Listen | None = None
    """Where to serve /metrics and /healthz over HTTP, such as 127.0.0.1:9464, [::1]:9464
    or unix:/run/nodeagent-metrics/metrics.sock."""
    bearer_token_file: HostPath | None = None
    """A file holding the token /metrics then asks for (Authorization: Bearer ...)."""
    socket_group: StrictStr | None = None
    """With listen: unix:PATH, the group that may connect besides root (mode 0660)."""

    @model_validator(mode="after")
    def _group_needs_a_socket(self) -> MetricsSettings:
        if self.socket_group is not None and (self.listen is None or not unix_path(self.listen)):
            raise ValueError("socket_group is for a Unix socket: set listen: unix:PATH")
        return self


class Permission(enum.StrEnum):
    WRITE = "write"
    READ_ONLY = "read-only"


class WithoutBus(enum.StrEnum):
    READ_ONLY = "read-only"
    DIRECT = "direct"


_Permission = Annotated[Permission, BeforeValidator(_not_bytes)]


class SystemdSettings(_Strict):
    """Which cgroups systemd owns the agent writes (through systemd's D-Bus API, then the
    file), and what it does when D-Bus cannot be reached."""

    containers: _Permission = Permission.WRITE
    """Runtime scopes (docker-<id>.scope, cri-containerd-<id>.scope, ...) and pod slices."""
    services: _Permission = Permission.READ_ONLY
    """*.service units."""
    slices: _Permission = Permission.WRITE
    """Parent slices (system.slice, machine.slice, ...), for fair share across parents."""
    without_bus: Annotated[WithoutBus, BeforeValidator(_not_bytes)] = WithoutBus.READ_ONLY
    """No D-Bus: leave systemd's cgroups alone (read-only), or write their files directly
    (direct), which systemd undoes at its next daemon-reload."""


class SlurmSettings(_Strict):
    """Slurm's jobs (system.slice/slurmstepd.scope/job_<id>): slurmd's cgroup/v2 plugin owns
    them. Each job's account is asked of Slurm (squeue), never read from the job."""

    cpu_weight: _Permission = Permission.READ_ONLY
    """write: set each job's cpu.weight, at job level, for fair share between tenants. Never
    its cpuset, memory, devices, cpu.max or freezer, nor anything below the job."""
    squeue: HostPath = "/usr/bin/squeue"
    """Slurm's squeue, which answers with each job's account."""
    scontrol: HostPath = "/usr/bin/scontrol"
    """Slurm's scontrol, which answers with the GPUs (GRES) a job holds on each node."""
    node: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")
    """This node's name in Slurm (its NodeName), where it is not the host's short name nor in
    slurmstepd's scope's name: a job's GRES are read for this node's entry only."""
    timeout: Duration = Field(5.0, gt=0, le=60)
    """How long one query may take; Slurm not answering in time is asked again
    `retry_interval` later, the jobs meanwhile claimed by the rules that need no account."""
    retry_interval: Duration = Field(30.0, ge=1, le=3600)


class AgentMode(enum.StrEnum):
    HOST = "host"
    KUBERNETES = "kubernetes"
    """Beside the kubelet and the GPU device plugin: GPUs are the device plugin's to hand
    out (read from the kubelet's PodResources API), and `exec` and `gpus reserve` are
    refused."""


class RuntimeSettings(_Strict):
    """Where each container runtime answers, for the metadata rules match on (names, images,
    labels, pods); `null` turns a runtime's lookups off. Read-only, each call within `timeout`."""

    docker: SocketPath | None = "/run/docker.sock"
    podman: SocketPath | None = "/run/podman/podman.sock"
    """The socket of `podman system service`; without it, what `podman_storage` keeps."""
    podman_storage: HostPath | None = "/var/lib/containers/storage"
    """podman's store (graphroot), read when its API socket is absent: names and images only."""
    podman_per_user: StrictBool = False
    """Ask user N's own podman (`/run/user/N/podman/podman.sock`, its `podman system service
    --user`) about the containers below user@N.service. Off: they are user N's unnamed
    workloads, matched by no runtime metadata. `podman` and `podman_storage` (root's) are never
    asked about them, whatever their id: user N names its cgroups at will."""
    containerd: SocketPath | None = "/run/containerd/containerd.sock"
    """Its CRI plugin (Kubernetes pods)."""
    crio: SocketPath | None = "/var/run/crio/crio.sock"
    timeout: Duration = Field(0.2, ge=0.01, le=5)
    """The deadline of each lookup (all its calls together)."""


class AgentSettings(_Strict):
    """How the daemon runs: its tick, where it keeps state, and which subtree it owns."""

    mode: Annotated[AgentMode, BeforeValidator(_not_bytes)] = AgentMode.HOST
    reload_on_change: StrictBool = False
    """Reload the policy when its file changes (a mounted ConfigMap's update), as on
    SIGHUP; the file is looked at once a tick."""

    interval: Duration = Field(1.0, ge=0.05, le=3600)
    resync_interval: Duration = Field(30.0, ge=1, le=86400)
    """Also how long another writer's change can last: each workload's settings are read
    again at least this often (a few workloads a tick), and repaired when they differ."""
    replan_interval: Duration = Field(10.0, ge=0, le=3600)
    """A plan is made again at least this often while nothing it depends on changes (the
    set of workloads and which are busy, deadlines, pressure); 0: every tick."""
    managed_root: Name = "nodeagent.slice"
    state_file: HostPath = "/var/lib/nodeagent/state.json"
    socket: SocketPath = DEFAULT_SOCKET
    socket_group: StrictStr | None = None
    metrics: MetricsSettings = MetricsSettings()
    systemd: SystemdSettings = SystemdSettings()
    kubelet_levels: _Permission = Permission.READ_ONLY
    """kubepods and the QoS tiers: the kubelet rewrites their weights about every minute,
    so by default the agent leaves them to it (see docs/kubernetes.md)."""
    slurm: SlurmSettings = SlurmSettings()
    runtimes: RuntimeSettings = RuntimeSettings()


class FairShareSettings(_Strict):
    """Slurm-style fair share: weight follows shares, scaled by F = 2^(-usage/share)."""

    enabled: StrictBool = True
    half_life: Duration = Field(3600.0, gt=0, le=HALF_LIFE_MAX)
    weight_per_workload: StrictInt = Field(100, ge=1, le=10000)
    active_threshold: Number = Field(0.01, ge=0)
    deadband: Number = Field(0.05, ge=0, lt=1)
    hierarchy: StrictBool = True
    """Also weight the parents of workloads (slices, pods, the managed root) so that tenant
    shares hold wherever their workloads sit; off: workloads only."""


class Tenant(_Strict):
    shares: Shares


LabelKey = Annotated[StrictStr, Field(min_length=1, max_length=1024)]
LabelGlobs = Annotated[dict[LabelKey, Glob], Field(min_length=1, max_length=64)]
"""Label (or annotation) key -> glob on its value: every key must be there and match."""

CONTAINER_META = ("container_name", "image", "labels")
POD_META = ("namespace", "pod_name", "pod_labels", "pod_annotations")


class Match(_Strict):
    """All given fields must match. `path`, `name`, `account`, `container_name`, `image`,
    `namespace`, `pod_name` and the values of `labels`, `pod_labels` and `pod_annotations`
    are shell globs; the rest compare exactly. The metadata keys (container_name to
    pod_annotations) are what the workload's runtime says: a workload whose runtime said
    nothing does not match them."""

    path: Glob | None = None
    name: Glob | None = None
    runtime: Annotated[Runtime, BeforeValidator(_not_bytes)] | None = None
    kind: Annotated[Kind, BeforeValidator(_not_bytes)] | None = None
    owner: Annotated[Owner, BeforeValidator(_not_bytes)] | None = None
    qos: Annotated[QosTier, BeforeValidator(_not_bytes)] | None = None
    pod_uid: StrictStr | None = None
    container_id: StrictStr | None = None
    account: Glob | None = None
    """A Slurm job's account, as Slurm reports it (in lower case): a rule with one never
    matches a job Slurm has not answered for (nor anything but a Slurm job)."""
    container_name: Glob | None = None
    image: Glob | None = None
    labels: LabelGlobs | None = None
    namespace: Glob | None = None
    pod_name: Glob | None = None
    pod_labels: LabelGlobs | None = None
    pod_annotations: LabelGlobs | None = None

    @property
    def needs_metadata(self) -> bool:
        return any(getattr(self, k) is not None for k in (*CONTAINER_META, *POD_META))


class MetaSource(_Strict):
    """Where a rule reads a tenant or a class from: exactly one label or annotation."""

    label: LabelKey | None = None
    """The container's own label."""
    pod_label: LabelKey | None = None
    annotation: LabelKey | None = None
    """The container's own annotation (CRI, podman)."""
    pod_annotation: LabelKey | None = None
    kubernetes: StrictBool = False
    """Kubernetes mode: as the `kubernetes` section says (a tenant from the pod's
    namespace, a class from `kubernetes.class_from`); `allowed` is not needed."""

    @model_validator(mode="after")
    def _one_source(self) -> MetaSource:
        keys = ("label", "pod_label", "annotation", "pod_annotation", "kubernetes")
        given = [k for k in keys if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                "needs exactly one of label, pod_label, annotation, pod_annotation, kubernetes"
                + (f", got {', '.join(given)}" if given else "")
            )
        return self

    @property
    def source(self) -> tuple[str, str]:
        """(which: label, pod_label, annotation or pod_annotation; the key)."""
        for which in ("label", "pod_label", "annotation", "pod_annotation"):
            key = getattr(self, which)
            if key is not None:
                return which, key
        raise AssertionError("validated: one source")


class TenantFrom(MetaSource):
    allowed: tuple[StrictStr, ...] = ()
    """The only tenants this rule may give: any other value falls back to the rule's own
    `tenant`, and is reported."""


class ClassFrom(MetaSource):
    allowed: tuple[Annotated[WorkloadClass, BeforeValidator(_not_bytes)], ...] = ()
    """The only classes this rule may give: any other value falls back to its `class`."""


class Limits(_Strict):
    """Static per-rule caps. Memory is rounded down to the page size when applied."""

    cpu_max: Cores | None = None
    cpu_period_us: StrictInt = Field(100_000, ge=1000, le=1_000_000)
    memory_max: Size | None = None
    memory_high: Size | None = None
    memory_request: Size | None = None
    """What the workload needs: protected as memory.min or memory.low by its class, and the
    base of memory.high (kubelet's MemoryQoS: request + factor x (limit - request))."""
    pids_max: StrictInt | None = None
    """How many tasks (processes and threads) it may hold (pids.max): a fork past it fails,
    nothing is killed. 1 to the kernel's 4194304 (checked by the loader)."""


class Rule(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: Name
    match: Match
    tenant: StrictStr
    workload_class: Annotated[WorkloadClass, BeforeValidator(_not_bytes)] = Field(
        WorkloadClass.BATCH, alias="class"
    )
    limits: Limits = Limits()
    deadline: Instant | None = None
    """When the work must be done: an ISO 8601 time with a UTC offset."""
    work: Duration | None = Field(None, gt=0)
    """CPU-seconds the work needs in all, counted from the cgroup's creation."""
    tenant_from: TenantFrom | None = None
    """Take the tenant from a label or annotation, among `allowed` only."""
    class_from: ClassFrom | None = None
    deadline_from_annotations: StrictBool = False
    """A workload (its pod, or itself) annotated nodeagent.io/deadline (a time) and
    nodeagent.io/work (CPU duration) is a deadline job."""


class MemoryProtection(enum.StrEnum):
    MIN = "min"
    LOW = "low"
    NONE = "none"


class DeadlineGrant(enum.StrEnum):
    """What a deadline a workload declares itself gets (`classes.<c>.declared_deadlines`)."""

    DEFENDED = "defended"
    """Planned by EDF, and defended: short of its floor and stalling, it has the protection
    controller throttle, then freeze, lower classes (as a deadline the policy file gives)."""
    SCHEDULED = "scheduled"
    """Planned by EDF (a floor that raises its weight), never defended by protection."""
    REFUSED = "refused"
    """Not taken: `exec --deadline` is refused (403), annotations give no deadline."""


class ClassSettings(_Strict):
    """How the policies treat one class of work."""

    priority: StrictInt = Field(ge=0, le=1000)
    """Higher wins: a protected class's pressure throttles, then freezes, lower ones."""
    protect: StrictBool = False
    """Watched for CPU pressure: when it stalls, lower classes are throttled in steps."""
    reserved_cpu: CpuAmount | None = None
    """CPU kept for this class when it wants it (cores or a share of the node); every
    policy plans around it, deadlines included."""
    floor_cpu: Cores = 0.1
    """Throttling never takes this class's cgroups below this many cores in all."""
    freezable: StrictBool = True
    """May be frozen (cgroup.freeze, never killed) to make room for higher priorities."""
    memory_protection: Annotated[MemoryProtection, BeforeValidator(_not_bytes)] = (
        MemoryProtection.NONE
    )
    """How memory_request is protected from reclaim: memory.min, memory.low or not at all."""
    memory_throttle_factor: Number = Field(0.9, ge=0, le=1)
    """memory.high = request + factor x (limit - request), as the kubelet's MemoryQoS."""
    declared_deadlines: Annotated[DeadlineGrant, BeforeValidator(_not_bytes)] = (
        DeadlineGrant.REFUSED
    )
    """What a deadline declared by the workload's side gets in this class: by a caller
    other than root (`nodeagent exec --deadline`), or by its annotations
    (`deadline_from_annotations`). A deadline is a claim on CPU ahead of every tenant's
    share, and a defended one throttles and freezes lower classes, so the caller's word
    alone gets nothing: refused unless the operator says `scheduled` or `defended`. A
    rule's own `deadline` and root's are the operator's word: always defended."""


_CLASS_DEFAULTS: dict[WorkloadClass, dict[str, object]] = {
    WorkloadClass.INFERENCE: {
        "priority": 300,
        "protect": True,
        "freezable": False,
        "memory_protection": MemoryProtection.MIN,
    },
    WorkloadClass.TRAINING: {"priority": 200, "memory_protection": MemoryProtection.LOW},
    WorkloadClass.BATCH: {"priority": 100},
    WorkloadClass.BESTEFFORT: {"priority": 0, "floor_cpu": 0.01},
}


def _classes(value: object) -> object:
    """Each class starts from its defaults; the file overrides the keys it gives."""
    if not isinstance(value, dict):
        return value  # the schema then says it must be a mapping
    merged: dict[object, object] = {str(c): dict(d) for c, d in _CLASS_DEFAULTS.items()}
    for name, given in value.items():
        base = merged.get(name)
        both = isinstance(base, dict) and isinstance(given, dict)
        merged[name] = {**base, **given} if both else given  # type: ignore[dict-item]
    return merged


class NodeSettings(_Strict):
    reserved_cpu: CpuAmount = (0.0, False)
    """CPU kept for the system (cores or a share): no policy hands it to a workload."""


class ProtectionSettings(_Strict):
    """Inference first: the controller that throttles lower classes while a protected one
    stalls (koordlet's CPU suppress, with senpai's smooth steps)."""

    enabled: StrictBool = True
    """Off: no throttling or freezing; what it had set is given back."""
    cpu_pressure: Number = Field(0.10, gt=0, le=1)
    """Stall share (PSI 'some', over 10 s or the last tick) above which a protected cgroup
    is under pressure."""
    step: Number = Field(0.25, gt=0, lt=1)
    """Each tick under pressure, lower classes' CPU caps shrink by this fraction."""
    release_step: Number = Field(0.10, gt=0, le=1)
    """Each calm tick after `calm_ticks`, caps grow by this share of the node's CPUs."""
    calm_ticks: StrictInt = Field(3, ge=1, le=1000)
    """Ticks below half the threshold before caps are raised or frozen cgroups thawed."""
    freeze_after: StrictInt = Field(5, ge=1, le=1000)
    """Ticks under pressure with every lower class at its floor before the lowest is frozen."""
    period_us: StrictInt = Field(100_000, ge=1000, le=1_000_000)
    """The cpu.max period of the caps: ten per one-second tick, so a tick sees a smooth rate."""


class DeadlineSettings(_Strict):
    enabled: StrictBool = True
    headroom: Number = Field(1.1, ge=1, le=10)
    """Required rates are multiplied by this, for the scheduler's and the measurement's noise."""
    reserve: Number = Field(0.1, ge=0, le=0.5)
    """While others are busy, the deadline jobs' budget is sized for each to finish this part
    of its window (on its first running tick) before its deadline: a margin fixed once,
    which re-planning every tick cannot wear away."""


ANY: Literal["*"] = "*"
UID_MAX = 2**32 - 2  # (uid_t)-1 means "no id"
_Class = Annotated[WorkloadClass, BeforeValidator(_not_bytes)]


def _name_or_id(value: object) -> object:
    """A user or group: a name, or a numeric id (one error, not one per kind)."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= UID_MAX:
        return value
    raise ValueError(f"must be a name or a numeric id from 0 to {UID_MAX}, got {value!r}")


_NameOrId = Annotated[StrictStr | StrictInt, BeforeValidator(_name_or_id)]


def _listing(value: tuple[str, ...]) -> tuple[str, ...]:
    # checked after the items, so that a bad item is not also reported as an empty list
    if not value:
        raise ValueError("must list at least one name, or '*'")
    return value


def _class_or_any(value: str) -> str:
    if value != ANY and value not in set(WorkloadClass):
        names = ", ".join(c.value for c in WorkloadClass)
        raise ValueError(f"must be a class ({names}) or '*', got {value!r}")
    return value


class AccessEntry(_Strict):
    """Users and groups, and the tenants and classes they may use together."""

    users: tuple[_NameOrId, ...] = ()
    """User names or numeric uids."""
    groups: tuple[_NameOrId, ...] = ()
    """Group names or numeric gids: a caller in any of them (primary or supplementary)."""
    tenants: Annotated[tuple[StrictStr, ...], AfterValidator(_listing)]
    """Tenant names, or '*' for every tenant."""
    classes: Annotated[
        tuple[Annotated[StrictStr, AfterValidator(_class_or_any)], ...], AfterValidator(_listing)
    ]
    """Classes, or '*' for every class."""


class PerUserLimits(_Strict):
    """The most a job of a caller other than root gets, whatever it asks for: `nodeagent
    exec` moves the caller's process out of its session into the managed root, away from
    its own slice's limits (pids.max, memory.max, cpu.max), so a job takes the tightest of
    its request, those limits and these. None (or 'max'): no bound from here."""

    pids_max: StrictInt | None = 4096
    """Tasks (processes and threads): a fork bomb stops at it. 1 to 4194304."""
    memory_max: Size | None = None
    cpu_max: Cores | None = None
    """Cores, at the cpu.max period of 100 ms that jobs get."""


class JobSettings(_Strict):
    """Defaults and limits for `nodeagent exec` and the GPU requests, and who may use what."""

    default_tenant: StrictStr | None = None
    default_class: _Class = WorkloadClass.BATCH
    access: tuple[AccessEntry, ...] = ()
    """Who may use which tenants and classes besides the defaults; root may use all."""
    max_per_user: StrictInt = Field(64, ge=1, le=100_000)
    """Jobs one uid (other than root) may run at once."""
    per_user_limits: PerUserLimits = PerUserLimits()
    """Every job of a caller other than root is bounded by these, and by the limits of the
    caller's own cgroups (see PerUserLimits)."""


_CLOCK = re.compile(r"([01]\d|2[0-3]):([0-5]\d)")


def _time_of_day(value: object) -> object:
    """'22:00' as seconds after midnight (local time, as operators read their clocks)."""
    if isinstance(value, str) and (m := _CLOCK.fullmatch(value.strip())):
        return int(m.group(1)) * 3600 + int(m.group(2)) * 60
    # YAML 1.1 reads an unquoted 22:00 as 1320, a number in base 60 (minutes)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 24 * 60:
        return value * 60
    raise ValueError(f"expected a time of day such as '22:00', got {value!r}")


TimeOfDay = Annotated[int, BeforeValidator(_time_of_day)]


class PowerCap(_Strict):
    """A power limit for the GPUs of one class's workloads, optionally in a daily window."""

    workload_class: Annotated[WorkloadClass, BeforeValidator(_not_bytes)] = Field(alias="class")
    watts: Number = Field(gt=0, le=10_000)
    start: TimeOfDay | None = Field(None, alias="from")
    end: TimeOfDay | None = Field(None, alias="to")
    """Local time; a window may wrap past midnight (22:00 to 06:00). Without one: always."""
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ViolationAction(enum.StrEnum):
    REPORT = "report"
    FREEZE = "freeze"


class Backfill(enum.StrEnum):
    """How the GPU queue lets later requests past one that fits nowhere (gpu.backfill)."""

    RESERVE = "reserve"
    """EASY backfill: GPUs are kept for the first that fits nowhere, at its expected start."""
    GREEDY = "greedy"
    """Any request that fits goes: the most GPUs busy now, and a big request may starve."""


class GpuSettings(_Strict):
    """GPUs: where they come from, how jobs are pinned, and power by class."""

    simulate: HostPath | None = None
    """A simulated node description (config/gpus/*.yaml) instead of NVML; the environment
    variable NODEAGENT_GPU_SIM does the same."""
    pin_cpus: StrictBool = False
    """Pin an exec job's cpuset.cpus to the CPUs of its GPUs' NUMA nodes."""
    on_violation: Annotated[ViolationAction, BeforeValidator(_not_bytes)] = ViolationAction.REPORT
    """A process on a GPU its cgroup does not hold: report it (always), or also freeze the
    managed workload it belongs to until it stops."""
    power: tuple[PowerCap, ...] = ()
    claim_timeout: Duration = Field(30.0, gt=0, le=3600)
    """How long GPUs granted to a request wait for its job to start before they go back."""
    max_waiting_per_user: StrictInt = Field(16, ge=1, le=10_000)
    """GPU requests one uid (other than root) may have waiting at once."""
    max_holds_per_user: StrictInt = Field(4, ge=1, le=10_000)
    """Reservations (bound or not) and unclaimed grants one uid (other than root) holds at
    once: a reservation past it is refused, a request past it waits until one goes."""
    max_held_gpu_hours_per_user: Number = Field(24.0, gt=0, le=1_000_000)
    """GPU-hours one uid (other than root) may hold ahead of use: each unbound reservation's
    and unclaimed grant's GPUs times the time it has left to live, summed (a reservation
    made again counts anew). The default lets one member hold 2 GPUs for 12 h, not every
    GPU for 7 days."""
    max_gpus_per_user: StrictInt | None = Field(None, ge=1, le=1024)
    """GPUs one uid (other than root) may hold at once, in use or not: its jobs', its
    reservations' (bound or not) and its unclaimed grants' together. A reservation past it is
    refused, a request past it waits until one of the uid's holds goes, and one that asks
    for more on its own is refused. None (the default): no bound beyond the node's GPUs, so
    a member's job may use every GPU for as long as it runs (set it where that must not
    be; Slurm's MaxTRESPerUser=gres/gpu is the same bound)."""
    patience: Number = Field(0.0, ge=0, le=10)
    """A GPU request that already waits may wait this share of its job's expected duration
    more for a set that scores clearly better and is expected free by then; 0 (the default):
    never, as GPUs left idle on estimates make more jobs wait than first fit does."""
    backfill: Annotated[Backfill, BeforeValidator(_not_bytes)] = Backfill.RESERVE
    """reserve (the default): the first waiting request that fits nowhere has the GPUs it
    will get at its expected start kept for it, and a later request takes them only if it
    is expected to give them back by then (EASY backfill: no big request starves behind a
    stream of small ones); greedy: any request that fits goes, as before reservations."""


class ApiServerSettings(_Strict):
    """The Kubernetes API server, for what CRI cannot tell: pods' labels and annotations
    as edited since their sandbox was made, and namespaces' labels. In-cluster
    credentials (the DaemonSet's service account)."""

    watch: StrictBool = False
    timeout: Duration = Field(10.0, gt=0, le=300)
    """Deadline on connecting and on each list; a watch that hears nothing for
    `watch_timeout` plus this is dropped and made again."""
    watch_timeout: Duration = Field(300.0, ge=10, le=3600)
    """The server ends each watch after this long; it is made again from the last
    resourceVersion seen (a 410 Gone lists afresh)."""


def _namespace_tenant(value: object) -> object:
    """`ml-*: research` is short for `ml-*: {tenant: research}`."""
    return {"tenant": value} if isinstance(value, str) else value


class NamespaceTenant(_Strict):
    """A namespace glob's pods: their tenant and class, and what they may claim.

    Pods' labels and annotations, priority class and QoS are the pod creator's to set,
    so they choose nothing the operator has not named here: by default a pod may lower
    its class (`kubernetes.class_from`), never raise it above its namespace's default."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    tenant: StrictStr
    """The tenant of this namespace's pods."""
    allow: tuple[StrictStr, ...] = ()
    """Other tenants a pod here may claim with the nodeagent.io/tenant annotation (or
    label); a claim of any other is refused and reported."""
    workload_class: Annotated[WorkloadClass, BeforeValidator(_not_bytes)] | None = Field(
        None, alias="class"
    )
    """This namespace's default class; none: the rule's own `class`."""
    classes: tuple[Annotated[WorkloadClass, BeforeValidator(_not_bytes)], ...] = ()
    """Classes above that default a pod here may take through `kubernetes.class_from`; a
    claim of any other class above it is refused and reported."""


class ClassSource(_Strict):
    """One place a pod's class may come from; `kubernetes.class_from` tries them in order
    and the first that gives a class wins. Exactly one of annotation, label, priority
    and qos. Every one is the pod creator's to set: a class above the namespace's default
    is taken only where its `kubernetes.namespaces` entry lists it in `classes`."""

    annotation: Name | None = None
    label: Name | None = None
    values: dict[Glob, Annotated[WorkloadClass, BeforeValidator(_not_bytes)]] | None = None
    """For an annotation or label: its value (a glob) to a class, first match wins;
    without it the value is a class name itself."""
    priority: dict[StrictInt, Annotated[WorkloadClass, BeforeValidator(_not_bytes)]] | None = None
    """The pod's priority to a class: the highest threshold at or below it."""
    qos: dict[Annotated[QosTier, BeforeValidator(_not_bytes)], WorkloadClass] | None = None
    """The pod's QoS class to a class."""


class NodeCriticalSettings(_Strict):
    """The pods that keep the node running (kube-proxy, the CNI, DNS, the GPU device
    plugin, the agent's own pod): never lowered, capped or frozen, whatever a rule, the
    protection controller or a GPU check plans; their cgroups' values only ever loosen
    (a cap lifted, a freeze thawed). A pod is node-critical when its namespace matches
    one of `namespaces` or its priority (from the API server's watch) is at least
    `min_priority`."""

    namespaces: tuple[Glob, ...] = ("kube-system",)
    """Namespace globs whose every pod is node-critical."""
    min_priority: StrictInt | None = 2_000_000_000
    """Pods of this priority or above are node-critical: by default those of the built-in
    system-cluster-critical (2000000000) and system-node-critical (2000001000) classes;
    null: none by priority. Read through `api_server.watch`; without it, only
    `namespaces` tells."""


_DEFAULT_CLASS_FROM = (
    {"annotation": "nodeagent.io/class"},
    {"label": "nodeagent.io/class"},
    {
        "label": "koordinator.sh/qosClass",
        "values": {"LSE": "inference", "LSR": "inference", "LS": "inference", "BE": "besteffort"},
    },
    {"label": "kueue.x-k8s.io/queue-name", "values": {"*": "batch"}},
)


class KubernetesSettings(_Strict):
    """Kubernetes mode (`agent.mode: kubernetes`): where the kubelet's sockets are, and who
    a pod belongs to."""

    node_name: Name | None = None
    """This node's name; default: the NODE_NAME environment variable (the DaemonSet sets
    it from the downward API)."""
    pod_resources_socket: SocketPath = "/var/lib/kubelet/pod-resources/kubelet.sock"
    pod_resources_timeout: Duration = Field(2.0, gt=0, le=60)
    """Deadline on each call to the kubelet's PodResources API."""
    gpu_resources: tuple[Glob, ...] = (
        "nvidia.com/gpu",
        "nvidia.com/gpu.shared",
        "nvidia.com/mig-*",
    )
    """Extended resources that are GPUs: whole GPUs, shared ones (the device plugin's
    time-slicing and MPS replicas, renamed by `renameByDefault`) and MIG instances. Their
    device ids may be UUIDs, indices or replicas of either (nodeagent.kube.gpus)."""
    api_server: ApiServerSettings = ApiServerSettings()
    namespaces: dict[Glob, Annotated[NamespaceTenant, BeforeValidator(_namespace_tenant)]] = {}
    """Namespace globs to tenants, first match wins."""
    tenant_label: Name | None = None
    """A namespace label that names its tenant (read through the API server watch), taken
    only among the tenants the namespace's `namespaces` entry `allow`s (refused and
    reported otherwise): whoever may label a namespace chooses no more than that."""
    class_from: tuple[ClassSource, ...] = tuple(
        ClassSource.model_validate(c) for c in _DEFAULT_CLASS_FROM
    )
    node_critical: NodeCriticalSettings = NodeCriticalSettings()


class PublishSettings(_Strict):
    """What the node tells the cluster's scheduler."""

    node_features: HostPath | None = None
    """A node-feature-discovery features.d file to write the GPU topology labels to, such
    as /etc/kubernetes/node-feature-discovery/features.d/nodeagent; null: none."""
    node_resource_topology: StrictBool = False
    """Publish a NodeResourceTopology (v1alpha2) object for this node through the API
    server: only where no other producer (NFD's topology-updater, RTE) runs."""


class PolicySpec(_Strict):
    version: Annotated[Literal[1], BeforeValidator(_version)]
    agent: AgentSettings = AgentSettings()
    fair_share: FairShareSettings = FairShareSettings()
    node: NodeSettings = NodeSettings()
    classes: Annotated[dict[WorkloadClass, ClassSettings], BeforeValidator(_classes)] = Field(
        default_factory=lambda: {
            c: ClassSettings.model_validate(d) for c, d in _CLASS_DEFAULTS.items()
        }
    )
    protection: ProtectionSettings = ProtectionSettings()
    deadlines: DeadlineSettings = DeadlineSettings()
    jobs: JobSettings = JobSettings()
    gpu: GpuSettings = GpuSettings()
    kubernetes: KubernetesSettings = KubernetesSettings()
    publish: PublishSettings = PublishSettings()
    tenants: dict[StrictStr, Tenant] = Field(min_length=1)
    rules: tuple[Rule, ...] = ()
