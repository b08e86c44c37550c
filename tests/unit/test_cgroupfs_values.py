"""Values written to cgroup files: bounds checked before the kernel sees them, and their order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.cgroupfs.values import (
    CpuMax,
    CpuWeight,
    MemoryLimit,
    Value,
    is_looser,
)
from nodeagent.errors import InvalidValue

# The kernel's largest quota: max_cfs_runtime = MAX_BW (2^44 - 1) µs (kernel/sched/core.c,
# tg_set_cfs_bandwidth); a larger quota is rejected with EINVAL.
KERNEL_MAX_QUOTA_US = 2**44 - 1


# --- bounds -------------------------------------------------------------------------


@pytest.mark.parametrize("weight", [1, 100, 10_000])
def test_weight_in_range(weight: int) -> None:
    assert CpuWeight(weight).render() == str(weight)


@pytest.mark.parametrize("weight", [-1, 0, 10_001, 1_000_000])
def test_weight_out_of_range(weight: int) -> None:
    with pytest.raises(InvalidValue, match=rf"cpu.weight {weight} is outside 1..10000"):
        CpuWeight(weight)


@pytest.mark.parametrize(
    ("quota", "period"),
    [
        (1000, 100_000),
        (150_000, 100_000),
        (None, 1000),
        (None, 1_000_000),
        (1000, 1000),
        (KERNEL_MAX_QUOTA_US, 1_000_000),
    ],
)
def test_cpu_max_in_range(quota: int | None, period: int) -> None:
    value = CpuMax(quota, period)
    assert value.render() == f"{'max' if quota is None else quota} {period}"


@pytest.mark.parametrize(
    ("quota", "period", "message"),
    [
        (999, 100_000, "quota 999 µs is below 1000"),
        (0, 100_000, "quota 0 µs is below 1000"),
        (-1, 100_000, "quota -1 µs is below 1000"),
        (100_000, 999, "period 999 µs is outside 1000..1000000"),
        (None, 999, "period 999 µs is outside 1000..1000000"),
        (100_000, 1_000_001, "period 1000001 µs is outside 1000..1000000"),
    ],
)
def test_cpu_max_out_of_range(quota: int | None, period: int, message: str) -> None:
    with pytest.raises(InvalidValue, match=message):
        CpuMax(quota, period)


def test_cpu_max_quota_above_the_kernel_maximum_is_refused() -> None:
    """The kernel answers EINVAL for quota > 2^44-1 µs; refuse it at plan time instead."""
    with pytest.raises(InvalidValue):
        CpuMax(KERNEL_MAX_QUOTA_US + 1, 100_000)


def test_from_cores_with_an_absurd_core_count_raises_invalid_value() -> None:
    """The schema accepts any finite core count; the value must fail cleanly, not overflow."""
    with pytest.raises(InvalidValue):
        CpuMax.from_cores(1e303, 1_000_000)


@pytest.mark.parametrize(
    ("cores", "period", "expected"),
    [
        (1.5, 100_000, "150000 100000"),
        (0.5, 50_000, "25000 50000"),
        (2.0, 1_000_000, "2000000 1000000"),
        (0.001, 100_000, "1000 100000"),  # 100 µs would be refused: raised to the minimum
        (None, 100_000, "max 100000"),
    ],
)
def test_cpu_max_from_cores(cores: float | None, period: int, expected: str) -> None:
    assert CpuMax.from_cores(cores, period).render() == expected


def test_cpu_max_cores() -> None:
    assert CpuMax(150_000, 100_000).cores == 1.5
    assert CpuMax(None).cores is None


@pytest.mark.parametrize(
    ("value", "page"), [(None, 4096), (0, 4096), (4096, 4096), (4 << 30, 4096), (65536, 65536)]
)
def test_memory_limit_aligned_values(value: int | None, page: int) -> None:
    limit = MemoryLimit(value, page)
    assert limit.render() == ("max" if value is None else str(value))


@pytest.mark.parametrize(
    ("value", "page", "message"),
    [
        (4095, 4096, "not a multiple of the page size 4096"),
        (4097, 4096, "not a multiple of the page size 4096"),
        (4096, 65536, "not a multiple of the page size 65536"),
        (-4096, 4096, "is negative"),
    ],
)
def test_memory_limit_refused(value: int, page: int, message: str) -> None:
    with pytest.raises(InvalidValue, match=message):
        MemoryLimit(value, page)


@pytest.mark.parametrize(
    ("value", "page", "expected"),
    [
        (4096, 4096, 4096),
        (4097, 4096, 4096),
        (8191, 4096, 4096),
        (4095, 4096, 0),
        (1_000_000, 4096, 999_424),
        (1_000_000, 65536, 983_040),
        (None, 4096, None),
    ],
)
def test_memory_limit_aligned_rounds_down(
    value: int | None, page: int, expected: int | None
) -> None:
    limit = MemoryLimit.aligned(value, page)
    assert limit.bytes == expected
    assert limit.page_size == page


@given(
    st.integers(min_value=0, max_value=2**63),
    st.sampled_from([4096, 16384, 65536]),
)
def test_aligned_is_the_largest_page_multiple_not_above(value: int, page: int) -> None:
    limit = MemoryLimit.aligned(value, page)
    assert limit.bytes is not None
    assert limit.bytes % page == 0
    assert value - page < limit.bytes <= value


# --- looser / tighter -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("new", "old", "looser"),
    [
        # cpu.max: 'max' is looser than any quota; compared in cores, not raw quota
        (CpuMax(None), CpuMax(50_000), True),
        (CpuMax(None), CpuMax(KERNEL_MAX_QUOTA_US, 1000), True),
        (CpuMax(50_000), CpuMax(None), False),
        (CpuMax(None), CpuMax(None), False),
        (CpuMax(200_000), CpuMax(100_000), True),
        (CpuMax(100_000), CpuMax(100_000), False),
        (CpuMax(100_000), CpuMax(200_000), False),
        (CpuMax(100_000, 200_000), CpuMax(60_000, 100_000), False),  # 0.5 < 0.6 cores
        (CpuMax(60_000, 100_000), CpuMax(100_000, 200_000), True),
        (CpuMax(50_000, 50_000), CpuMax(100_000, 100_000), False),  # both 1 core
        # memory: 'max' is looser than any byte count
        (MemoryLimit(None), MemoryLimit(1 << 40), True),
        (MemoryLimit(None), MemoryLimit(0), True),
        (MemoryLimit(0), MemoryLimit(None), False),
        (MemoryLimit(None), MemoryLimit(None), False),
        (MemoryLimit(8192), MemoryLimit(4096), True),
        (MemoryLimit(4096), MemoryLimit(4096), False),
        (MemoryLimit(4096), MemoryLimit(8192), False),
        # weights are relative: never ordered
        (CpuWeight(10_000), CpuWeight(1), False),
        (CpuWeight(1), CpuWeight(10_000), False),
        # different types are never compared
        (CpuMax(None), MemoryLimit(4096), False),
        (MemoryLimit(None), CpuMax(1000), False),
        (CpuWeight(10_000), CpuMax(1000), False),
        (MemoryLimit(None), CpuWeight(1), False),
    ],
)
def test_is_looser(new: Value, old: Value, looser: bool) -> None:
    assert is_looser(new, old) is looser


@pytest.mark.parametrize(
    ("new", "old"),
    [
        (CpuMax(200_000), CpuMax(100_000)),
        (CpuMax(None), CpuMax(100_000)),
        (MemoryLimit(8192), MemoryLimit(4096)),
        (MemoryLimit(None), MemoryLimit(4096)),
    ],
)
def test_looser_than_agrees_with_is_looser_and_is_asymmetric(new: Value, old: Value) -> None:
    assert new.looser_than(old)  # type: ignore[arg-type]
    assert not old.looser_than(new)  # type: ignore[arg-type]
    assert is_looser(new, old) and not is_looser(old, new)


limits = st.builds(
    MemoryLimit, st.none() | st.integers(min_value=0, max_value=2**40).map(lambda n: n * 4096)
)
cpu_maxes = st.builds(
    CpuMax,
    st.none() | st.integers(min_value=1000, max_value=10**9),
    st.integers(min_value=1000, max_value=1_000_000),
)


@given(st.one_of(st.tuples(limits, limits), st.tuples(cpu_maxes, cpu_maxes)))
def test_looser_is_a_strict_order(pair: tuple[Value, Value]) -> None:
    a, b = pair
    assert not (is_looser(a, b) and is_looser(b, a))
    assert not is_looser(a, a)
