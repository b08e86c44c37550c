"""Parsers for cgroup v2 interface files, on text as the kernel writes it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.cgroupfs import parse
from nodeagent.cgroupfs.values import PERIOD_MAX_US, PERIOD_MIN_US, QUOTA_MIN_US, CpuMax, CpuSet

# Captured from a 6.x kernel (values shortened where the file is long).
CPU_STAT = """\
usage_usec 183746512
user_usec 150112345
system_usec 33634167
core_sched.force_idle_usec 0
nr_periods 45120
nr_throttled 371
throttled_usec 18342215
nr_bursts 0
burst_usec 0
"""

MEMORY_STAT = """\
anon 1073741824
file 268435456
kernel 12582912
kernel_stack 1212416
pagetables 6291456
sec_pagetables 0
percpu 1040
sock 0
vmalloc 0
shmem 4096
zswap 0
zswapped 0
file_mapped 67108864
file_dirty 8192
file_writeback 0
swapcached 0
anon_thp 0
inactive_anon 536870912
active_anon 536870912
inactive_file 134217728
active_file 134217728
unevictable 0
slab_reclaimable 2097152
slab_unreclaimable 1048576
slab 3145728
workingset_refault_anon 0
workingset_refault_file 12
pgscan 1024
pgsteal 1000
pgfault 987654
pgmajfault 12
thp_fault_alloc 0
"""

MEMORY_EVENTS = "low 0\nhigh 1287\nmax 42\noom 3\noom_kill 2\noom_group_kill 0\n"
CGROUP_EVENTS_POPULATED = "populated 1\nfrozen 0\n"
CGROUP_EVENTS_EMPTY = "populated 0\nfrozen 0\n"

PSI_CPU = (
    "some avg10=1.53 avg60=0.87 avg300=0.21 total=9143321\n"
    "full avg10=0.00 avg60=0.12 avg300=0.03 total=1287006\n"
)
PSI_CPU_OLD_KERNEL = "some avg10=12.50 avg60=7.25 avg300=3.00 total=123456789\n"
PSI_MEMORY = (
    "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
)


def test_cpu_stat() -> None:
    stat = parse.flat_keyed(CPU_STAT)
    assert stat["usage_usec"] == 183746512
    assert stat["nr_periods"] == 45120
    assert stat["nr_throttled"] == 371
    assert stat["throttled_usec"] == 18342215
    assert stat["core_sched.force_idle_usec"] == 0
    assert len(stat) == 9


def test_memory_stat() -> None:
    stat = parse.flat_keyed(MEMORY_STAT)
    assert stat["anon"] == 1 << 30
    assert stat["file"] == 256 << 20
    assert stat["workingset_refault_file"] == 12
    assert len(stat) == MEMORY_STAT.count("\n")
    assert parse.anon_file(MEMORY_STAT) == (1 << 30, 256 << 20)  # what a sample keeps
    assert parse.anon_file("anon\nfile_mapped 7\n") == (None, None)  # no value, another key


def test_memory_events() -> None:
    assert parse.flat_keyed(MEMORY_EVENTS) == {
        "low": 0,
        "high": 1287,
        "max": 42,
        "oom": 3,
        "oom_kill": 2,
        "oom_group_kill": 0,
    }


@pytest.mark.parametrize(
    ("text", "populated"), [(CGROUP_EVENTS_POPULATED, 1), (CGROUP_EVENTS_EMPTY, 0)]
)
def test_cgroup_events(text: str, populated: int) -> None:
    assert parse.flat_keyed(text) == {"populated": populated, "frozen": 0}


def test_flat_keyed_ignores_blank_lines_and_a_missing_final_newline() -> None:
    assert parse.flat_keyed("\nlow 1\n\nhigh 2") == {"low": 1, "high": 2}


@given(
    st.dictionaries(
        st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=30),
        st.integers(min_value=0, max_value=2**64 - 1),
        max_size=40,
    )
)
def test_flat_keyed_reads_back_what_was_rendered(values: dict[str, int]) -> None:
    text = "".join(f"{k} {v}\n" for k, v in values.items())
    assert parse.flat_keyed(text) == values


def test_psi_with_full() -> None:
    psi = parse.psi(PSI_CPU)
    assert psi.some == parse.PsiLine(1.53, 0.87, 0.21, 9143321)
    assert psi.full == parse.PsiLine(0.0, 0.12, 0.03, 1287006)


def test_psi_without_full_on_older_kernels() -> None:
    psi = parse.psi(PSI_CPU_OLD_KERNEL)
    assert psi.some == parse.PsiLine(12.5, 7.25, 3.0, 123456789)
    assert psi.full is None


def test_psi_memory_all_zero() -> None:
    psi = parse.psi(PSI_MEMORY)
    assert psi.some.total_us == 0
    assert psi.full is not None
    assert psi.full.avg300 == 0.0


@pytest.mark.parametrize(
    ("text", "quota", "period"),
    [
        ("max 100000\n", None, 100_000),
        ("150000 100000\n", 150_000, 100_000),
        ("50000 1000000\n", 50_000, 1_000_000),
        ("1000 1000\n", 1000, 1000),
        ("max\n", None, 100_000),  # period left out: the kernel default
    ],
)
def test_cpu_max(text: str, quota: int | None, period: int) -> None:
    value = parse.cpu_max(text)
    assert value == CpuMax(quota, period)
    assert value.quota_us == quota
    assert value.period_us == period


def test_cpu_max_cores() -> None:
    assert parse.cpu_max("150000 100000\n").cores == 1.5
    assert parse.cpu_max("max 100000\n").cores is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [("max\n", None), ("4294967296\n", 4 << 30), ("0\n", 0), ("  8192 \n", 8192)],
)
def test_memory_limit(text: str, expected: int | None) -> None:
    assert parse.limit(text) == expected


@pytest.mark.parametrize("text", ["", "maximum\n", "4G\n", "1.5\n"])
def test_memory_limit_rejects_what_the_kernel_never_writes(text: str) -> None:
    with pytest.raises(ValueError):
        parse.limit(text)


@pytest.mark.parametrize(("text", "expected"), [("100\n", 100), ("10000\n", 10_000)])
def test_single_int(text: str, expected: int) -> None:
    assert parse.single_int(text) == expected


def test_controllers() -> None:
    text = "cpuset cpu io memory hugetlb pids rdma misc\n"
    assert parse.controllers(text) == frozenset(
        {"cpuset", "cpu", "io", "memory", "hugetlb", "pids", "rdma", "misc"}
    )
    assert parse.controllers("\n") == frozenset()


cpu_max_values = st.builds(
    CpuMax,
    st.none() | st.integers(min_value=QUOTA_MIN_US, max_value=2**44 - 1),
    st.integers(min_value=PERIOD_MIN_US, max_value=PERIOD_MAX_US),
)


@given(cpu_max_values)
def test_cpu_max_render_parse_round_trip(value: CpuMax) -> None:
    assert parse.cpu_max(value.render() + "\n") == value


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-3,8\n", (0, 1, 2, 3, 8)), ("\n", ()), ("5", (5,)), ("0-1,2-3", (0, 1, 2, 3))],
)
def test_cpuset_cpus(text: str, cpus: tuple[int, ...]) -> None:
    """cpuset.cpus as the kernel writes it; empty: the cgroup takes its parent's CPUs."""
    assert parse.cpuset(text) == CpuSet(cpus)


@given(st.frozensets(st.integers(0, 1023), max_size=64))
def test_cpuset_round_trips_in_the_kernels_own_form(cpus: frozenset[int]) -> None:
    """What the agent writes is what the kernel reads back (ranges merged, sorted), so an
    unchanged cpuset.cpus is never written again."""
    value = CpuSet(tuple(sorted(cpus)))
    assert parse.cpuset(value.render()) == value
    assert parse.cpuset(value.render()).render() == value.render()


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["anon", "file", "file_mapped", "anon_thp", "kernel", "x"]),
            st.one_of(st.just(""), st.integers(0, 1 << 50).map(str)),
        ),
        max_size=12,
    ),
    st.booleans(),
)
def test_anon_file_finds_what_flat_keyed_finds(lines: list[tuple[str, str]], end: bool) -> None:
    """The two values found by their lines' starts are flat_keyed's, whatever the order,
    repeats, keys that start alike or values left out."""
    text = "\n".join(f"{k} {v}" if v else k for k, v in lines) + ("\n" if end else "")
    flat = parse.flat_keyed(text)
    assert parse.anon_file(text) == (flat.get("anon"), flat.get("file"))
