"""The batcher with variable-length items: packed and padded collation, token budgets,
length buckets and padding waste. Time is a FakeClock; the model is an async recorder."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from carpool import ConfigError, InvalidInput
from carpool.core.clock import FakeClock, settle
from carpool.core.layout import Packed, Padded


class LengthModel:
    """Records each batch's item lengths; returns per-item sums (rows) or doubled tokens."""

    def __init__(self, per_token: bool = False) -> None:
        self.per_token = per_token
        self.batches: list[list[int]] = []
        self.seen: list[Any] = []

    async def __call__(self, batch: Packed | Padded) -> Any:
        self.seen.append(batch)
        self.batches.append([int(n) for n in batch.lengths])
        if isinstance(batch, Padded):
            return (batch.data * batch.mask).sum(axis=1)
        if self.per_token:
            return Packed.from_lengths(batch.data * 2, batch.lengths)
        return np.add.reduceat(batch.data, batch.offsets) * (batch.lengths > 0)


def seq(n: int, start: int = 1) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


async def test_packed_model_gets_concatenated_items_and_each_caller_its_own_row(
    make_batcher, fake_clock: FakeClock, spawn
):
    model = LengthModel()
    batcher = make_batcher(model, collate="packed", max_batch_size=8, max_delay_s=0.01)
    tasks = [spawn(batcher.submit(seq(n))) for n in (3, 1, 5)]
    await settle()
    await fake_clock.advance(0.01)
    assert [t.result() for t in tasks] == [6, 1, 15]
    batch = model.seen[0]
    assert isinstance(batch, Packed)
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 9]  # no padding reached the model


async def test_per_token_outputs_go_back_by_length(make_batcher, fake_clock: FakeClock, spawn):
    model = LengthModel(per_token=True)
    batcher = make_batcher(model, collate="packed", max_batch_size=8, max_delay_s=0.01)
    one = spawn(batcher.submit(seq(2)))
    many = spawn(batcher.submit_many([seq(1, 5), seq(3, 7)]))
    await settle()
    await fake_clock.advance(0.01)
    assert one.result().tolist() == [2, 4]
    assert [part.tolist() for part in many.result()] == [[10], [14, 16, 18]]


async def test_max_batch_tokens_bounds_the_sum_of_lengths_when_packed(
    make_batcher, fake_clock: FakeClock, spawn
):
    model = LengthModel()
    batcher = make_batcher(
        model, collate="packed", max_batch_size=64, max_batch_tokens=10, max_delay_s=0.01
    )
    for n in (4, 4, 4, 1, 9):
        spawn(batcher.submit(seq(n)))
    await settle()
    await fake_clock.advance(0.01)
    await settle()
    assert model.batches == [[4, 4], [4, 1], [9]]
    assert all(sum(b) <= 10 for b in model.batches)


async def test_padded_cost_is_items_times_longest_so_one_long_item_rides_alone(
    make_batcher, fake_clock: FakeClock, spawn
):
    model = LengthModel()
    batcher = make_batcher(
        model, collate="padded", max_batch_size=64, max_batch_tokens=12, max_delay_s=0.01
    )
    for n in (2, 2, 2, 12, 3, 3):
        spawn(batcher.submit(seq(n)))
    await settle()
    await fake_clock.advance(0.01)
    await settle()
    # [2,2,2] costs 6; adding 12 would cost 48. [12] alone costs 12; [3,3] costs 6.
    assert model.batches == [[2, 2, 2], [12], [3, 3]]
    padded = model.seen[0]
    assert isinstance(padded, Padded)
    assert padded.data.shape == (3, 2)


async def test_request_that_can_never_fit_the_token_budget_is_refused(make_batcher):
    batcher = make_batcher(LengthModel(), collate="packed", max_batch_tokens=4)
    await batcher.start()
    with pytest.raises(InvalidInput, match="needs 5 tokens, more than max_batch_tokens=4"):
        await batcher.submit(seq(5))


async def test_max_batch_tokens_needs_a_variable_length_collator(make_batcher):
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        batcher = make_batcher(LengthModel(), collate="numpy", max_batch_tokens=4)
        await batcher.submit(np.zeros(3))


