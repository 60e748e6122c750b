"""What carpool top draws (carpool.tools.top_view): frames rendered from snapshots at a
wide and a narrow width, read as text."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from rich.console import Console

from carpool.tools.top_view import ModelView, TopState, render, sorted_models


def batch_document(**changes: Any) -> dict[str, Any]:
    """A batch model's live document, as server/live.py writes it."""
    document: dict[str, Any] = {
        "kind": "batch", "uptime_s": 10.0, "num_completed": 40, "num_batches": 5,
        "num_items": 40, "batch_sizes": {"4": 2, "16": 2}, "max_batch_size": 16,
        "max_delay_s": 0.002, "fill_ratio": 0.6, "effective_compute_ratio": 0.9,
        "num_pending": 3, "num_refused_from_head": 0,
        "classes": [{
            "name": "interactive", "num_pending": 3, "num_completed": 40, "p50_s": 0.004,
            "p99_s": 0.2, "slo_s": 0.1, "slo_attainment": 0.95, "rejections": {"queue_full": 2},
        }],
        "replicas": [
            {"replica_id": 0, "device": "cpu", "busy_s": 5.0, "busy_fraction": 0.5},
            {"replica_id": 1, "device": "cpu", "busy_s": 2.5, "busy_fraction": 0.25},
        ],
        "replica_balance": 0.5,
        "memory": {"peak_bytes": 3 << 30, "trough_bytes": 1 << 30, "total_bytes": 8 << 30,
                   "volatility": 0.25},
        "slowest": {"class": "interactive", "total_s": 0.25, "queue_s": 0.1,
                    "fill_wait_s": 0.05, "replica_wait_s": 0.0, "compute_s": 0.1, "answer_s": 0.0,
                    "batch_size": 16, "replica_id": 1},
        "generation": None,
    }  # fmt: skip
    return document | changes


def generation_document() -> dict[str, Any]:
    return batch_document(
        kind="generation", classes=[], replicas=[], replica_balance=None, memory=None,
        slowest=None, fill_ratio=None, effective_compute_ratio=None, batch_sizes={"3": 9},
        generation={
            "num_running": 3, "num_waiting": 7, "kv_cache_usage": 0.42,
            "prefix_cache_hit_rate": 0.5, "num_generation_tokens": 900, "num_preemptions": 1,
            "ttft": {"p50_s": 0.02, "p99_s": 0.08}, "itl": {"p50_s": 0.005, "p99_s": 0.011},
        },
    )  # fmt: skip


def frame(state: TopState, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, height=60, color_system=None)
    console.print(render(state, width))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(text, str)
    return text


def state(**changes: Any) -> TopState:
    views = (
        ModelView("mlp", batch_document(), {"requests_per_s": 40.0, "mean_batch_size": 8.0,
                                             "busy:0": 0.75, "busy:1": 0.25, "balance": 1 / 3}),
        ModelView("llama", generation_document(), {"requests_per_s": 2.0, "running": 3.0,
                                                   "tokens_per_s": 90.0}),
    )  # fmt: skip
    return TopState("http://127.0.0.1:8000", models=views, **changes)


def test_shows_the_selected_model_s_batch_sizes_classes_replicas_and_slowest_request() -> None:
    text = frame(state(selected=1), width=160)  # sorted by name: llama, then mlp
    assert "mlp (batch)" in text
    assert "40.0" in text  # requests/s
    lines = [line for line in text.splitlines() if "████" in line]
    assert any(" 16 " in line for line in lines) and any(" 4 " in line for line in lines)
    assert "interactive" in text and "200.0ms" in text and "queue_full 2" in text
    assert "replica 0 (cpu)" in text and "75% busy" in text and "balance 0.33" in text
    assert "waiting for the batch to fill 50.0ms" in text and "compute 100.0ms" in text
    assert "answering 0.0ms" in text  # the parts add up to the total
    assert "volatility 25%" in text


def test_shows_a_generation_model_s_sequences_kv_cache_and_token_latencies() -> None:
    text = frame(state(selected=0), width=160)
    assert "llama (generation)" in text
    for expected in ("running sequences", "KV blocks in use", "42%", "80.0ms", "11.0ms"):
        assert expected in text
    # its steps' sizes, a bar a size: 9 steps of 3 sequences
    assert re.search(r"\s3\s+9\s+█", text)


@pytest.mark.parametrize("width", [40, 60])
def test_a_narrow_terminal_still_names_the_models(width: int) -> None:
    text = frame(state(selected=1), width=width)
    assert all(len(line) <= width for line in text.splitlines())
    assert "mlp" in text and "llama" in text


def test_says_reconnecting_and_keeps_the_last_figures_while_the_server_is_away() -> None:
    text = frame(state(error="connection refused"), width=120)
    assert "reconnecting..." in text and "mlp" in text


def test_a_policy_field_set_to_auto_reads_auto() -> None:
    auto = ModelView("auto", batch_document(max_delay_s="auto", max_batch_size="auto"), {})
    text = frame(TopState("http://x", models=(auto,)), width=120)
    assert "max batch auto, max delay auto" in text


def test_help_lists_the_keys() -> None:
    assert "s sort" in frame(state(show_help=True), width=120)
    assert "s sort" not in frame(state(), width=120)


def test_sorts_by_name_requests_and_p99() -> None:
    models = state().models
    assert [v.name for v in sorted_models(models, "name")] == ["llama", "mlp"]
    assert [v.name for v in sorted_models(models, "requests/s")] == ["mlp", "llama"]
    assert [v.name for v in sorted_models(models, "p99")] == ["mlp", "llama"]
