"""Collation into pooled buffers: the same batches and results as without the pool, buffers
reused batch after batch, and results that never alias a buffer a later batch reuses."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from carpool import Batcher, BatchPolicy, ConfigError, batched
from carpool.core.buffer_pool import BufferPool
from carpool.core.collate import (
    DictCollator,
    ListCollator,
    NumpyCollator,
    PackedCollator,
    PaddedCollator,
    RaggedDictCollator,
)
from carpool.core.collate_pool import PooledCollator, pooled, unalias
from carpool.core.layout import Packed, Padded

DTYPES = st.sampled_from(["float32", "float64", "int8", "int32", "int64", "uint8", "bool"])
TRAILING = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


def _requests(draw: Any, dtype: str, trailing: tuple[int, ...]) -> tuple[list[Any], list[bool]]:
    """Payloads of one signature: single items and submit_many blocks, mixed."""
    is_many = draw(st.lists(st.booleans(), min_size=1, max_size=6))
    payloads = []
    for many in is_many:
        shape = (draw(st.integers(0, 3)), *trailing) if many else trailing
        payloads.append(draw(hnp.arrays(dtype, shape)))
    return payloads, is_many


@st.composite
def dense_requests(draw: Any) -> tuple[list[Any], list[bool]]:
    return _requests(draw, draw(DTYPES), draw(TRAILING))


@st.composite
def packed_requests(draw: Any) -> tuple[list[Any], list[bool]]:
    dtype = draw(DTYPES)
    trailing = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3))
    is_many = draw(st.lists(st.booleans(), min_size=1, max_size=5))
    payloads: list[Any] = []
    for many in is_many:
        count = draw(st.integers(1, 3)) if many else 1
        items = [
            draw(hnp.arrays(dtype, (draw(st.integers(0, 5)), *trailing))) for _ in range(count)
        ]
        payloads.append(items if many else items[0])
    return payloads, is_many


def _same(a: Any, b: Any) -> None:
    if isinstance(a, Packed | Padded):
        assert type(a) is type(b)
        for field in dataclasses.fields(a):
            _same(getattr(a, field.name), getattr(b, field.name))
        return
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
        return
    if isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
        return
    assert type(a) is type(b)  # an array, or a NumPy scalar for a 0-d item
    assert a.dtype == b.dtype and np.shape(a) == np.shape(b)
    np.testing.assert_array_equal(a, b)  # NaN equal to NaN


def _round_trip(inner: Any, payloads: list[Any], is_many: list[bool], rounds: int = 3) -> None:
    """Collate with and without the pool ``rounds`` times: the same batch each time, and
    an identity model's results equal to the payloads."""
    pool = BufferPool(1 << 24)
    wrapped = pooled(inner, pool)
    assert isinstance(wrapped, PooledCollator)
    counts = [inner.num_items(p) if m else 1 for p, m in zip(payloads, is_many, strict=True)]
    for _ in range(rounds):
        plain = inner.collate(payloads, is_many)
        batch, lease = wrapped.collate_leased(payloads, is_many)
        _same(plain, batch)
        outputs = batch.items() if isinstance(batch, Packed) else batch
        if isinstance(batch, Padded):
            outputs = batch.mask.sum(axis=1)
        results = wrapped.split_leased(outputs, counts, is_many, lease)
        expected = inner.split(
            plain.items()
            if isinstance(plain, Packed)
            else plain
            if not isinstance(plain, Padded)
            else plain.mask.sum(axis=1),
            counts,
            is_many,
        )
        _same(expected, results)
    stats = pool.stats()
    if stats.misses:  # the first round allocated; the others reused
        assert stats.hits >= stats.misses * (rounds - 1)


@settings(max_examples=60, deadline=None)
@given(dense_requests())
def test_numpy_batches_and_results_match_without_the_pool(requests):
    payloads, is_many = requests
    _round_trip(NumpyCollator(), payloads, is_many)


@settings(max_examples=40, deadline=None)
@given(dense_requests(), dense_requests())
def test_dict_batches_and_results_match_without_the_pool(first, second):
    payloads_a, is_many = first
    # a second named input with the same rows per request
    payloads_b = [
        np.resize(second[0][0], (p.shape[0], *second[0][0].shape) if m else second[0][0].shape)
        for p, m in zip(payloads_a, is_many, strict=True)
    ]
    payloads = [{"a": a, "b": b} for a, b in zip(payloads_a, payloads_b, strict=True)]
    _round_trip(DictCollator(), payloads, is_many)


@settings(max_examples=60, deadline=None)
@given(packed_requests())
def test_packed_batches_and_results_match_without_the_pool(requests):
    payloads, is_many = requests
    _round_trip(PackedCollator(), payloads, is_many)


@settings(max_examples=40, deadline=None)
@given(packed_requests(), st.sampled_from([None, 1, 4]))
def test_padded_batches_match_without_the_pool(requests, multiple_of):
    payloads, is_many = requests
    if payloads[0] is not None and np.asarray(_first(payloads[0], is_many[0])).dtype == bool:
        pad: Any = False
    else:
        pad = 0
    _round_trip(PaddedCollator(pad, multiple_of), payloads, is_many)


