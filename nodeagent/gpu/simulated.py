"""A simulated node from a YAML description (config/gpus/), for machines without GPUs.

Tests, the demo and the benchmarks use it. Everything it returns is marked simulated.
The format (see docs/gpus.md and the shipped files):

    gpus:                       # one entry per GPU, indices 0..N-1
      - index: 0
        uuid: GPU-...           # as nvidia-smi -L prints it
        name: NVIDIA H100 80GB HBM3
        memory: 81559Mi
        numa_node: 0
        cpus: 0-55,112-167      # optional: the GPU's CPU affinity
        pci_bus_id: 00000000:1B:00.0   # optional
        nvswitch: true          # optional: behind the node's NVSwitch fabric
        nvswitch_links: 18      # optional: its NVLinks to the fabric (default 18)
        mig: [{uuid: MIG-..., profile: 1g.10gb}]        # optional MIG devices
        power: {min: 200, max: 700, default: 700}       # optional, watts
        utilization: 35         # optional telemetry: percent,
        memory_used: 10Gi       # bytes (default: what the processes use),
        temperature: 41         # degrees C
        unhealthy: Xid 79       # optional: the GPU is unhealthy, for this reason
    links:                      # one entry per pair with a link; others are SYS, no NVLink
      - {gpus: [0, 1], pcie: PXB, nvlinks: 0}
    processes:                  # optional compute processes
      - {pid: 4242, gpu: 0, memory: 20Gi, cgroup: nodeagent.slice/job-1}

A pair of GPUs that are both behind the NVSwitch fabric is NVLink-connected with the
fewer of their links to the fabric, on top of any direct NVLinks its entry gives.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import InitErrorDetails

from nodeagent.gpu.backend import GpuError
from nodeagent.gpu.model import (
    Device,
    GpuProcess,
    Link,
    MigDevice,
    PcieLevel,
    PowerLimit,
    Telemetry,
    Topology,
    XidEvent,
    parse_cpulist,
)
from nodeagent.gpu.procs import cgroup_of
from nodeagent.policyfile.units import parse_size
from nodeagent.policyfile.yamlfile import (
    PolicyError,
    compose,
    problem_at,
    read_text,
    validation_problems,
)

WHAT = "a GPU node description (gpus:, links:, processes:)"
MAX_GPUS = 64

Size = Annotated[int, BeforeValidator(parse_size)]
Watts = Annotated[float, Field(gt=0, le=10_000)]
PcieName = Literal["PIX", "PXB", "PHB", "NODE", "SYS"]


def _cpus(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    return parse_cpulist(value) if isinstance(value, str) else value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


GPU_UUID = r"^GPU-[0-9A-Za-z-]+$"
MIG_UUID = r"^MIG-[0-9A-Za-z-]+$"
MIG_PROFILE = r"^[1-9]g\.\d+gb(\+me)?$"
PCI_BUS_ID = r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$"


class SimMig(_Strict):
    uuid: str = Field(pattern=MIG_UUID)
    profile: str = Field(pattern=MIG_PROFILE)
    memory: Size | None = None
    """Default: the profile's figure, in GB."""


class SimPower(_Strict):
    min: Watts
    max: Watts
    default: Watts
    limit: Watts | None = None
    """The limit in force; default: `default`."""
    draw: Watts | None = None


class SimGpu(_Strict):
    index: int = Field(ge=0, lt=MAX_GPUS)
    uuid: str = Field(pattern=GPU_UUID)
    name: str = Field(min_length=1)
    memory: Size
    numa_node: int = Field(ge=0, le=1024)
    cpus: Annotated[tuple[int, ...], BeforeValidator(_cpus)] = ()
    pci_bus_id: str | None = Field(None, pattern=PCI_BUS_ID)
    nvswitch: bool = False
    nvswitch_links: int = Field(18, ge=1, le=64)
    mig: tuple[SimMig, ...] = ()
    power: SimPower | None = None
    utilization: int | None = Field(None, ge=0, le=100)
    memory_used: Size | None = None
    temperature: int | None = Field(None, ge=-50, le=150)
    unhealthy: str | None = Field(None, min_length=1)


class SimLink(_Strict):
    gpus: tuple[int, int]
    pcie: PcieName
    nvlinks: int = Field(0, ge=0, le=64)


