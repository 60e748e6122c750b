"""Summing up a run: percentiles, rates, errors by status or name, lag."""

from __future__ import annotations

import pytest

from carpool.tools.loadgen import Mode, RequestRecord, RunResult
from carpool.tools.summary import Percentiles, error_key, summarize


def _record(index: int, scheduled_s: float, latency_s: float, **fields: object) -> RequestRecord:
    record = RequestRecord(index, scheduled_s, sent_s=scheduled_s, done_s=scheduled_s + latency_s)
    record.num_items = 1
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def test_percentiles_of_known_values() -> None:
    p = Percentiles.of([float(v) for v in range(1, 101)])
    assert p is not None
    assert (p.count, p.mean_s, p.max_s) == (100, 50.5, 100.0)
    assert p.p50_s == pytest.approx(50.5)
    assert p.p99_s == pytest.approx(99.01)
    assert Percentiles.of([]) is None


def test_summary_counts_rates_errors_and_lag() -> None:
    records = [_record(i, i * 0.1, 0.05) for i in range(10)]
    records[3].error, records[3].status = "HTTP 503", 503
    records[4].error = "ConnectionResetError: peer reset"
    records[5].sent_s = records[5].scheduled_s + 0.004  # 4 ms late
    records[6].first_token_s, records[6].itl_s, records[6].num_tokens = 0.62, [0.01, 0.03], 3
    summary = summarize(RunResult(Mode.OPEN, records, 0.0, 0.9, offered_rate_rps=10.0))

    assert summary.num_ok == 8 and summary.num_errors == 2
    assert summary.errors == {"503": 1, "ConnectionResetError": 1}
    assert summary.elapsed_s == pytest.approx(0.95)
    assert summary.rate_rps == pytest.approx(8 / 0.95)
    assert summary.tokens_per_s == pytest.approx(3 / 0.95)
    assert summary.num_behind_schedule == 1
    assert summary.max_lag_s == pytest.approx(0.004)
    assert summary.ttft is not None and summary.ttft.p50_s == pytest.approx(0.02)
    assert summary.itl is not None and summary.itl.count == 2
    assert summary.to_dict()["behind_schedule_ratio"] == pytest.approx(0.1)


def test_an_open_loop_rate_counts_the_whole_sending_window() -> None:
    """23 answers, the last at 0.961 s of a 1 s window: 23 a second, as offered (was
    23.9: the rate stopped at the last answer)."""
    records = [_record(i, i * 0.04, 0.001) for i in range(23)]
    summary = summarize(RunResult(Mode.OPEN, records, 0.0, 1.0, offered_rate_rps=23.0))
    assert summary.elapsed_s == pytest.approx(1.0)
    assert summary.rate_rps == pytest.approx(23.0)


def test_empty_run_sums_to_zero() -> None:
    summary = summarize(RunResult(Mode.CLOSED, [], 0.0, 1.0, concurrency=4))
    assert (summary.rate_rps, summary.num_requests, summary.latency) == (0.0, 0, None)


def test_error_key_prefers_the_http_status() -> None:
    assert error_key(RequestRecord(0, 0.0, status=429, error="HTTP 429")) == "429"
    assert (
        error_key(RequestRecord(0, 0.0, error="QueueFull: queue 'default' is full")) == "QueueFull"
    )