async def test_length_buckets_keep_short_and_long_items_apart(
    make_batcher, fake_clock: FakeClock, spawn
):
    model = LengthModel()
    batcher = make_batcher(
        model, collate="padded", max_batch_size=8, max_delay_s=0.01, length_buckets=(8,)
    )
    lengths = [3, 100, 5, 120, 2, 90]
    tasks = [spawn(batcher.submit(seq(n))) for n in lengths]
    await settle()
    await fake_clock.advance(0.01)
    await settle()
    assert model.batches == [[3, 5, 2], [100, 120, 90]]
    assert [t.result() for t in tasks] == [int(seq(n).sum()) for n in lengths]
    assert batcher.num_pending == 0


async def test_padding_waste_is_reported_for_padded_models_and_zero_when_packed(
    make_batcher, fake_clock: FakeClock, spawn
):
    padded = make_batcher(LengthModel(), name="padded", collate="padded", max_delay_s=0.01)
    packed = make_batcher(LengthModel(), name="packed", collate="packed", max_delay_s=0.01)
    for batcher in (padded, packed):
        for n in (5, 9, 2):  # "hello", "worldwide", "AI"
            spawn(batcher.submit(seq(n)))
    await settle()
    await fake_clock.advance(0.01)
    await settle()
    stats = padded.snapshot().batches
    assert (stats.num_tokens, stats.num_padded_slots) == (16, 11)
    assert stats.padding_waste == pytest.approx(11 / 27)
    stats = packed.snapshot().batches
    assert (stats.num_tokens, stats.num_padded_slots, stats.padding_waste) == (16, 0, 0.0)


async def test_auto_buckets_still_answer_every_request(make_batcher, fake_clock: FakeClock, spawn):
    model = LengthModel()
    batcher = make_batcher(
        model, collate="packed", max_batch_size=4, max_delay_s=0.01, length_buckets="auto"
    )
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.choice([4, 200], size=40)]
    tasks = [spawn(batcher.submit(seq(n))) for n in lengths]
    for _ in range(30):
        await settle()
        await fake_clock.advance(0.01)
    await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
    assert [t.result() for t in tasks] == [int(seq(n).sum()) for n in lengths]


async def test_auto_learns_batch_times_per_token_under_a_token_budget(
    make_batcher, fake_clock: FakeClock, spawn
):
    """The batch-time line of ``auto`` is fitted in the budget's unit: each batch of one
    100-token request computing for 11 ms gives 0.11 ms per token (per item it would
    be 11 ms, and a cap of so many items would not bound the time)."""
    gate = asyncio.Event()

    async def model(batch: Packed) -> Any:
        await gate.wait()
        return np.add.reduceat(batch.data, batch.offsets)

    batcher = make_batcher(
        model, collate="packed", max_batch_tokens=1000, max_delay_s="auto", slo_s=1.0
    )
    for _ in range(12):
        gate.clear()
        task = spawn(batcher.submit(seq(100)))
        await settle()
        await fake_clock.advance(0.001)  # the cold window: the batch starts
        await fake_clock.advance(0.011)  # and computes
        gate.set()
        await settle()
        assert task.done()
    state = batcher.adaptive_state()
    assert state is not None and state.unit == "tokens"
    assert state.per_item_s == pytest.approx(0.011 / 100, rel=0.1)


async def test_a_lone_client_of_long_and_short_texts_is_never_kept_waiting_under_tokens(
    make_batcher, fake_clock: FakeClock, spawn
):
    """Was: closed-loop returns were counted in tokens, so a short text sent right after a
    long one's answer read as most of the long one still on its way back, and under
    ``max_delay_s: auto`` it waited for that up to the return window (5 ms), where a
    client that sends one request at a time has nothing more coming."""
    started: list[float] = []
    gate = asyncio.Event()

    async def model(batch: Packed) -> Any:
        started.append(fake_clock.now())
        await gate.wait()
        return np.add.reduceat(batch.data, batch.offsets)

    batcher = make_batcher(
        model, collate="packed", max_batch_tokens=1000, max_delay_s="auto", slo_s=1.0
    )
    waits = []
    for i in range(40):
        gate.clear()
        sent = fake_clock.now()
        task = spawn(batcher.submit(seq((200, 20)[i % 2])))
        await settle()
        while len(started) <= i:  # waiting: time moves until it goes
            await fake_clock.advance(0.0005)
        waits.append(started[i] - sent)
        await fake_clock.advance(0.002 + 0.00005 * (200, 20)[i % 2])  # it computes
        gate.set()
        await settle()
        assert task.done()
        await fake_clock.advance(0.0003)  # the client sends its next text at once
    assert max(waits[12:]) == 0.0
