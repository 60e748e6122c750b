"""The batch buffer pool: size buckets, reuse, the byte budget, LRU eviction, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from carpool import ConfigError
from carpool.core.buffer_pool import BufferPool, bucket_rows, check_pool_options


@pytest.mark.parametrize(
    ("rows", "preferred", "bucket"),
    [
        (1, (), 1),
        (2, (), 2),
        (3, (), 4),
        (5, (), 8),
        (8, (), 8),
        (9, (), 16),
        (3, (4, 8), 4),
        (5, (4, 8), 8),
        (8, (4, 8), 8),
        (9, (4, 8), 16),  # past the largest preferred size: a power of two
    ],
)
def test_bucket_is_the_next_preferred_size_else_power_of_two(rows, preferred, bucket):
    assert bucket_rows(rows, preferred) == bucket


def test_pool_buckets_by_its_preferred_sizes():
    pool = BufferPool(1 << 20, (6, 3))
    assert pool.bucket(4) == 6
    assert pool.bucket(7) == 8


def test_buffer_given_back_is_reused_for_the_same_key():
    pool = BufferPool(1 << 20)
    first = pool.acquire_numpy((8, 3), np.float32)
    pool.release(first)
    again = pool.acquire_numpy((8, 3), np.float32)
    assert again is first
    stats = pool.stats()
    assert (stats.hits, stats.misses) == (1, 1)
    assert stats.bytes_held == 0  # leased out again


@pytest.mark.parametrize(
    ("shape", "dtype"), [((8, 4), np.float32), ((4, 3), np.float32), ((8, 3), np.int64)]
)
def test_other_shape_or_dtype_is_not_reused(shape, dtype):
    pool = BufferPool(1 << 20)
    pool.release(pool.acquire_numpy((8, 3), np.float32))
    other = pool.acquire_numpy(shape, dtype)
    assert other.shape == shape and other.dtype == dtype
    assert pool.stats().misses == 2
    assert pool.stats().num_buffers == 1  # the first one still idle


def test_structured_dtypes_of_one_size_are_not_reused_for_each_other():
    """Was: keyed by dtype.str, "|V4" for both, so a buffer of fields ("x",) came back
    for a request of fields ("z",) and the model saw the wrong field names."""
    pool = BufferPool(1 << 20)
    first, second = np.dtype([("x", "<i4")]), np.dtype([("z", "<i4")])
    pool.release(pool.acquire_numpy((2,), first))
    assert pool.acquire_numpy((2,), second).dtype == second
    assert pool.stats().misses == 2


def test_two_leases_of_one_key_are_distinct_buffers():
    pool = BufferPool(1 << 20)
    a = pool.acquire_numpy((4,), np.float64)
    b = pool.acquire_numpy((4,), np.float64)
    assert not np.shares_memory(a, b)
    pool.release(a)
    pool.release(b)
    assert pool.stats().num_buffers == 2
    assert pool.stats().bytes_held == 64


def test_budget_evicts_the_least_recently_used_bucket():
    pool = BufferPool(3 * 800)  # room for three 800-byte buffers
    a, b, c, d = (4, 25), (25, 4), (10, 10), (50, 2)  # 100 float64 each
    buffers = {shape: pool.acquire_numpy(shape, np.float64) for shape in (a, b, c)}
    for shape in (a, b, c):
        pool.release(buffers[shape])
    pool.release(pool.acquire_numpy(a, np.float64))  # a is now the most recent
    pool.release(pool.acquire_numpy(d, np.float64))  # a fourth: b must go
    stats = pool.stats()
    assert stats.evictions == 1
    assert stats.bytes_held == 3 * 800 == stats.budget_bytes
    assert pool.acquire_numpy(b, np.float64) is not buffers[b]  # b was evicted
    assert pool.acquire_numpy(a, np.float64) is buffers[a]  # a was kept
    assert pool.acquire_numpy(c, np.float64) is buffers[c]


def test_buffer_larger_than_the_budget_is_not_kept():
    pool = BufferPool(100)
    pool.release(pool.acquire_numpy((1000,), np.uint8))
    assert pool.stats().bytes_held == 0
    assert pool.stats().evictions == 1


def test_clear_drops_idle_buffers():
    pool = BufferPool(1 << 20)
    pool.release(pool.acquire_numpy((8,), np.float32))
    pool.clear()
    assert pool.stats().bytes_held == 0 and pool.stats().num_buffers == 0


def test_threads_never_share_a_leased_buffer():
    pool = BufferPool(1 << 20)
    errors: list[str] = []
    start = threading.Barrier(8)

    def work(marker: int) -> None:
        start.wait()
        for _ in range(300):
            buffer = pool.acquire_numpy((16,), np.int64)
            buffer.fill(marker)
            if not (buffer == marker).all():  # another thread wrote into it meanwhile
                errors.append(f"thread {marker} saw {buffer}")
            pool.release(buffer)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = pool.stats()
    assert stats.hits + stats.misses == 8 * 300
    assert stats.num_buffers == stats.misses  # every buffer made was given back
    assert stats.bytes_held == stats.misses * 16 * 8


def test_torch_buffers_are_pooled_too():
    torch = pytest.importorskip("torch")
    pool = BufferPool(1 << 20, pin_memory=True)  # no CUDA here: logged, not pinned
    first = pool.acquire_torch((4, 2), torch.float32, "cpu")
    pool.release(first)
    assert pool.acquire_torch((4, 2), torch.float32, "cpu") is first
    assert pool.acquire_torch((4, 2), torch.float64, "cpu") is not first


@pytest.mark.parametrize(
    ("buffer_pool", "mb", "field"),
    [
        ("yes", 1, "buffer_pool"),
        (1, 1, "buffer_pool"),
        (True, 0, "buffer_pool_mb"),
        (True, -5, "buffer_pool_mb"),
        (True, float("inf"), "buffer_pool_mb"),
        (True, "64", "buffer_pool_mb"),
        (True, True, "buffer_pool_mb"),
    ],
)
def test_options_are_checked(buffer_pool, mb, field):
    with pytest.raises(ConfigError) as caught:
        check_pool_options(buffer_pool, mb)
    assert caught.value.field == field
    assert "expected" in str(caught.value) or caught.value.expected


def test_budget_must_be_positive_bytes():
    with pytest.raises(ConfigError, match="budget_bytes"):
        BufferPool(0)
