"""Read one cgroup's interface files into a CgroupSample."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TypeVar

from nodeagent.cgroupfs import parse
from nodeagent.cgroupfs.tree import CgroupDir, CgroupReadError, CgroupTree, CgroupVanished
from nodeagent.cgroupfs.values import Attribute, CpuWeight, Frozen, MemoryLimit, Value
from nodeagent.errors import one_line
from nodeagent.snapshot import CgroupSample

T = TypeVar("T")

# The files one tick reads for each workload; the benchmark reads the same list raw.
TICK_FILES = (
    "cgroup.events",
    "cpu.stat",
    "cpu.weight",
    "cpu.max",
    "cpu.pressure",
    "memory.current",
    "memory.max",
    "memory.high",
    "memory.low",
    "memory.min",
    "memory.events",
    "memory.stat",
    "memory.pressure",
    "cgroup.freeze",
)

_MEMORY_LIMITS = (
    Attribute.MEMORY_MAX,
    Attribute.MEMORY_HIGH,
    Attribute.MEMORY_LOW,
    Attribute.MEMORY_MIN,
)


def _pressure(d: CgroupDir, name: str) -> parse.Psi | None:
    """A pressure file, or None where the kernel runs without PSI: older kernels booted
    with psi=0 answer reads with EOPNOTSUPP (newer ones hide the files)."""
    try:
        text = d.read_optional(name)
    except CgroupReadError as e:
        if e.errno == errno.EOPNOTSUPP:
            return None
        raise
    return None if text is None else _parsed(d, name, text, parse.psi)


def _parsed(d: CgroupDir, name: str, text: str, parser: Callable[[str], T]) -> T:
    """The parsed file; what it holds that cannot be used is an error naming the file."""
    try:
        return parser(text)
    except Exception as e:  # ValueError, KeyError, InvalidValue: whatever the content
        raise CgroupReadError(f"cgroup {d.path or '/'}: {name}: {one_line(e)}", None) from e


def _frozen(text: str) -> Frozen:
    value = parse.single_int(text)
    if value not in (0, 1):
        raise ValueError(f"cgroup.freeze holds {value}, not 0 or 1")
    return Frozen(value == 1)


def read_sample(d: CgroupDir, page_size: int, *, threads: bool = False) -> CgroupSample:
    """Raises on anything unreadable or unparsable; the sensor skips that one cgroup.
    `threads` also counts the cgroup's threads (for deadline jobs)."""

    def get(name: str, parser: Callable[[str], T]) -> T | None:
        text = d.read_optional(name)
        return None if text is None else _parsed(d, name, text, parser)

    events = get("cgroup.events", parse.flat_keyed) or {}
    cpu = get("cpu.stat", parse.flat_keyed) or {}
    mem_stat = get("memory.stat", parse.flat_keyed) or {}
    settings: dict[Attribute, Value] = {}
    weight = get(Attribute.CPU_WEIGHT, lambda text: CpuWeight(parse.single_int(text)))
    if weight is not None:
        settings[Attribute.CPU_WEIGHT] = weight
    cpu_max = get(Attribute.CPU_MAX, parse.cpu_max)
    if cpu_max is not None:
        settings[Attribute.CPU_MAX] = cpu_max
    for attr in _MEMORY_LIMITS:
        limit = get(attr, lambda text: MemoryLimit(parse.limit(text), page_size))
        if limit is not None:
            settings[attr] = limit
    frozen = get(Attribute.FREEZE, _frozen)
    if frozen is not None:
        settings[Attribute.FREEZE] = frozen
    return CgroupSample(
        populated=bool(events["populated"]) if "populated" in events else None,
        cpu_usage_us=cpu.get("usage_usec"),
        cpu_nr_periods=cpu.get("nr_periods"),
        cpu_nr_throttled=cpu.get("nr_throttled"),
        cpu_throttled_us=cpu.get("throttled_usec"),
        memory_current=get("memory.current", parse.single_int),
        memory_anon=mem_stat.get("anon"),
        memory_file=mem_stat.get("file"),
        memory_events=get("memory.events", parse.flat_keyed) or {},
        cpu_psi=_pressure(d, "cpu.pressure"),
        memory_psi=_pressure(d, "memory.pressure"),
        threads=len(d.read("cgroup.threads").split()) if threads else None,
        settings=settings,
    )


def probe(tree: CgroupTree, path: str, page_size: int) -> str | None:
    """Why the sensor would skip this cgroup now, or None when it reads fine."""
    try:
        with tree.open(path) as d:
            read_sample(d, page_size)
    except CgroupVanished:
        return "vanished"
    except Exception as e:  # the same net as the sensor's
        return one_line(e)
    return None
