"""The dashboard's ring and its routes (carpool.server.dashboard), over a served model in
process: samples a second apart, a ring that keeps only the newest, the page and files."""

from __future__ import annotations

import itertools

import numpy as np
import orjson

from carpool.server.app import KServeApp
from carpool.server.dashboard import Dashboard, ModelRing
from carpool.server.repository import ModelRepository

from .apps import Exchange, served


def test_ring_keeps_only_the_newest_capacity_samples() -> None:
    ring = ModelRing("batch", capacity=3)
    for t in range(5):
        ring.append(float(t), {"requests_per_s": float(t * 10)})
    columns = ring.columns()
    assert columns["t"] == [2.0, 3.0, 4.0]
    assert columns["series"]["requests_per_s"] == [20.0, 30.0, 40.0]


def test_columns_fill_gaps_with_none_leave_out_empty_series_and_expand_patterns() -> None:
    ring = ModelRing("batch", capacity=10)
    ring.append(0.0, {"p99_s:fast": 0.01, "p99_s:idle": None})
    ring.append(1.0, {"p99_s:fast": 0.02, "p99_s:slow": 0.5, "p99_s:idle": None})
    columns = ring.columns()
    assert columns["series"]["p99_s:slow"] == [None, 0.5]
    assert "p99_s:idle" not in columns["series"]  # never had a value: no empty line
    latency = next(c for c in columns["charts"] if c["title"].startswith("latency"))
    assert latency["series"] == ["p99_s:fast", "p99_s:slow"]


async def test_ticks_a_second_apart_give_the_second_s_requests_and_batch_size() -> None:
    model = served()
    seconds = itertools.count(100.0)
    dashboard = Dashboard(ModelRepository([model]), clock=lambda: float(next(seconds)))
    await model.require_batcher().start()
    try:
        dashboard.tick()
        for _ in range(3):
            await model.run({"x": np.ones((2, 2), np.float32)}, {})
        dashboard.tick()
    finally:
        await model.require_batcher().stop()
    columns = dashboard.series()["models"]["m"]
    assert columns["t"] == [100.0, 101.0]
    assert columns["series"]["requests_per_s"] == [None, 3.0]
    assert columns["series"]["mean_batch_size"] == [None, 2.0]
    assert columns["series"]["slow_compute_s"][1] is not None


async def test_serves_the_page_its_files_and_the_series() -> None:
    model = served()
    app = KServeApp(ModelRepository([model]), dashboard=True)
    assert app.dashboard is not None
    app.dashboard.tick()
    page = await Exchange("GET", "/dashboard").run(app)
    assert page.status == 200 and b"/dashboard/uPlot.iife.min.js" in page.body
    script = await Exchange("GET", "/dashboard/uPlot.iife.min.js").run(app)
    assert script.status == 200 and script.headers[b"content-type"].startswith(b"text/javascript")
    series = orjson.loads((await Exchange("GET", "/dashboard/series").run(app)).body)
    assert list(series["models"]) == ["m"] and series["capacity"] == 300
    missing = await Exchange("GET", "/dashboard/../../etc/passwd").run(app)
    assert missing.status == 404


async def test_no_dashboard_is_a_404_that_says_why() -> None:
    app = KServeApp(ModelRepository([served()]))
    answer = await Exchange("GET", "/dashboard").run(app)
    assert answer.status == 404
    assert b"--no-dashboard" in answer.body


def test_the_adaptive_controller_and_memory_get_a_chart_per_unit() -> None:
    ring = ModelRing("batch", capacity=10)
    ring.append(0.0, {"adaptive_delay_s": 0.004, "adaptive_batch_size": 12,
                      "memory_peak_bytes": 3 << 30, "memory_volatility": 0.2})  # fmt: skip
    charts = {c["title"]: c["series"] for c in ring.columns()["charts"]}
    assert charts["adaptive controller: delay (s)"] == ["adaptive_delay_s"]
    assert charts["adaptive controller: batch size"] == ["adaptive_batch_size"]
    assert charts["memory peak (bytes)"] == ["memory_peak_bytes"]
    assert charts["memory volatility"] == ["memory_volatility"]
