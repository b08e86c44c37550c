"""Read one cgroup's interface files into a CgroupSample: all of them (a full read), or
only what moves and what the policies in use need (a lean read)."""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

from nodeagent.cgroupfs import parse
from nodeagent.cgroupfs.tree import CgroupDir, CgroupReadError, CgroupTree, CgroupVanished, KeptDir
from nodeagent.cgroupfs.values import (
    Attribute,
    CpuWeight,
    Frozen,
    MemoryLimit,
    Value,
    is_idle_weight,
)
from nodeagent.errors import one_line
from nodeagent.snapshot import NO_NEEDS, CgroupSample, Needs

__all__ = [
    "NO_NEEDS",
    "TICK_FILES",
    "LeanRead",
    "Memo",
    "Needs",
    "probe",
    "read_lean",
    "read_sample",
]

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
    "cpuset.cpus",
    "pids.max",
)

_MEMORY_LIMITS = (
    Attribute.MEMORY_MAX,
    Attribute.MEMORY_HIGH,
    Attribute.MEMORY_LOW,
    Attribute.MEMORY_MIN,
)


Memo = dict[str, dict[str, object]]
"""Settings files as full reads parsed them, for all workloads: name -> text -> value. A
setting's value depends on its text alone (and the page size: a memo is for one), and
workloads share few texts ("max", "100", what the agent wrote), so one table serves them all,
the values shared too."""

MEMO_TEXTS = 1024
"""Texts kept per file name; a table that fills is emptied (then parses cost what no memo
costs), so a node of many distinct limits cannot grow it."""


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


def _parsed(
    d: CgroupDir, name: str, text: str, parser: Callable[[str], T], memo: Memo | None = None
) -> T:
    """The parsed file; what it holds that cannot be used is an error naming the file.
    With `memo`, a file that reads as it did last time is the value it was then."""
    table = None if memo is None else memo.setdefault(name, {})
    if table is not None and text in table:
        return cast(T, table[text])
    try:
        value = parser(text)
    except Exception as e:  # ValueError, KeyError, InvalidValue: whatever the content
        raise CgroupReadError(f"cgroup {d.path or '/'}: {name}: {one_line(e)}", None) from e
    if table is not None:
        if len(table) >= MEMO_TEXTS:
            table.clear()
        table[text] = value
    return value


def _frozen(text: str) -> Frozen:
    value = parse.single_int(text)
    if value not in (0, 1):
        raise ValueError(f"cgroup.freeze holds {value}, not 0 or 1")
    return Frozen(value == 1)


def read_sample(
    d: CgroupDir, page_size: int, *, threads: bool = False, memo: Memo | None = None
) -> CgroupSample:
    """Raises on anything unreadable or unparsable; the sensor skips that one cgroup.
    `threads` also counts the cgroup's threads (for deadline jobs). `memo`: the settings
    files as full reads (at the same page size) parsed them, updated here; a setting whose
    text was parsed before is not parsed again. Counters and state (cpu.stat, the
    memory counters, pressure, cgroup.events) are parsed at each read and not kept: they move
    at most reads of a live cgroup, parse in microseconds, and their texts and values kept for
    every workload cost more memory (about 2 MB at 1,000 workloads) than their parse costs
    time on the few full reads of a tick."""

    def counter(name: str, parser: Callable[[str], T]) -> T | None:
        text = d.read_optional(name)
        return None if text is None else _parsed(d, name, text, parser)

    def get(name: str, parser: Callable[[str], T]) -> T | None:
        text = d.read_optional(name)
        return None if text is None else _parsed(d, name, text, parser, memo)

    events = counter("cgroup.events", parse.flat_keyed) or {}
    cpu = counter("cpu.stat", parse.flat_keyed) or {}
    anon, file = counter("memory.stat", parse.anon_file) or (None, None)
    settings: dict[Attribute, Value] = {}
    weight_text = d.read_optional(Attribute.CPU_WEIGHT)
    weight = (
        None
        if weight_text is None
        else _parsed(d, Attribute.CPU_WEIGHT, weight_text, weight_or_idle, memo)
    )
    idle = weight_text is not None and weight is None
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
    cpuset = get(Attribute.CPUSET_CPUS, parse.cpuset)  # only where the controller is enabled
    if cpuset is not None:
        settings[Attribute.CPUSET_CPUS] = cpuset
    pids = get(Attribute.PIDS_MAX, parse.pids_max)  # only where the pids controller is
    if pids is not None:
        settings[Attribute.PIDS_MAX] = pids
    return CgroupSample(
        populated=bool(events["populated"]) if "populated" in events else None,
        cpu_usage_us=cpu.get("usage_usec"),
        cpu_nr_periods=cpu.get("nr_periods"),
        cpu_nr_throttled=cpu.get("nr_throttled"),
        cpu_throttled_us=cpu.get("throttled_usec"),
        memory_current=counter("memory.current", parse.single_int),
        memory_anon=anon,
        memory_file=file,
        memory_events=counter("memory.events", parse.flat_keyed) or {},
        cpu_psi=_pressure(d, "cpu.pressure"),
        memory_psi=_pressure(d, "memory.pressure"),
        threads=_threads(d) if threads else None,
        settings=settings,
        cpu_idle=idle,
    )