class SimProcess(_Strict):
    pid: int = Field(ge=1, le=2**22)
    gpu: int | str
    """A GPU index, or a GPU or MIG UUID."""
    memory: Size | None = None
    cgroup: str | None = None
    """Default: read from /proc/<pid>/cgroup, so that a description can name real processes."""


class SimNode(_Strict):
    gpus: tuple[SimGpu, ...]
    links: tuple[SimLink, ...] = ()
    processes: tuple[SimProcess, ...] = ()


def load_simulated(path: str | os.PathLike[str], proc_root: str = "/proc") -> SimulatedBackend:
    """The simulated node described in the file at `path`; PolicyError lists every problem."""
    filename = os.fspath(path)
    return SimulatedBackend(parse_node(read_text(filename, WHAT), filename), filename, proc_root)


def parse_node(text: str, filename: str) -> SimNode:
    try:
        root, data = compose(text, filename, WHAT)
    except PolicyError as e:  # the policy loader's guards speak of "the policy"
        raise PolicyError(replace(p, message=_node_words(p.message)) for p in e.problems) from None
    if not isinstance(data, dict):
        raise PolicyError([problem_at(filename, root, (), f"expected {WHAT}")])
    try:
        node = SimNode.model_validate(data)
    except ValidationError as e:
        raise PolicyError(validation_problems(filename, root, _in_our_words(e))) from None
    problems = [problem_at(filename, root, loc, message) for loc, message in _check(node)]
    if problems:
        raise PolicyError(sorted(problems, key=lambda p: (p.line, p.col)))
    return node


def _node_words(message: str) -> str:
    message = message.replace("a policy is far smaller", "a GPU node description is far smaller")
    return message.replace("the policy", "the GPU node description")


_PATTERNS = {
    GPU_UUID: "a GPU UUID as nvidia-smi -L prints it (GPU-7e62aa0a-1df9-...)",
    MIG_UUID: "a MIG device UUID as nvidia-smi -L prints it (MIG-...)",
    MIG_PROFILE: "a MIG profile such as 1g.10gb or 3g.40gb",
    PCI_BUS_ID: "a PCI bus ID such as '00000000:1B:00.0'",
}
_MODELS = {
    "SimNode": "a mapping with gpus:, links: and processes:",
    "SimGpu": "a GPU: a mapping with index, uuid, name, memory and numa_node",
    "SimMig": "a MIG instance: a mapping with uuid and profile",
    "SimPower": "power figures: a mapping with min, max and default (watts)",
    "SimLink": "a link: a mapping with gpus: [A, B] and pcie",
    "SimProcess": "a compute process: a mapping with pid and gpu",
}
_BOUNDS = {"ge": "at least", "gt": "more than", "le": "at most", "lt": "less than"}
_TYPES = {
    "tuple_type": "a list",
    "list_type": "a list",
    "int_type": "a whole number",
    "int_parsing": "a whole number",
    "int_from_float": "a whole number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "string_too_short": "a string that is not empty",
}


def _in_our_words(error: ValidationError) -> ValidationError:
    """pydantic's errors with our wording for what this schema can get wrong; `missing`,
    `extra_forbidden` and `string_type` keep theirs, which the locator words itself."""
    out: list[InitErrorDetails] = []
    for e in error.errors(include_url=False):
        detail: InitErrorDetails = {"type": e["type"], "loc": e["loc"], "input": e["input"]}
        words = _words(e["type"], e.get("ctx", {}), e["loc"], e["input"])
        if words is not None:
            detail = {"type": "value_error", "loc": e["loc"], "input": e["input"]}
            detail["ctx"] = {"error": words}
        elif "ctx" in e:
            detail["ctx"] = e["ctx"]
        out.append(detail)
    return ValidationError.from_exception_data(error.title, out)


def _words(kind: str, ctx: dict[str, Any], loc: tuple[str | int, ...], got: object) -> str | None:
    if kind == "string_pattern_mismatch" and ctx.get("pattern") in _PATTERNS:
        return f"must be {_PATTERNS[ctx['pattern']]}, got {_got(got)}"
    if kind in ("model_type", "dict_type") and ctx.get("class_name", "SimNode") in _MODELS:
        return f"must be {_MODELS[ctx.get('class_name', 'SimNode')]}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bound = next(k for k in _BOUNDS if k in ctx)
        return f"must be {_BOUNDS[bound]} {ctx[bound]}, got {_got(got)}"
    if kind in ("too_short", "too_long") and loc[-1:] == ("gpus",):
        return "a link joins two GPUs: gpus: [A, B]"
    if kind in _TYPES:
        return f"must be {_TYPES[kind]}, got {_got(got)}"
    return None


