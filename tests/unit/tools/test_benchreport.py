"""The bench's outputs: the text table, JSON (strict: no NaN), CSV rows and PNG plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from carpool.tools.bench_types import PointResult
from carpool.tools.benchreport import (
    CSV_COLUMNS,
    LiveProgress,
    flat_row,
    text_table,
    write_csv,
    write_json,
    write_plots,
)
from carpool.tools.loadgen import Mode, Progress, RequestRecord, RunResult
from carpool.tools.serverstats import ServerStats
from carpool.tools.summary import summarize


def _point(label: str, concurrency: int, latency_s: float, *, fail: bool = False) -> PointResult:
    records = []
    for i in range(20):
        record = RequestRecord(i, i * 0.01, sent_s=i * 0.01, done_s=i * 0.01 + latency_s)
        record.num_items = 1
        records.append(record)
    if fail:
        records[0].status, records[0].error = 503, "HTTP 503"
        records[1].sent_s = 0.015  # 5 ms behind
    result = RunResult(Mode.CLOSED, records, 0.0, 0.2, concurrency=concurrency)
    server = ServerStats(
        model="mlp",
        num_batches=5,
        num_items=20,
        mean_batch_size=4.0,
        fill_ratio=0.125,
        effective_compute_ratio=float("nan"),
        mean_queue_wait_s=0.002,
        mean_compute_s=0.001,
        batch_size_counts={"1": 1, "2": 0, "4": 4},
        rejections={},
    )
    latencies = sorted(r.latency_s for r in records if r.error is None)
    return PointResult(label, summarize(result), server, latencies)


def test_text_table_has_a_row_per_point_and_explains_errors_and_lag() -> None:
    table = text_table(
        [_point("concurrency=1", 1, 0.001), _point("concurrency=8", 8, 0.004, fail=True)]
    )
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["point", "req/s", "items/s"]
    assert lines[1].startswith("concurrency=1")
    assert "errors: 503: 1" in table
    assert "behind schedule: 1 of 20" in table


def test_csv_has_the_declared_columns(tmp_path: Path) -> None:
    path = tmp_path / "out" / "bench.csv"
    write_csv(path, [_point("a", 1, 0.001), _point("b", 4, 0.002)])
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert [r["label"] for r in rows] == ["a", "b"]
    assert float(rows[1]["p50_ms"]) == pytest.approx(2.0)
    assert float(rows[0]["server_mean_batch_size"]) == 4.0


def test_json_turns_nan_into_null(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    write_json(path, {"points": [{"x": float("nan"), "y": [1.0, float("inf")]}]})
    assert json.loads(path.read_text()) == {"points": [{"x": None, "y": [1.0, None]}]}


def test_flat_row_converts_to_milliseconds() -> None:
    row = flat_row(_point("a", 1, 0.003))
    assert row["p99_ms"] == pytest.approx(3.0)
    assert row["server_mean_queue_wait_ms"] == pytest.approx(2.0)


def test_plots_are_written_as_png(tmp_path: Path) -> None:
    written = write_plots(tmp_path, [_point("c=1", 1, 0.001), _point("c=8", 8, 0.004)])
    names = sorted(p.name for p in written)
    assert names == ["batch_sizes.png", "latency_cdf.png", "latency_vs_throughput.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_disabled_progress_starts_nothing() -> None:
    async with LiveProgress(Progress(), "x", 1.0, enabled=False) as live:
        assert live._task is None
