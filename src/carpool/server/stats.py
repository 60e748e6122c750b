"""Triton-style per-model statistics (``GET /v2/models/{m}/stats``) from telemetry."""

from __future__ import annotations

from typing import Any

from carpool.core.telemetry import LatencyStats
from carpool.server.repository import ServedModel


def _duration(count: int, stats: LatencyStats) -> dict[str, int]:
    total_s = stats.mean_s * stats.count if stats.count else 0.0
    return {"count": count, "ns": round(total_s * 1e9)}


def model_stats(model: ServedModel) -> dict[str, Any]:
    """Counts and cumulative nanoseconds in the shape ``tritonclient`` parses (Triton's
    statistics extension). ``inference_count`` and ``execution_count`` count what
    succeeded. As in Triton, ``queue`` and the ``compute_*`` durations are per successful
    request (count: the successful requests; ns: each one's model call, summed), and
    ``batch_stats`` are the executions ``execution_count`` counts, by size. carpool times
    a call's input and output handling inside ``compute_infer``, so ``compute_input`` and
    ``compute_output`` carry the counts with 0 ns (not measured apart). carpool has no
    response cache: ``cache_hit`` and ``cache_miss``, which Triton always writes, are
    zero."""
    snap = model.batcher.snapshot()
    completed = sum(c.num_completed for c in snap.classes.values())
    failed = sum(c.num_failed + sum(c.rejections.values()) for c in snap.classes.values())
    queue_ns = sum(
        c.queue_wait.mean_s * c.queue_wait.count
        for c in snap.classes.values()
        if c.queue_wait.count
    )
    batches = snap.batches
    last = batches.last_completed_unix_s
    return {
        "name": model.name,
        "version": model.version,
        "last_inference": 0 if last is None else int(last * 1e3),  # ms since the epoch
        "inference_count": batches.num_completed_items,
        "execution_count": batches.num_completed_batches,
        "inference_stats": {
            "success": _duration(completed, snap.latency),
            "fail": {"count": failed, "ns": 0},
            "queue": {"count": completed, "ns": round(queue_ns * 1e9)},
            "compute_input": {"count": completed, "ns": 0},
            "compute_infer": {"count": completed, "ns": round(batches.completed_compute_s * 1e9)},
            "compute_output": {"count": completed, "ns": 0},
            "cache_hit": {"count": 0, "ns": 0},
            "cache_miss": {"count": 0, "ns": 0},
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": {"count": count, "ns": 0},
                "compute_infer": {
                    "count": count,
                    "ns": round(batches.completed_size_compute_s.get(size, 0.0) * 1e9),
                },
                "compute_output": {"count": count, "ns": 0},
            }
            for size, count in batches.completed_size_histogram.items()
        ],
    }
