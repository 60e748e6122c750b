"""``/metrics`` review: what a scrape costs the loop and how it negotiates its answer."""

from __future__ import annotations

import math

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from carpool import Batcher, BatchPolicy
from carpool.core.clock import FakeClock
from carpool.core.policy import ClassPolicy
from carpool.server.metrics import Metrics, batch_size_bounds
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec


def double(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": inputs["x"] * 2}


async def test_a_snapshot_without_quantiles_sorts_no_samples_for_the_merged_latency() -> None:
    # /metrics asks for quantiles=False so that a scrape does not sort the recent samples;
    # the all-classes latency sorted up to 3 x 8192 of them anyway, on every scrape.
    clock = FakeClock()
    batcher = Batcher(double, BatchPolicy(max_batch_size=4, max_delay_s=0.0), clock=clock)
    await batcher.start()
    try:
        for _ in range(3):
            await batcher.submit_many({"x": np.ones((1, 2), np.float32)})
    finally:
        await batcher.stop()
    cheap = batcher.snapshot(quantiles=False)
    assert cheap.latency.count == 3  # counts and sums are still there
    assert math.isnan(cheap.latency.p50_s) and math.isnan(cheap.latency.max_s)
    assert not math.isnan(batcher.snapshot().latency.p50_s)


def _bucket_counts(body: bytes, model: str) -> dict[str, float]:
    return {
        s.labels["le"]: s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.name == "carpool_batch_size_bucket" and s.labels["model"] == model
    }


async def test_full_batches_are_told_apart_when_the_max_is_not_a_power_of_two() -> None:
    # With buckets at powers of two only, a batch of 3 under max_batch_size=3 and one of
    # 4 would fall in the same le="4.0": whether batches filled could not be read.
    policy = BatchPolicy(max_batch_size=3, max_delay_s=0.0)
    batcher = Batcher(double, policy, collate="dict", clock=FakeClock())
    spec = (TensorSpec("x", "FP32", (2,)),)
    served = ServedModel("m", "1", "python", spec, (TensorSpec("y", "FP32", (2,)),), batcher)
    metrics = Metrics(ModelRepository([served]))
    await batcher.start()
    try:
        await batcher.submit_many({"x": np.ones((3, 2), np.float32)})
        await batcher.submit_many({"x": np.ones((1, 2), np.float32)})
    finally:
        await batcher.stop()
    buckets = _bucket_counts(metrics.render()[0], "m")
    assert buckets["1.0"] == 1 and buckets["2.0"] == 1  # the batch of 1 (max - 1 = 2)
    assert buckets["3.0"] == 2 == buckets["+Inf"]  # full batches: le=3 minus le=2


def test_batch_size_buckets_cover_every_max_and_preferred_size() -> None:
    policy = BatchPolicy(
        max_batch_size=3000,
        preferred_batch_sizes=(24,),
        classes=(ClassPolicy("interactive", max_batch_size=48), ClassPolicy("normal")),
        default_class="normal",
    )
    bounds = batch_size_bounds(policy)
    assert bounds[0] == 1 and list(bounds) == sorted(set(bounds))
    assert {24, 47, 48, 2048, 2999, 3000, 4096} <= set(bounds)
    assert bounds[-1] == 4096  # powers of two stop at the first one past the largest max


async def test_a_live_policy_change_adds_batch_size_buckets_and_removes_none() -> None:
    # The buckets followed the policy in force at each scrape: a tune trial's max of 5
    # dropped le="3.0" and le="2.0", so a rate() over a window spanning the change read
    # buckets that vanished mid-window.
    batcher = Batcher(double, BatchPolicy(max_batch_size=3, max_delay_s=0.0), collate="dict")
    spec = (TensorSpec("x", "FP32", (2,)),)
    served = ServedModel("m", "1", "python", spec, (TensorSpec("y", "FP32", (2,)),), batcher)
    metrics = Metrics(ModelRepository([served]))
    await batcher.start()
    try:
        await batcher.submit_many({"x": np.ones((3, 2), np.float32)})
        before = _bucket_counts(metrics.render()[0], "m")
        batcher.update_policy(max_batch_size=5)
        after = _bucket_counts(metrics.render()[0], "m")
    finally:
        await batcher.stop()
    assert {"2.0", "3.0"} <= set(before)
    assert set(before) | {"5.0"} <= set(after)  # the new max is a bucket too
    assert all(after[le] == count for le, count in before.items())