def weight_or_idle(text: str) -> CpuWeight | None:
    """What cpu.weight holds; None where cpu.idle is set (it reads 0, and no weight is set)."""
    return None if is_idle_weight(text) else CpuWeight(parse.single_int(text))


def _threads(d: CgroupDir) -> int | None:
    """Its threads; None on a kernel before 4.14 (no cgroup.threads), not a vanished cgroup."""
    text = d.read_optional("cgroup.threads")
    return None if text is None else len(text.split())


def read_lean(
    d: KeptDir, known: CgroupSample, needs: Needs, last: LeanRead | None = None
) -> LeanRead:
    """The usage counters and what `needs` asks for, fresh; everything else as `known`
    (the last full read, updated with what the agent wrote since). Whether it holds
    processes is unknown unless asked for: its CPU rate says whether it is busy.

    `last`: this workload's previous lean read. When cpu.stat reads the same text over the
    same `known` and nothing else is asked for (an idle workload), its sample is the same:
    it is returned again, unparsed. cpu.stat, read at every lean read, is kept open."""
    text = d.reread("cpu.stat")
    if needs is NO_NEEDS or needs == NO_NEEDS:
        if last is not None and last.text == text and last.known is known:
            return last
        cpu = parse.flat_keyed(text)
        return LeanRead(text, known, _lean(cpu, known, needs))
    cpu = parse.flat_keyed(text)
    populated = memory = psi = threads = None
    if needs.events:
        populated = bool(parse.flat_keyed(d.read("cgroup.events"))["populated"])
    if needs.memory:
        memory_text = d.read_optional("memory.current")
        memory = None if memory_text is None else parse.single_int(memory_text)
    if needs.pressure:
        psi = _pressure(d, "cpu.pressure")
    if needs.threads:
        threads = _threads(d)
    sample = _lean(cpu, known, needs, populated=populated, memory=memory, psi=psi, threads=threads)
    return LeanRead(text, None, sample)  # fresh beyond cpu.stat: never reused


@dataclass(frozen=True, slots=True)
class LeanRead:
    """A lean read: the cpu.stat text it parsed, the full read it stands on (None when it
    read more than cpu.stat: then it is not reused), and its sample."""

    text: str
    known: CgroupSample | None
    sample: CgroupSample


def _lean(
    cpu: dict[str, int],
    known: CgroupSample,
    needs: Needs,
    *,
    populated: bool | None = None,
    memory: int | None = None,
    psi: parse.Psi | None = None,
    threads: int | None = None,
) -> CgroupSample:
    k = known
    return CgroupSample(  # one constructor call: dataclasses.replace costs as much as a read
        populated=populated,
        cpu_usage_us=cpu.get("usage_usec"),
        cpu_nr_periods=cpu.get("nr_periods"),
        cpu_nr_throttled=cpu.get("nr_throttled"),
        cpu_throttled_us=cpu.get("throttled_usec"),
        memory_current=memory if needs.memory else k.memory_current,
        memory_anon=k.memory_anon,
        memory_file=k.memory_file,
        memory_events=k.memory_events,
        cpu_psi=psi if needs.pressure else k.cpu_psi,
        memory_psi=k.memory_psi,
        threads=threads if needs.threads else k.threads,
        settings=k.settings,
        cpu_idle=k.cpu_idle,
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
