"""Server batch statistics as the difference of two /metrics scrapes (or two snapshots)."""

from __future__ import annotations

import numpy as np
import pytest

from carpool import batched
from carpool.tools.serverstats import parse_metrics, stats_from_metrics, stats_from_snapshots


def exposition(batches: int, items: int, buckets: dict[str, int], queue: tuple[float, int],
               compute: tuple[float, int], fill: float, rejected: int) -> str:  # fmt: skip
    lines = [
        "# HELP carpool_batch_size Items per batch.",
        "# TYPE carpool_batch_size histogram",
        *(f'carpool_batch_size_bucket{{le="{le}",model="mlp"}} {n}' for le, n in buckets.items()),
        f'carpool_batch_size_count{{model="mlp"}} {batches}',
        f'carpool_batch_size_sum{{model="mlp"}} {items}',
        'carpool_batch_size_bucket{le="+Inf",model="other"} 999',
        'carpool_batch_size_count{model="other"} 999',
        'carpool_batch_size_sum{model="other"} 99999',
        "# TYPE carpool_queue_wait_seconds histogram",
        f'carpool_queue_wait_seconds_count{{class="default",model="mlp"}} {queue[1]}',
        f'carpool_queue_wait_seconds_sum{{class="default",model="mlp"}} {queue[0]}',
        "# TYPE carpool_batch_compute_seconds histogram",
        f'carpool_batch_compute_seconds_count{{model="mlp"}} {compute[1]}',
        f'carpool_batch_compute_seconds_sum{{model="mlp"}} {compute[0]}',
        "# TYPE carpool_fill_ratio gauge",
        f'carpool_fill_ratio{{model="mlp"}} {fill}',
        "# TYPE carpool_effective_compute_ratio gauge",
        'carpool_effective_compute_ratio{model="mlp"} 0.8',
        "# TYPE carpool_rejections counter",
        f'carpool_rejections_total{{class="default",model="mlp",reason="queue_full"}} {rejected}',
    ]
    return "\n".join(lines) + "\n"


BEFORE = exposition(
    10, 20, {"1": 5, "2": 5, "4": 10, "8": 10, "+Inf": 10}, (0.5, 20), (0.1, 10), 0.0625, 1
)
# The run: 30 batches of 8 items (240 items), 240 requests waiting 2.4 s in all.
AFTER = exposition(
    40, 260, {"1": 5, "2": 5, "4": 10, "8": 40, "+Inf": 40}, (2.9, 260), (0.4, 40), 0.203125, 4
)


def test_deltas_of_two_scrapes() -> None:
    stats = stats_from_metrics(BEFORE, AFTER, "mlp")
    assert stats is not None
    assert (stats.num_batches, stats.num_items) == (30, 240)
    assert stats.mean_batch_size == pytest.approx(8.0)
    # Fills summed: 0.0625 x 10 before, 0.203125 x 40 after: the run's 30 batches 7.5.
    assert stats.fill_ratio == pytest.approx(8 / 32)
    assert stats.effective_compute_ratio == pytest.approx(0.8)
    assert stats.mean_queue_wait_s == pytest.approx(2.4 / 240)
    assert stats.mean_compute_s == pytest.approx(0.3 / 30)
    assert stats.batch_size_counts == {"1": 0, "2": 0, "4": 0, "8": 30, "+Inf": 0}
    assert stats.rejections == {"queue_full": 3}


def test_the_runs_fill_is_its_own_after_the_max_batch_size_changed() -> None:
    """Before the run: 10 batches (20 items) under a max size of 16, lifetime fill 0.125.
    The run: 30 batches of 8 under 64, each 0.125 full. Was: the run's mean size over a
    max size inferred from the lifetime figures (6.5 / 0.125 = 52), 0.154 here and 2.05
    in a review's run after a tune."""
    buckets = {"1": 5, "2": 5, "4": 10, "8": 10, "+Inf": 10}
    before = exposition(10, 20, buckets, (0.5, 20), (0.1, 10), 0.125, 1)
    after_buckets = {**buckets, "8": 40, "+Inf": 40}
    after = exposition(40, 260, after_buckets, (2.9, 260), (0.4, 40), (1.25 + 3.75) / 40, 1)
    stats = stats_from_metrics(before, after, "mlp")
    assert stats is not None and stats.fill_ratio == pytest.approx(8 / 64)


def test_unknown_model_or_no_carpool_metrics_gives_none() -> None:
    assert stats_from_metrics(BEFORE, AFTER, "nope") is None
    assert stats_from_metrics("", "process_cpu_seconds_total 1.0\n", "mlp") is None


def test_parse_metrics_keys_by_name_and_labels() -> None:
    samples = parse_metrics(AFTER)
    assert samples[("carpool_batch_size_count", (("model", "mlp"),))] == 40.0


def test_a_run_without_batches_has_no_means() -> None:
    stats = stats_from_metrics(BEFORE, BEFORE, "mlp")
    assert stats is not None
    assert (stats.num_batches, stats.mean_batch_size, stats.fill_ratio) == (0, None, None)


async def test_snapshot_deltas_for_an_in_process_batcher() -> None:
    @batched(max_batch_size=4, max_delay_s=0.0)
    def double(batch: np.ndarray) -> np.ndarray:
        return np.asarray(batch) * 2

    async with double:
        await double.many(np.ones((4, 2)))
        before = double.snapshot()
        await double.many(np.ones((4, 2)))
        await double.many(np.ones((2, 2)))
        after = double.snapshot()
    stats = stats_from_snapshots(before, after)
    assert (stats.num_batches, stats.num_items) == (2, 6)
    assert stats.mean_batch_size == pytest.approx(3.0)
    assert stats.fill_ratio == pytest.approx(0.75)
    assert stats.batch_size_counts == {"2": 1, "4": 1}
    assert stats.mean_queue_wait_s is not None and stats.mean_queue_wait_s >= 0
