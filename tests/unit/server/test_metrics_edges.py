"""``GET /metrics`` against Prometheus conventions: names, labels, negotiation, methods."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from prometheus_client.openmetrics import parser as om_parser
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from carpool import Batcher, BatchPolicy
from carpool.core.clock import FakeClock
from carpool.core.telemetry import MemoryProbe
from carpool.errors import InvalidInput
from carpool.server.app import KServeApp
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec


def double(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": inputs["x"] * 2}


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


class Exchange:
    def __init__(self, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        self.scope = {"type": "http", "method": method, "path": path, "headers": headers}
        self.status: int | None = None
        self.headers: dict[bytes, bytes] = {}
        self.body = b""

    async def receive(self) -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = dict(message["headers"])
        else:
            self.body += message.get("body", b"")


async def _scrape(app: KServeApp, method: str = "GET", accept: bytes | None = None) -> Exchange:
    headers = [] if accept is None else [(b"accept", accept)]
    exchange = Exchange(method, "/metrics", headers)
    await app(exchange.scope, exchange.receive, exchange.send)
    return exchange


def _samples(body: bytes, name: str) -> list[Sample]:
    return [
        s
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.name == name
    ]


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


async def test_bucket_bounds_are_canonical_numbers() -> None:
    # OpenMetrics: "le" MUST be a canonical number ("1.0", not "1"); Prometheus 3 stores
    # it that way, so a series exposed as le="1" changes name on upgrade.
    body = (await _scrape(_app())).body
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if "le" in s.labels:
                le = s.labels["le"]
                assert le == floatToGoString(float(le)), (s.name, le)


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