def _first(payload: Any, many: bool) -> Any:
    return payload[0] if many else payload


@settings(max_examples=30, deadline=None)
@given(dense_requests())
def test_torch_batches_match_without_the_pool(requests):
    torch = pytest.importorskip("torch")
    from carpool.core.collate import TorchCollator

    payloads, is_many = requests
    tensors = [torch.from_numpy(np.array(p)) for p in payloads]
    inner = TorchCollator()
    wrapped = pooled(inner, BufferPool(1 << 24))
    for _ in range(2):
        batch, lease = wrapped.collate_leased(tensors, is_many)
        plain = inner.collate(tensors, is_many)
        assert batch.dtype == plain.dtype and batch.shape == plain.shape
        np.testing.assert_array_equal(batch.numpy(), plain.numpy())  # NaN equal to NaN
        for buffer in lease:
            wrapped.pool.release(buffer)


def test_second_batch_reuses_the_first_ones_buffer():
    wrapped = pooled(NumpyCollator(), BufferPool(1 << 20))
    payloads = [np.ones(3, np.float32), np.zeros(3, np.float32), np.ones(3, np.float32)]
    batch, lease = wrapped.collate_leased(payloads, [False] * 3)
    assert batch.shape == (3, 3) and lease[0].shape == (4, 3)  # bucket 4
    wrapped.split_leased(batch * 2, [1, 1, 1], [False] * 3, lease)
    _, lease_two = wrapped.collate_leased(payloads[:2], [False] * 2)
    assert lease_two[0].shape == (2, 3)  # bucket 2: a buffer of its own
    _, lease_three = wrapped.collate_leased(payloads, [False] * 3)
    assert lease_three[0] is lease[0]  # bucket 4 again: the first batch's buffer


def test_collators_the_pool_cannot_write_are_left_alone():
    pool = BufferPool(1 << 20)
    for collator in (ListCollator(), RaggedDictCollator(["x"])):
        assert pooled(collator, pool) is collator
    assert pooled(NumpyCollator(), None).__class__ is NumpyCollator


def test_items_of_unequal_shapes_fail_as_without_the_pool():
    wrapped = pooled(PackedCollator(), BufferPool(1 << 20))
    items = [np.zeros((2, 3)), np.zeros((2, 4))]
    with pytest.raises(ValueError, match="equal trailing shapes"):
        wrapped.collate_leased([items], [True])
    assert wrapped.pool.stats().num_buffers == 0 or wrapped.pool.stats().bytes_held >= 0


def test_wrapped_collator_keeps_its_attributes():
    wrapped = pooled(PaddedCollator(-1, 8), BufferPool(1 << 20))
    assert wrapped.pads and wrapped.multiple_of == 8 and hasattr(wrapped, "lengths")


def test_unalias_copies_only_what_shares_the_buffer():
    buffer = np.arange(12.0).reshape(4, 3)
    own = np.ones(3)
    view = buffer[1:3]
    out = unalias({"a": view, "b": (own, buffer.T)}, [buffer])
    assert not np.shares_memory(out["a"], buffer) and np.array_equal(out["a"], view)
    assert out["b"][0] is own
    assert not np.shares_memory(out["b"][1], buffer)


Pair = collections.namedtuple("Pair", "total peak")


def test_unalias_keeps_a_namedtuple_whether_or_not_it_copies():
    """Was: a namedtuple was rebuilt from one iterable, which its constructor does not
    take, and every pooled call returning one failed as if the model had raised."""
    buffer = np.arange(6.0)
    own = Pair(np.ones(2), np.zeros(2))
    assert unalias(own, [buffer]) is own  # nothing shares the buffer: left as it is
    copied = unalias(Pair(buffer[:2], np.zeros(2)), [buffer])
    assert type(copied) is Pair and not np.shares_memory(copied.total, buffer)
    np.testing.assert_array_equal(copied.total, [0.0, 1.0])


def test_unalias_keeps_a_defaultdict_and_its_factory_when_it_copies():
    """The first fix rebuilt dicts as type(outputs)(items): a defaultdict takes a factory
    first, and every request of a model returning one failed."""
    buffer = np.arange(6.0)
    out = collections.defaultdict(list, {"emb": buffer[:2]})
    copied = unalias(out, [buffer])
    assert type(copied) is collections.defaultdict and copied.default_factory is list
    assert not np.shares_memory(copied["emb"], buffer)


def test_unalias_copies_a_masked_array_with_its_mask():
    """Was: copied as a plain array, the mask lost."""
    buffer = np.array([-1.0, 2.0, -3.0])
    masked = np.ma.array(buffer, mask=buffer < 0)
    copied = unalias(masked, [buffer])
    assert isinstance(copied, np.ma.MaskedArray) and not np.shares_memory(copied.data, buffer)
    assert copied.mask.tolist() == [True, False, True]


