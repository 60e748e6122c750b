"""bench_w1_process_replicas.py's bookkeeping: which child of the server is a replica, and
the medians and ratios it reports. Never timing."""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import pytest

from bench_w1_process_replicas import process_tree, summarize


def _sleep(ready: Any) -> None:
    ready.release()
    time.sleep(30)


def test_spawned_children_are_named_replicas_and_the_tracker_apart() -> None:
    context = multiprocessing.get_context("spawn")
    ready = context.Semaphore(0)  # a named semaphore: starts the resource tracker too
    children = [context.Process(target=_sleep, args=(ready,), daemon=True) for _ in range(2)]
    for child in children:
        child.start()
    try:
        for _ in children:  # each has run Python (its command line is in place)
            assert ready.acquire(timeout=60)
        named = process_tree(os.getpid())
    finally:
        for child in children:
            child.kill()
            child.join()
    assert named["server"] == os.getpid()
    assert {named["replica 1"], named["replica 2"]} == {c.pid for c in children}
    assert "tracker" in named


def _run(rate_rps: float, shares: dict[str, float]) -> dict[str, object]:
    return {
        "rate_rps": rate_rps,
        "p50_ms": 1.0,
        "p99_ms": 2.0,
        "mean_batch_size": 64.0,
        "core_shares": shares,
        "run_queue_wait_shares": {name: share / 2 for name, share in shares.items()},
    }


def test_summary_is_the_median_against_the_ceiling_and_twice_it() -> None:
    runs = [
        _run(1000.0, {"server": 0.2, "replica 1": 0.9}),
        _run(3000.0, {"server": 0.4}),
        _run(1800.0, {"server": 0.3, "replica 1": 0.7}),
    ]
    row = summarize(runs, ceiling=1000.0)
    assert row["rate_rps"] == 1800.0
    assert row["ratio_to_ceiling"] == pytest.approx(1.8)
    assert row["ratio_to_twice_ceiling"] == pytest.approx(0.9)
    # a process missing from a run counts as idle there
    assert row["core_shares"] == {"replica 1": pytest.approx(0.7), "server": pytest.approx(0.3)}
    assert row["run_queue_wait_shares"]["server"] == pytest.approx(0.15)
    assert row["runs"] is runs
