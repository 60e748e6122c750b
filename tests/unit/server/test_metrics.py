"""``/metrics`` read with prometheus_client's parser: Prometheus conventions (names,
labels, negotiation, methods), the batch-size buckets, and a replica given up."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from prometheus_client.openmetrics import parser as om_parser
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from carpool import Batcher, BatchPolicy, BatchTimeout
from carpool.core.clock import FakeClock
from carpool.core.policy import ClassPolicy
from carpool.core.telemetry import MemoryProbe
from carpool.errors import InvalidInput
from carpool.server.app import KServeApp
from carpool.server.metrics import Metrics, batch_size_bounds
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec

from .apps import Exchange, double
from .http.fakes import until

SAFETY_S = 5.0


def _served(
    name: str, batcher_name: str | None = None, memory_probe: MemoryProbe | None = None
) -> ServedModel:
    model = Batcher(
        double,
        BatchPolicy(max_batch_size=8, max_delay_s=0.0, max_queue_size=1),
        collate="dict",
        clock=FakeClock(),
        name=batcher_name,
        memory_probe=memory_probe,
    )
    spec = (TensorSpec("x", "FP32", (2,)),)
    return ServedModel(name, "1", "python", spec, (TensorSpec("y", "FP32", (2,)),), model)


def _app(*models: ServedModel) -> KServeApp:
    return KServeApp(ModelRepository(list(models or [_served("m", "m")])))


async def _scrape(app: KServeApp, method: str = "GET", accept: bytes | None = None) -> Exchange:
    headers = [] if accept is None else [(b"accept", accept)]
    exchange = Exchange(method, "/metrics", headers=headers)
    await app(exchange.scope, exchange.receive, exchange.send)
    return exchange


def _samples(body: bytes, name: str) -> list[Sample]:
    return [
        s
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.name == name
    ]


def _metrics(batcher: Batcher, name: str = "m") -> Metrics:
    """The metrics of a server whose one model, ``name``, ``batcher`` runs."""
    spec = (TensorSpec("x", "FP32", (2,)),)
    served = ServedModel(name, "1", "python", spec, (TensorSpec("y", "FP32", (2,)),), batcher)
    return Metrics(ModelRepository([served]))


def _value(metrics: Metrics, name: str, model: str) -> float:
    body, _ = metrics.render()
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model") == model:
                return sample.value
    raise AssertionError(f"no sample {name}{{model={model!r}}} in:\n{body.decode()}")


def _bucket_counts(body: bytes, model: str) -> dict[str, float]:
    return {
        s.labels["le"]: s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.name == "carpool_batch_size_bucket" and s.labels["model"] == model
    }


# -- names and labels ------------------------------------------------------------------------


async def test_model_label_is_the_served_name_not_the_batchers() -> None:
    # The batcher takes its name from the function ("double"); KServe calls it "m".
    app = _app(_served("m"))
    body = (await _scrape(app)).body
    models = {s.labels["model"] for s in _samples(body, "carpool_requests_total")}
    assert models == {"m"}


async def test_two_models_never_share_a_series() -> None:
    app = _app(_served("a"), _served("b"))  # both batchers are named "double"
    body = (await _scrape(app)).body
    batches = _samples(body, "carpool_batches_total")
    assert sorted(s.labels["model"] for s in batches) == ["a", "b"]


async def test_every_rejection_reason_is_exported_from_zero() -> None:
    # A series that first appears at 1 is invisible to rate()/increase().
    body = (await _scrape(_app())).body
    rejected = _samples(body, "carpool_rejections_total")
    normal = {s.labels["reason"]: s.value for s in rejected if s.labels["class"] == "normal"}
    assert normal == dict.fromkeys(["cancelled", "closed", "deadline", "invalid", "queue_full"], 0)


async def test_a_rejection_counts_under_its_reason() -> None:
    app = _app()
    await app.repository.start()
    try:
        batcher = app.repository.get("m").batcher
        with pytest.raises(InvalidInput):
            await batcher.submit_many({"x": np.ones((1, 2), np.float32)}, priority="nope")
        body = (await _scrape(app)).body
    finally:
        await app.repository.stop()
    rejected = {
        (s.labels["class"], s.labels["reason"]): s.value
        for s in _samples(body, "carpool_rejections_total")
    }
    assert rejected[("normal", "invalid")] == 1
    assert rejected[("normal", "queue_full")] == 0


async def test_memory_series_come_from_the_models_probe_after_each_batch() -> None:
    samples = iter([(300, 1000), (700, 1000), (500, 1000)])
    app = _app(_served("probed", memory_probe=lambda: next(samples)), _served("plain"))
    await app.repository.start()
    try:
        for model in ("probed", "plain"):
            batcher = app.repository.get(model).batcher
            for _ in range(3):  # max_delay_s 0: one batch each
                await batcher.submit_many({"x": np.ones((1, 2), np.float32)})
        body = (await _scrape(app)).body
    finally:
        await app.repository.stop()
    values = {
        name: {s.labels["model"]: s.value for s in _samples(body, name)}
        for name in (
            "carpool_memory_volatility",
            "carpool_memory_peak_bytes",
            "carpool_memory_total_bytes",
        )
    }
    assert values == {  # a model with no probe has no memory series at all
        "carpool_memory_volatility": {"probed": pytest.approx(0.4)},
        "carpool_memory_peak_bytes": {"probed": 700},
        "carpool_memory_total_bytes": {"probed": 1000},
    }


async def test_a_replica_given_up_after_a_hang_is_counted_and_its_stuck_thread_shown() -> None:
    clock = FakeClock()
    entered, release = threading.Event(), threading.Event()

    def hangs(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        entered.set()
        release.wait(SAFETY_S)
        return {"y": inputs["x"]}

    policy = BatchPolicy(max_batch_size=1, max_delay_s=0.0, batch_timeout_s=1.0)
    batcher = Batcher(hangs, policy, collate="dict", clock=clock, executor="thread")
    metrics = _metrics(batcher, "hung")
    await batcher.start()
    try:
        assert _value(metrics, "carpool_replicas_abandoned_total", "hung") == 0
        assert _value(metrics, "carpool_replica_threads_stuck", "hung") == 0
        task = asyncio.ensure_future(batcher.submit_many({"x": np.ones((1, 2), np.float32)}))
        await asyncio.wait_for(asyncio.to_thread(entered.wait, SAFETY_S), SAFETY_S)

        await clock.advance(1.0)

        assert isinstance((await asyncio.gather(task, return_exceptions=True))[0], BatchTimeout)
        assert _value(metrics, "carpool_replicas_abandoned_total", "hung") == 1
        assert _value(metrics, "carpool_replica_threads_stuck", "hung") == 1
        release.set()  # the stuck call returns: its thread ends
        await until(lambda: _value(metrics, "carpool_replica_threads_stuck", "hung") == 0)
        assert _value(metrics, "carpool_replicas_abandoned_total", "hung") == 1
    finally:
        release.set()
        await batcher.stop()


# -- batch-size buckets ----------------------------------------------------------------------


async def test_bucket_bounds_are_canonical_numbers() -> None:
    # OpenMetrics: "le" MUST be a canonical number ("1.0", not "1"); Prometheus 3 stores
    # it that way, so a series exposed as le="1" changes name on upgrade.
    body = (await _scrape(_app())).body
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if "le" in s.labels:
                le = s.labels["le"]
                assert le == floatToGoString(float(le)), (s.name, le)


async def test_full_batches_are_told_apart_when_the_max_is_not_a_power_of_two() -> None:
    # With buckets at powers of two only, a batch of 3 under max_batch_size=3 and one of
    # 4 would fall in the same le="4.0": whether batches filled could not be read.
    policy = BatchPolicy(max_batch_size=3, max_delay_s=0.0)
    batcher = Batcher(double, policy, collate="dict", clock=FakeClock())
    metrics = _metrics(batcher)
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
    metrics = _metrics(batcher)
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


# -- negotiation and methods -----------------------------------------------------------------


async def test_plain_scrape_is_text_format_0_0_4() -> None:
    exchange = await _scrape(_app())
    assert exchange.status == 200
    assert exchange.headers[b"content-type"] == b"text/plain; version=0.0.4; charset=utf-8"
    assert not exchange.body.endswith(b"# EOF\n")


async def test_openmetrics_is_served_when_the_scraper_asks_for_it() -> None:
    accept = (
        b"application/openmetrics-text;version=1.0.0;q=0.5,"
        b"application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,"
        b"*/*;q=0.2"
    )  # what Prometheus sends
    exchange = await _scrape(_app(), accept=accept)
    assert exchange.status == 200
    assert exchange.headers[b"content-type"].startswith(b"application/openmetrics-text")
    assert exchange.body.endswith(b"# EOF\n")
    families = {f.name: f for f in om_parser.text_string_to_metric_families(exchange.body.decode())}
    assert families["carpool_requests"].type == "counter"
    assert families["carpool_batch_size"].type == "histogram"


async def test_head_is_answered_like_get() -> None:
    exchange = await _scrape(_app(), method="HEAD")
    assert exchange.status == 200
    assert exchange.headers[b"content-type"].startswith(b"text/plain")


async def test_other_methods_are_a_405() -> None:
    exchange = await _scrape(_app(), method="POST")
    assert exchange.status == 405
    assert exchange.headers[b"allow"] == b"GET"
