"""One second of one model, from two of its live documents (server/live.py): the rates
between them and the gauges of the later one. The dashboard's ring holds these; ``carpool
top`` computes the same from the documents it fetches. Pure functions of the documents.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# One second of one model: series name -> value (None when the model has no such figure).
Sample = dict[str, float | None]


def _rate(
    now: Mapping[str, Any], before: Mapping[str, Any] | None, key: str, dt_s: float
) -> float | None:
    if before is None or dt_s <= 0:
        return None
    return max(0.0, float(now[key] - before[key]) / dt_s)


def sample(now: Mapping[str, Any], before: Mapping[str, Any] | None, dt_s: float) -> Sample:
    """One second of a model: rates between ``before`` and ``now`` (two live documents
    ``dt_s`` apart; None when there is no ``before``) and the gauges of ``now``."""
    out: Sample = {"requests_per_s": _rate(now, before, "num_completed", dt_s)}
    # A generation model's batches are its engine's steps, its items their sequences.
    batches = None if before is None else now["num_batches"] - before["num_batches"]
    items = None if before is None else now["num_items"] - before["num_items"]
    out["mean_batch_size"] = items / batches if batches and items is not None else None
    if now["kind"] == "generation":
        g = now["generation"]
        return out | _generation(g, None if before is None else before["generation"], dt_s)
    limit = now["max_batch_size"]  # "auto" under adaptive batching: no line to draw
    out["max_batch_size"] = limit if isinstance(limit, int | float) else None
    out["fill_ratio"] = now["fill_ratio"]
    out["effective_compute_ratio"] = now["effective_compute_ratio"]
    for c in now["classes"]:
        out[f"p50_s:{c['name']}"] = c["p50_s"]
        out[f"p99_s:{c['name']}"] = c["p99_s"]
        out[f"queue:{c['name']}"] = c["num_pending"]
    out["rejections_per_s"] = _rate(
        _rejected(now), None if before is None else _rejected(before), "n", dt_s
    )
    out |= _busy(now, before, dt_s)
    slow = now["slowest"]
    out["slow_queue_s"] = None if slow is None else slow["queue_s"] + slow["replica_wait_s"]
    out["slow_fill_s"] = None if slow is None else slow["fill_wait_s"]
    out["slow_compute_s"] = None if slow is None else slow["compute_s"]
    out["slow_answer_s"] = None if slow is None else slow.get("answer_s")
    adaptive = now.get("adaptive")
    out["adaptive_delay_s"] = None if adaptive is None else adaptive["delay_s"]
    out["adaptive_batch_size"] = None if adaptive is None else adaptive["batch_size"]
    memory = now["memory"]
    out["memory_peak_bytes"] = None if memory is None else memory["peak_bytes"]
    out["memory_volatility"] = None if memory is None else memory["volatility"]
    return out


def _rejected(document: Mapping[str, Any]) -> dict[str, int]:
    total = document["num_refused_from_head"]
    total += sum(sum(c["rejections"].values()) for c in document["classes"])
    return {"n": total}


def _busy(now: Mapping[str, Any], before: Mapping[str, Any] | None, dt_s: float) -> Sample:
    """Each replica's busy fraction over the second (since start without ``before``), and
    the balance: the least busy over the most busy (1 when none was busy)."""
    old = {} if before is None else {r["replica_id"]: r["busy_s"] for r in before["replicas"]}
    out: Sample = {}
    for r in now["replicas"]:
        rid = r["replica_id"]
        if rid in old and dt_s > 0:
            out[f"busy:{rid}"] = min(1.0, max(0.0, (r["busy_s"] - old[rid]) / dt_s))
        else:
            out[f"busy:{rid}"] = r["busy_fraction"]
    fractions = [v for v in out.values() if v is not None]
    out["balance"] = min(fractions) / max(fractions) if fractions and max(fractions) > 0 else 1.0
    return out


def _generation(g: Mapping[str, Any], before: Mapping[str, Any] | None, dt_s: float) -> Sample:
    return {
        "running": g["num_running"],
        "waiting": g["num_waiting"],
        "kv_cache_usage": g["kv_cache_usage"],
        "prefix_hit_rate": g["prefix_cache_hit_rate"],
        "ttft_p50_s": g["ttft"]["p50_s"],
        "ttft_p99_s": g["ttft"]["p99_s"],
        "itl_p50_s": g["itl"]["p50_s"],
        "itl_p99_s": g["itl"]["p99_s"],
        "tokens_per_s": _rate(g, before, "num_generation_tokens", dt_s),
    }
