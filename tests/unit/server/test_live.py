"""A model's live document (carpool.server.live), read after real requests, and carried
by the stats endpoint under ``"carpool"``."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from carpool import Batcher, BatchPolicy
from carpool.server.live import live_figures
from carpool.server.repository import ServedModel

from .apps import Exchange, double, served, started_app
from .test_completions import MODEL, tiny_generation_app


async def test_counts_classes_replicas_and_the_slowest_request_s_breakdown() -> None:
    model = served()
    async with started_app(model):
        for rows in (1, 3):
            await model.run({"x": np.ones((rows, 2), np.float32)}, {})
        document = live_figures(model)
    assert (document["kind"], document["num_completed"], document["num_items"]) == ("batch", 2, 4)
    assert document["batch_sizes"] == {"1": 1, "3": 1}
    assert document["max_batch_size"] == 8
    used = [c for c in document["classes"] if c["num_completed"]]
    assert [c["num_completed"] for c in used] == [2]
    assert used[0]["p99_s"] > 0 and used[0]["num_pending"] == 0
    assert [r["replica_id"] for r in document["replicas"]] == [0]
    slow = document["slowest"]
    parts = ("queue_s", "fill_wait_s", "replica_wait_s", "compute_s", "answer_s")
    assert sum(slow[part] for part in parts) == pytest.approx(slow["total_s"], abs=1e-9)
    assert document["generation"] is None


async def test_stats_endpoint_carries_it_beside_triton_s_figures() -> None:
    model = served()
    async with started_app(model) as app:
        await model.run({"x": np.ones((2, 2), np.float32)}, {})
        answer = await Exchange("GET", "/v2/models/m/stats").run(app)
    (stats,) = orjson.loads(answer.body)["model_stats"]
    assert stats["inference_count"] == 2
    assert stats["carpool"]["num_items"] == 2


async def test_a_generation_model_shows_its_sequences_kv_cache_and_token_latencies() -> None:
    async with tiny_generation_app() as app:
        body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        answer = await Exchange("POST", "/v1/completions", body).run(app)
        assert answer.status == 200
        (model,) = list(app.repository)
        document = live_figures(model)
    assert (document["kind"], document["num_completed"]) == ("generation", 1)
    g = document["generation"]
    assert (g["num_running"], g["num_waiting"]) == (0, 0)
    assert g["num_generation_tokens"] == 4
    assert g["ttft"]["p50_s"] > 0 and g["itl"]["p99_s"] > 0
    assert document["classes"] == [] and document["slowest"] is None
    assert document["adaptive"] is None


async def test_an_auto_policy_shows_what_the_adaptive_controller_has_in_force() -> None:
    fixed = served()
    auto = ServedModel(
        "auto", "1", "python", fixed.inputs, fixed.outputs,
        Batcher(double, BatchPolicy(max_batch_size=8, max_delay_s="auto"), collate="dict"),
    )  # fmt: skip
    async with started_app(fixed, auto):
        await auto.run({"x": np.ones((2, 2), np.float32)}, {})
        adaptive, none = live_figures(auto)["adaptive"], live_figures(fixed)["adaptive"]
    assert none is None
    assert adaptive is not None and adaptive.keys() == {"delay_s", "batch_size", "unit"}
    assert adaptive["unit"] == "items"
    assert adaptive["delay_s"] >= 0 and 1 <= adaptive["batch_size"] <= 8
