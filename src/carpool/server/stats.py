"""Triton-style per-model statistics (``GET /v2/models/{m}/stats``) from telemetry."""

from __future__ import annotations

from typing import Any

from carpool.core.telemetry import LatencyStats
from carpool.generation.engine import GenerationEngine
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
    zero. A generation model reports its engine's requests instead (see
    :func:`_generation_stats`)."""
    if model.generation is not None:
        return _generation_stats(model, model.generation.engine)
    snap = model.require_batcher().snapshot()
    completed = sum(c.num_completed for c in snap.classes.values())
    failed = sum(c.num_failed + sum(c.rejections.values()) for c in snap.classes.values())
    batches = snap.batches
    return _document(
        model,
        batches.last_completed_unix_s,
        inference_count=batches.num_completed_items,
        execution_count=batches.num_completed_batches,
        success=_duration(completed, snap.latency),
        fail=(failed, 0),
        queue_ns=round(batches.completed_queue_s * 1e9),
        compute_infer_ns=round(batches.completed_compute_s * 1e9),
        batch_stats=[
            (size, count, round(batches.completed_size_compute_s.get(size, 0.0) * 1e9))
            for size, count in batches.completed_size_histogram.items()
        ],
    )


def _document(
    model: ServedModel,
    last_unix_s: float | None,
    *,
    inference_count: int,
    execution_count: int,
    success: dict[str, int],
    fail: tuple[int, int],
    queue_ns: int,
    compute_infer_ns: int,
    batch_stats: list[tuple[int, int, int]],
) -> dict[str, Any]:
    """Triton's statistics document for ``model``: ``queue`` and the ``compute_*``
    durations count the successful requests (``success``'s count); ``fail`` is (count,
    ns); ``batch_stats`` are (size, executions, compute ns). Input and output handling
    are timed inside ``compute_infer`` (0 ns apart); there is no response cache."""
    ok = success["count"]
    return {
        "name": model.name,
        "version": model.version,
        # ms since the epoch
        "last_inference": 0 if last_unix_s is None else int(last_unix_s * 1e3),
        "inference_count": inference_count,
        "execution_count": execution_count,
        "inference_stats": {
            "success": success,
            "fail": {"count": fail[0], "ns": fail[1]},
            "queue": {"count": ok, "ns": queue_ns},
            "compute_input": {"count": ok, "ns": 0},
            "compute_infer": {"count": ok, "ns": compute_infer_ns},
            "compute_output": {"count": ok, "ns": 0},
            "cache_hit": {"count": 0, "ns": 0},
            "cache_miss": {"count": 0, "ns": 0},
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": {"count": count, "ns": 0},
                "compute_infer": {"count": count, "ns": ns},
                "compute_output": {"count": count, "ns": 0},
            }
            for size, count, ns in batch_stats
        ],
    }


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _generation_stats(model: ServedModel, engine: GenerationEngine) -> dict[str, Any]:
    """A generation model's statistics from its engine (it has no batcher). A request is
    one sequence the engine generated (a KServe row, an OpenAI completion); as Triton's
    vLLM backend counts them, ``inference_count`` is the successful ones. ``success``:
    those that ended by ``stop`` or ``length``, ns from arrival at the engine to the last
    token; ``fail``: those that ended by ``abort`` (the client left, or the server stopped
    without draining) or ``error``, with their ns. ``queue``: each successful one's
    arrival to its first step; ``compute_infer``: the rest, its first step to its end
    (vLLM's ``request_inference_time``, waits after a preemption included).
    ``execution_count`` and ``batch_stats`` are the engine's forward passes (steps), by
    the sequences each ran, with their compute time."""
    snap = engine.snapshot(quantiles=False)
    ok, failed = snap.succeeded, snap.failed
    return _document(
        model,
        snap.last_succeeded_unix_s,
        inference_count=ok.count,
        execution_count=snap.num_steps,
        success={"count": ok.count, "ns": _ns(ok.e2e_s)},
        fail=(failed.count, _ns(failed.e2e_s)),
        queue_ns=_ns(ok.queue_s),
        compute_infer_ns=_ns(ok.e2e_s - ok.queue_s),
        batch_stats=[
            (size, steps.count, _ns(steps.compute_s))
            for size, steps in sorted(snap.steps_by_size.items())
        ],
    )