async def test_a_model_returning_a_namedtuple_is_answered_with_the_pool_on():
    def model(batch: np.ndarray) -> Pair:
        return Pair(batch.sum(axis=1), batch.max(axis=1))

    async with Batcher(model, BatchPolicy(max_batch_size=8, max_delay_s=0.01)) as batcher:
        results = await asyncio.gather(*(batcher.submit(np.arange(4.0) + i) for i in range(4)))
    assert [(float(r[0]), float(r[1])) for r in results] == [
        (6.0 + 4 * i, 3.0 + i) for i in range(4)
    ]


def test_unalias_sees_a_torch_view_of_a_numpy_buffer():
    torch = pytest.importorskip("torch")
    buffer = np.arange(8, dtype=np.float32)
    tensor = torch.from_numpy(buffer)[2:5]
    copied = unalias(tensor, [buffer])
    buffer[:] = -1
    assert copied.tolist() == [2.0, 3.0, 4.0]


# -- through a batcher ------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["loop", "thread"])
async def test_results_that_outlive_their_batch_keep_their_data(executor):
    """An identity model returns (a view of) the pooled input itself: each request's result
    must still hold its own values after many later batches reused the buffer."""
    batcher = Batcher(
        lambda batch: batch,
        BatchPolicy(max_batch_size=8, max_delay_s=0.001),
        buffer_pool=True,
        executor=executor,
    )
    await batcher.start()
    try:
        kept = []
        for k in range(40):
            values = [np.full((2, 3), 100 * k + i, np.int64) for i in range(k % 8 + 1)]
            results = await asyncio.gather(*(batcher.submit(v) for v in values))
            kept.append(results)
        for k, results in enumerate(kept):
            for i, result in enumerate(results):
                assert (result == 100 * k + i).all(), (k, i, result)
        stats = batcher.buffer_pool.stats()
        assert stats.hits > stats.misses  # the buffers were in fact reused
    finally:
        await batcher.stop()


async def test_packed_results_that_outlive_their_batch_keep_their_data():
    batcher = Batcher(
        lambda batch: batch,  # per-token outputs: the pooled Packed itself
        BatchPolicy(max_batch_size=8, max_delay_s=0.001),
        collate="packed",
        buffer_pool=True,
    )
    await batcher.start()
    try:
        kept = []
        for k in range(30):
            values = [np.full(i % 4 + 1, 10 * k + i, np.int32) for i in range(k % 6 + 1)]
            kept.append((values, await asyncio.gather(*(batcher.submit(v) for v in values))))
        for values, results in kept:
            for value, result in zip(values, results, strict=True):
                np.testing.assert_array_equal(result, value)
    finally:
        await batcher.stop()


async def test_results_match_with_the_pool_off():
    def model(batch: np.ndarray) -> np.ndarray:
        return batch.sum(axis=1)

    got = {}
    for on in (False, True):
        batcher = Batcher(model, BatchPolicy(max_batch_size=4, max_delay_s=0.001), buffer_pool=on)
        await batcher.start()
        try:
            got[on] = await asyncio.gather(
                *(batcher.submit(np.arange(i, i + 5, dtype=np.float64)) for i in range(20))
            )
        finally:
            await batcher.stop()
        assert (batcher.buffer_pool is not None) == on
    assert [float(x) for x in got[True]] == [float(x) for x in got[False]]


async def test_two_calls_in_flight_hold_two_buffers():
    """A threaded replica takes a second batch while the first computes: it must be
    collated into another buffer, not the one the model is reading."""
    gate = threading.Event()
    seen: list[np.ndarray] = []

    def model(batch: np.ndarray) -> np.ndarray:
        gate.wait(5)
        seen.append(batch.copy())
        return batch + 0

    batcher = Batcher(
        model, BatchPolicy(max_batch_size=2, max_delay_s=10.0), buffer_pool=True, executor="thread"
    )
    await batcher.start()
    try:
        tasks = [asyncio.ensure_future(batcher.submit(np.full(2, i))) for i in range(4)]
        await asyncio.sleep(0.05)
        gate.set()
        results = await asyncio.gather(*tasks)
    finally:
        await batcher.stop()
    assert [int(r[0]) for r in results] == [0, 1, 2, 3]
    assert sorted(int(b[0, 0]) for b in seen) == [0, 2]


def test_a_new_policy_moves_the_size_buckets_to_its_preferred_sizes():
    batcher = Batcher(lambda b: b, BatchPolicy(max_batch_size=8), buffer_pool=True)
    assert batcher.buffer_pool is not None and batcher.buffer_pool.bucket(3) == 4
    batcher.update_policy(preferred_batch_sizes=(3, 6))
    assert batcher.buffer_pool.bucket(3) == 3 and batcher.buffer_pool.bucket(5) == 6


def test_batched_takes_the_pool_options():
    @batched(buffer_pool=True, buffer_pool_mb=1)
    def model(batch: Any) -> Any:
        return batch

    assert model.batcher.buffer_pool is not None
    assert model.batcher.buffer_pool.budget_bytes == 2**20
    with pytest.raises(ConfigError, match="buffer_pool_mb"):
        batched(buffer_pool=True, buffer_pool_mb=0)(model)
    with pytest.raises(ConfigError, match="buffer_pool"):
        Batcher(lambda b: b, buffer_pool="on")  # type: ignore[arg-type]
