"""One second of one model from two live documents (carpool.server.dashboard_samples)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from carpool.server.dashboard_samples import sample


def _document() -> dict[str, Any]:
    return {
        "kind": "batch", "num_completed": 100, "num_batches": 10, "num_items": 100,
        "max_batch_size": 16, "fill_ratio": 0.5, "effective_compute_ratio": 0.8,
        "num_refused_from_head": 1,
        "classes": [{"name": "a", "num_pending": 4, "p50_s": 0.01, "p99_s": 0.05,
                     "rejections": {"queue_full": 2}}],
        "replicas": [{"replica_id": 0, "busy_s": 1.0, "busy_fraction": 0.1},
                     {"replica_id": 1, "busy_s": 1.0, "busy_fraction": 0.1}],
        "slowest": {"queue_s": 0.01, "replica_wait_s": 0.002, "fill_wait_s": 0.003,
                    "compute_s": 0.02, "answer_s": 0.004},
        "adaptive": {"delay_s": 0.003, "batch_size": 6},
        "memory": None, "generation": None,
    }  # fmt: skip


def test_rates_over_the_interval_and_the_moment_s_gauges() -> None:
    before = _document()
    now = copy.deepcopy(before)
    now["num_completed"], now["num_batches"], now["num_items"] = 140, 15, 140
    now["classes"][0]["rejections"]["queue_full"] = 6
    now["replicas"][0]["busy_s"], now["replicas"][1]["busy_s"] = 2.0, 1.5
    got = sample(now, before, 2.0)
    assert got["requests_per_s"] == 20.0
    assert got["mean_batch_size"] == 8.0
    assert got["rejections_per_s"] == 2.0
    assert (got["busy:0"], got["busy:1"]) == (0.5, 0.25)
    assert got["balance"] == 0.5
    assert got["queue:a"] == 4 and got["p99_s:a"] == 0.05
    assert got["slow_queue_s"] == pytest.approx(0.012)
    assert (got["slow_fill_s"], got["slow_compute_s"]) == (0.003, 0.02)
    assert got["slow_answer_s"] == 0.004
    assert (got["adaptive_delay_s"], got["adaptive_batch_size"]) == (0.003, 6)


def test_without_a_previous_document_rates_are_none_and_busy_is_since_start() -> None:
    got = sample(_document(), None, 0.0)
    assert got["requests_per_s"] is None and got["mean_batch_size"] is None
    assert got["busy:0"] == 0.1


def test_a_generation_model_gives_sequences_and_tokens_per_second() -> None:
    generation = {
        "num_running": 2, "num_waiting": 5, "kv_cache_usage": 0.3,
        "prefix_cache_hit_rate": None, "num_generation_tokens": 50,
        "ttft": {"p50_s": 0.01, "p99_s": 0.02}, "itl": {"p50_s": 0.001, "p99_s": 0.003},
    }  # fmt: skip
    before = {"kind": "generation", "num_completed": 1, "num_batches": 10, "num_items": 20,
              "generation": generation}  # fmt: skip
    now = {
        "kind": "generation",
        "num_completed": 3,
        "num_batches": 14,
        "num_items": 32,  # 4 steps of 3 sequences
        "generation": generation | {"num_generation_tokens": 150},
    }
    got = sample(now, before, 1.0)
    assert (got["running"], got["waiting"], got["tokens_per_s"]) == (2, 5, 100.0)
    assert got["requests_per_s"] == 2.0 and got["itl_p99_s"] == 0.003
    assert got["mean_batch_size"] == 3.0
    assert (got["ttft_p50_s"], got["itl_p50_s"]) == (0.01, 0.001)
