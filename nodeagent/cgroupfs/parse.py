"""Parsers for cgroup v2 interface files (see the kernel's cgroup-v2.rst, "Interface Files").

They take the file's text and nothing else, so they are tested on captured
kernel output and fuzzed without a kernel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nodeagent.cgroupfs.values import CpuMax, CpuSet, PidsMax


def flat_keyed(text: str) -> dict[str, int]:
    """'KEY VALUE' lines: cpu.stat, memory.events, cgroup.events."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key and value:
            out[key] = int(value)
    return out


def anon_file(text: str) -> tuple[int | None, int | None]:
    """memory.stat's anon and file bytes: all a sample keeps of its fifty-odd keys. Found by
    their lines' starts rather than by splitting every line (a full read's dearest parse:
    the kernel prints them first); what flat_keyed would give for them."""
    return _keyed(text, "anon"), _keyed(text, "file")


def _keyed(text: str, key: str) -> int | None:
    """The value of the line `KEY VALUE` in flat-keyed text (the last one, as flat_keyed
    keeps it), or None where there is none or it has no value."""
    at = text.rfind("\n" + key + " ") + 1
    if at == 0 and not text.startswith(key + " "):
        return None
    end = text.find("\n", at)
    value = text[at + len(key) + 1 : None if end < 0 else end]
    return int(value) if value else None


def single_int(text: str) -> int:
    """memory.current, cpu.weight and other one-number files."""
    return int(text.strip())


def limit(text: str) -> int | None:
    """memory.max/high/low/min: a byte count, or 'max' (returned as None)."""
    value = text.strip()
    return None if value == "max" else int(value)


def pids_max(text: str) -> PidsMax:
    """pids.max: a number of tasks, or 'max'."""
    return PidsMax(limit(text))


def cpu_max(text: str) -> CpuMax:
    """cpu.max: '$MAX $PERIOD', where $MAX may be 'max'."""
    quota, _, period = text.strip().partition(" ")
    return CpuMax(None if quota == "max" else int(quota), int(period) if period else 100_000)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """CPUs from the kernel's list format, such as '0-55,112-167' (empty for '')."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        m = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", part)
        if not m:
            raise ValueError(f"expected a CPU list such as 0-55,112-167, got {text!r}")
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
        if last < first:
            raise ValueError(f"CPU range {part!r} runs backwards")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def cpuset(text: str) -> CpuSet:
    """cpuset.cpus: a CPU list; empty when the cgroup takes its parent's CPUs."""
    return CpuSet(parse_cpulist(text.strip()))


def controllers(text: str) -> frozenset[str]:
    """cgroup.controllers and cgroup.subtree_control: space-separated names."""
    return frozenset(text.split())


@dataclass(frozen=True, slots=True)
class PsiLine:
    avg10: float
    avg60: float
    avg300: float
    total_us: int


@dataclass(frozen=True, slots=True)
class Psi:
    """Pressure stall information; `full` is absent for cpu on older kernels."""

    some: PsiLine
    full: PsiLine | None


def psi(text: str) -> Psi:
    """cpu.pressure / memory.pressure: 'some avg10=.. avg60=.. avg300=.. total=..' lines."""
    lines: dict[str, PsiLine] = {}
    for line in text.splitlines():
        kind, *fields = line.split()
        values = dict(field.split("=", 1) for field in fields)
        lines[kind] = PsiLine(
            float(values["avg10"]),
            float(values["avg60"]),
            float(values["avg300"]),
            int(values["total"]),
        )
    return Psi(lines["some"], lines.get("full"))
