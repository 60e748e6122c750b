"""Triton-style per-model statistics (``GET /v2/models/{m}/stats``) from telemetry."""

from __future__ import annotations

from typing import Any

from carpool.core.telemetry import LatencyStats
from carpool.server.repository import ServedModel


def _duration(count: int, stats: LatencyStats) -> dict[str, int]:
    total_s = stats.mean_s * stats.count if stats.count else 0.0
    return {"count": count, "ns": round(total_s * 1e9)}


def model_stats(model: ServedModel) -> dict[str, Any]:
    """Counts and cumulative nanoseconds in the shape ``tritonclient`` parses."""
    snap = model.batcher.snapshot()
    completed = sum(c.num_completed for c in snap.classes.values())
    failed = sum(c.num_failed + sum(c.rejections.values()) for c in snap.classes.values())
    queue_ns = sum(
        c.queue_wait.mean_s * c.queue_wait.count
        for c in snap.classes.values()
        if c.queue_wait.count
    )
    batches = snap.batches
    return {
        "name": model.name,
        "version": model.version,
        "inference_count": batches.num_items,
        "execution_count": batches.num_batches,
        "inference_stats": {
            "success": _duration(completed, snap.latency),
            "fail": {"count": failed, "ns": 0},
            "queue": {"count": completed, "ns": round(queue_ns * 1e9)},
            "compute_infer": _duration(batches.num_batches, batches.compute),
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_infer": {
                    "count": count,
                    "ns": round(batches.size_compute_s.get(size, 0.0) * 1e9),
                },
            }
            for size, count in batches.size_histogram.items()
        ],
    }
