"""What a model is doing now, as one JSON-ready document: ``carpool top`` and the dashboard
read it (``GET /v2/models/stats`` carries it under each model's ``"carpool"`` key).

Counters are cumulative since the model started (a reader differences two documents for a
rate); gauges (queue depth, running sequences, KV-cache use) are the moment's; percentiles
are over each histogram's recent samples; ratios are since start. A figure a model does
not have is ``None``: a batch model has no ``generation``, a generation model no classes
or replicas, a model without "auto" in its policy no ``adaptive``. Seconds are floats,
``NaN`` written as ``None``.
"""

from __future__ import annotations

import math
from typing import Any

from carpool.core.adaptive import AdaptiveState
from carpool.core.request import RequestTrace
from carpool.core.telemetry import LatencyStats, TelemetrySnapshot
from carpool.generation.telemetry import GenerationSnapshot
from carpool.server.repository import ServedModel


def live_figures(model: ServedModel) -> dict[str, Any]:
    """``model``'s live document (see the module's docstring)."""
    if model.generation is not None:
        return _generation(model.generation.engine.snapshot())
    batcher = model.require_batcher()
    policy = batcher.policy
    document = _batching(batcher.snapshot(), policy.max_batch_size, policy.max_delay_s)
    document["adaptive"] = _adaptive(batcher.adaptive_state())
    return document


def _adaptive(state: AdaptiveState | None) -> dict[str, float | str] | None:
    """What the adaptive controller has in force now (the largest over the classes, as
    ``carpool top`` shows it); None when the policy has no "auto"."""
    if state is None or not state.classes:
        return None
    return {
        "delay_s": max(c.delay_s for c in state.classes),
        "batch_size": max(c.batch_size for c in state.classes),
        "unit": state.unit,  # what batch_size counts: items, or tokens/cost under a budget
    }


def _seconds(value: float) -> float | None:
    return None if math.isnan(value) else value


def _percentiles(stats: LatencyStats) -> dict[str, float | None]:
    return {"p50_s": _seconds(stats.p50_s), "p99_s": _seconds(stats.p99_s)}


def _batching(
    snap: TelemetrySnapshot, max_batch_size: int | str, max_delay_s: float | str
) -> dict[str, Any]:
    # Either may be "auto" (carpool.core.adaptive): shown as set.
    b = snap.batches
    classes = [
        {
            "name": c.name,
            "num_pending": c.num_pending,
            "num_completed": c.num_completed,
            **_percentiles(c.latency),
            "slo_s": c.slo_s,
            "slo_attainment": c.slo_attainment,
            "rejections": dict(sorted(c.rejections.items())),
        }
        for c in snap.classes.values()
    ]
    memory = snap.memory
    return {
        "kind": "batch",
        "uptime_s": snap.uptime_s,
        "num_completed": sum(c.num_completed for c in snap.classes.values()),
        "num_batches": b.num_batches,
        "num_items": b.num_items,
        "batch_sizes": {str(size): n for size, n in b.size_histogram.items()},
        "max_batch_size": max_batch_size,
        "max_delay_s": max_delay_s,
        "fill_ratio": b.fill_ratio,
        "effective_compute_ratio": b.effective_compute_ratio,
        "num_pending": snap.num_pending,
        "num_refused_from_head": snap.num_refused_from_head,
        "classes": classes,
        "replicas": [
            {
                "replica_id": r.replica_id,
                "device": r.device,
                "busy_s": r.busy_s,
                "busy_fraction": r.busy_fraction,
            }
            for r in snap.replicas
        ],
        "replica_balance": snap.replica_balance,
        "memory": None
        if memory is None
        else {
            "peak_bytes": memory.peak_bytes,
            "trough_bytes": memory.trough_bytes,
            "total_bytes": memory.total_bytes,
            "volatility": memory.volatility,
        },
        "slowest": None if snap.slowest is None else _breakdown(snap.slowest),
        "generation": None,
    }


def _breakdown(trace: RequestTrace) -> dict[str, Any]:
    """Where a request's time went: queued behind busy replicas, held while its batch
    filled, behind its replica's previous batch, computing, and being answered."""
    return {
        "class": trace.class_name,
        "total_s": trace.total_s,
        "queue_s": trace.queue_s,
        "fill_wait_s": trace.fill_wait_s,
        "replica_wait_s": trace.replica_wait_s,
        "compute_s": _seconds(trace.compute_s),
        "answer_s": _seconds(trace.answer_s),
        "batch_size": trace.batch_size,
        "replica_id": trace.replica_id,
    }


def _generation(snap: GenerationSnapshot) -> dict[str, Any]:
    s = snap.scheduler
    queries = s.num_prefix_cache_queries
    return {
        "kind": "generation",
        "uptime_s": None,
        "num_completed": snap.succeeded.count,
        "num_batches": snap.num_steps,
        "num_items": sum(size * t.count for size, t in snap.steps_by_size.items()),
        "batch_sizes": {str(size): t.count for size, t in sorted(snap.steps_by_size.items())},
        "max_batch_size": None,
        "max_delay_s": None,
        "fill_ratio": None,
        "effective_compute_ratio": None,
        "num_pending": s.num_waiting,
        "num_refused_from_head": 0,
        "classes": [],
        "replicas": [],
        "replica_balance": None,
        "memory": None,
        "slowest": None,
        "adaptive": None,
        "generation": {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_cache_usage": s.kv_cache_usage,
            "prefix_cache_hit_rate": s.num_prefix_cache_hits / queries if queries else None,
            "num_generation_tokens": snap.num_generation_tokens,
            "num_preemptions": s.num_preemptions,
            "ttft": _percentiles(snap.time_to_first_token),
            "itl": _percentiles(snap.inter_token_latency),
        },
    }