def _got(value: object) -> str:
    """What was found, short: a scalar as YAML gave it, or what kind of thing it is."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check(node: SimNode) -> list[tuple[tuple[str | int, ...], str]]:
    """What the schema alone cannot say: indices, references and sizes that agree."""
    out: list[tuple[tuple[str | int, ...], str]] = []
    count = len(node.gpus)
    if not count:
        out.append((("gpus",), "a node needs at least one GPU"))
    uuids: dict[str, tuple[str | int, ...]] = {}
    for i, gpu in enumerate(node.gpus):
        if gpu.index >= count:
            out.append(
                (
                    ("gpus", i, "index"),
                    f"index {gpu.index} with {count} GPUs: indices run 0..{count - 1}",
                )
            )
        if gpu.index in [g.index for g in node.gpus[:i]]:
            out.append((("gpus", i, "index"), f"duplicate GPU index {gpu.index}"))
        for loc, uuid in [(("gpus", i, "uuid"), gpu.uuid)] + [
            (("gpus", i, "mig", j, "uuid"), m.uuid) for j, m in enumerate(gpu.mig)
        ]:
            if uuid in uuids:
                out.append((loc, f"duplicate UUID {uuid}"))
            uuids.setdefault(uuid, loc)
        if gpu.memory_used is not None and gpu.memory_used > gpu.memory:
            out.append((("gpus", i, "memory_used"), "memory_used is above the GPU's memory"))
        mig_memory = sum(_mig_memory(m) for m in gpu.mig)
        if mig_memory > gpu.memory:
            out.append((("gpus", i, "mig"), "the MIG devices hold more memory than the GPU has"))
        p = gpu.power
        if p is not None:
            if not p.min <= p.default <= p.max:
                out.append((("gpus", i, "power"), "power needs min <= default <= max"))
            if p.limit is not None and not p.min <= p.limit <= p.max:
                out.append(
                    (("gpus", i, "power", "limit"), f"limit {p.limit} W is outside min..max")
                )
    indices = {g.index for g in node.gpus}
    seen: set[tuple[int, int]] = set()
    for i, link in enumerate(node.links):
        a, b = link.gpus
        pair = (min(a, b), max(a, b))
        if a == b:
            out.append((("links", i, "gpus"), f"a link joins two GPUs, got GPU {a} twice"))
        for end in (a, b):
            if end not in indices:
                out.append((("links", i, "gpus"), f"no GPU with index {end}"))
        if pair in seen:
            out.append((("links", i, "gpus"), f"a second entry for GPUs {pair[0]} and {pair[1]}"))
        seen.add(pair)
    for i, proc in enumerate(node.processes):
        if proc.gpu not in indices and proc.gpu not in uuids:
            out.append((("processes", i, "gpu"), f"no GPU or MIG device {proc.gpu!r}"))
    return out


def _mig_memory(mig: SimMig) -> int:
    if mig.memory is not None:
        return mig.memory
    m = re.match(r"\d+g\.(\d+)gb", mig.profile)
    return int(m.group(1)) * 10**9 if m else 0


class SimulatedBackend:
    """The GPUs a YAML file describes; power limits are kept in memory and read back."""

    simulated = True
    reason = ""

    def __init__(self, node: SimNode, filename: str, proc_root: str = "/proc") -> None:
        self.source = f"simulated from {filename}"
        self._proc_root = proc_root
        self._node = node
        self._gpus = sorted(node.gpus, key=lambda g: g.index)
        self._limits = {
            g.uuid: _mw(g.power.limit or g.power.default) for g in self._gpus if g.power is not None
        }
        self._devices = tuple(self._device(g) for g in self._gpus)
        self._topology = self._links()

    def _device(self, g: SimGpu) -> Device:
        return Device(
            index=g.index,
            uuid=g.uuid,
            name=g.name,
            pci_bus_id=g.pci_bus_id or f"00000000:{g.index + 0x10:02X}:00.0",
            minor=g.index,
            memory_total=g.memory,
            numa_node=g.numa_node,
            cpus=g.cpus,
            mig_enabled=bool(g.mig) or None,
            mig_devices=tuple(
                MigDevice(
                    uuid=m.uuid,
                    parent_uuid=g.uuid,
                    index=j,
                    profile=m.profile,
                    memory_total=_mig_memory(m),
                    simulated=True,
                )
                for j, m in enumerate(g.mig)
            ),
            healthy=g.unhealthy is None,
            reason=g.unhealthy or "",
            simulated=True,
        )

    def _links(self) -> Topology:
        given = {(min(link.gpus), max(link.gpus)): link for link in self._node.links}
        links: dict[tuple[int, int], Link] = {}
        for i, a in enumerate(self._gpus):
            for b in self._gpus[i + 1 :]:
                entry = given.get((a.index, b.index))
                switched = a.nvswitch and b.nvswitch
                nvlinks = (entry.nvlinks if entry else 0) + (
                    min(a.nvswitch_links, b.nvswitch_links) if switched else 0
                )
                pcie = PcieLevel[entry.pcie] if entry else PcieLevel.SYS
                if entry or switched:
                    links[a.index, b.index] = Link(pcie, nvlinks, switched)
        return Topology(links, simulated=True)

    def inventory(self) -> tuple[Device, ...]:
        return self._devices

    def topology(self) -> Topology:
        return self._topology

    def telemetry(self) -> tuple[Telemetry, ...]:
        used_by: dict[str, int] = {}
        owner = {m.uuid: d.uuid for d in self._devices for m in d.mig_devices}
        for p in self._node.processes:
            uuid = self._uuid_of(p.gpu)
            used_by[owner.get(uuid, uuid)] = used_by.get(owner.get(uuid, uuid), 0) + (p.memory or 0)
        out = []
        for g in self._gpus:
            power = g.power
            out.append(
                Telemetry(
                    uuid=g.uuid,
                    index=g.index,
                    utilization=g.utilization,
                    memory_used=g.memory_used
                    if g.memory_used is not None
                    else used_by.get(g.uuid, 0),
                    memory_total=g.memory,
                    power_draw_mw=_mw(power.draw) if power and power.draw else None,
                    power_limit_mw=self._limits.get(g.uuid),
                    power_min_mw=_mw(power.min) if power else None,
                    power_max_mw=_mw(power.max) if power else None,
                    power_default_mw=_mw(power.default) if power else None,
                    temperature_c=g.temperature,
                    simulated=True,
                )
            )
        return tuple(out)

    def _uuid_of(self, gpu: int | str) -> str:
        if isinstance(gpu, int):
            return next(d.uuid for d in self._devices if d.index == gpu)
        return gpu

    def processes(self) -> tuple[GpuProcess, ...]:
        return tuple(
            GpuProcess(
                pid=p.pid,
                device_uuid=self._uuid_of(p.gpu),
                used_memory=p.memory,
                cgroup=p.cgroup if p.cgroup is not None else cgroup_of(p.pid, self._proc_root),
                simulated=True,
            )
            for p in self._node.processes
        )

    def poll_health(self) -> tuple[XidEvent, ...]:
        return ()

    def health(self) -> dict[str, str]:
        return {d.uuid: d.reason for d in self._devices if not d.healthy}

    def set_power_limit(self, uuid: str, milliwatts: int) -> PowerLimit:
        gpu = next((g for g in self._gpus if g.uuid == uuid), None)
        if gpu is None:
            raise GpuError(f"no GPU with UUID {uuid!r} on this simulated node")
        if gpu.power is None:
            raise GpuError(
                f"GPU {gpu.index} ({uuid}) has no simulated power limits: "
                "add power: {min: W, max: W, default: W} to its entry"
            )
        low, high = _mw(gpu.power.min), _mw(gpu.power.max)
        self._limits[uuid] = min(max(milliwatts, low), high)
        return PowerLimit(uuid, milliwatts, self._limits[uuid], low, high, simulated=True)

    def close(self) -> None:
        return None


def _mw(watts: float) -> int:
    return round(watts * 1000)
