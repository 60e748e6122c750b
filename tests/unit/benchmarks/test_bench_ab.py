"""bench_ab: a benchmark's figures read back per tree, and compared as medians."""

from __future__ import annotations

import math

import pytest

from bench_ab import (
    compare,
    decode_step_figures,
    http_figures,
    long_context_figures,
    peers_figures,
    prefill_step_figures,
    workers_figures,
)


def _http(rate: float, p99: float) -> dict[str, object]:
    return {"rows": [{"concurrency": 64, "rate_rps": rate, "p50_ms": 10.0, "p99_ms": p99}]}


def test_bench_http_rows_become_figures_per_concurrency() -> None:
    assert http_figures(_http(3000.0, 40.0)) == {
        "c64 req/s": 3000.0,
        "c64 p50 ms": 10.0,
        "c64 p99 ms": 40.0,
    }
    result = _http(3000.0, 40.0)
    result["rows"][0] |= {"ratio_to_ceiling": 0.9, "mean_batch_size": 48.0}
    figures = http_figures(result)
    assert (figures["c64 of ceiling"], figures["c64 mean batch"]) == (0.9, 48.0)


def test_bench_peers_rows_are_named_by_server_and_a_failed_server_has_none() -> None:
    result = {
        "results": [
            {"server": "carpool", "rows": [{"concurrency": 64, "rate_rps": 2.0, "p99_ms": 9.0}]},
            {"server": "pytriton", "error": "did not start"},
        ]
    }
    assert peers_figures(result) == {"carpool c64 req/s": 2.0, "carpool c64 p99 ms": 9.0}


def test_bench_decode_step_rows_become_step_and_set_up_figures_per_batch_size() -> None:
    result = {"rows": [{"num_seqs": 64, "step_ms": 300.0, "prepare_ms": 0.5, "max_context": 9}]}
    assert decode_step_figures(result) == {"n64 step ms": 300.0, "n64 prepare ms": 0.5}


def test_bench_workers_rows_become_cpu_rate_and_ratio_figures_per_model_and_count() -> None:
    one = {"model": "noop", "workers": 1, "cpu_us_per_request": 40.0, "rate_rps": 25000.0,
           "cpu_ratio_to_first": 1.0}  # fmt: skip
    four = {**one, "workers": 4, "cpu_us_per_request": 60.0, "cpu_ratio_to_first": 1.5}
    figures = workers_figures({"rows": [one, four]})
    assert figures["noop w4 CPU us/request"] == 60.0
    assert figures["noop w4 CPU ratio"] == 1.5
    assert figures["noop w1 req/s"] == 25000.0
    assert len(figures) == 6


def test_bench_prefill_step_rows_become_step_and_attention_figures_per_chunk() -> None:
    profiled = {"num_tokens": 512, "num_cached": 1024, "step_ms": 90.0,
                "profile_ms": {"attention": 40.0, "matmul": 45.0}}  # fmt: skip
    plain = {"num_tokens": 1024, "num_cached": 0, "step_ms": 150.0}
    assert prefill_step_figures({"rows": [profiled, plain]}) == {
        "512@1024 step ms": 90.0,
        "512@1024 attention ms": 40.0,
        "1024@0 step ms": 150.0,
    }


def test_bench_long_context_run_becomes_prefill_and_decode_seconds() -> None:
    figures = {"prefill_s": 1.0, "decode_s": 3.0, "prefill_steps": 5, "decode_steps": 300,
               "output_tokens": 2000}  # fmt: skip
    assert long_context_figures({"figures": figures}) == {
        "prefill s": 1.0,
        "decode s": 3.0,
        "output tok/s": 500.0,
    }


def test_medians_of_each_tree_and_their_ratio() -> None:
    runs = {
        "before": [http_figures(_http(r, 40.0)) for r in (3000.0, 2800.0, 3100.0)],
        "after": [http_figures(_http(r, 50.0)) for r in (3300.0, 2900.0, 3000.0)],
    }
    table = compare(runs)
    rate = table["c64 req/s"]
    assert (rate["median_before"], rate["median_after"]) == (3000.0, 3000.0)
    assert rate["ratio"] == 1.0
    assert table["c64 p99 ms"]["ratio"] == pytest.approx(1.25)
    assert rate["before"] == [3000.0, 2800.0, 3100.0]


def test_a_zero_baseline_gives_no_ratio() -> None:
    runs = {"before": [{"x": 0.0}], "after": [{"x": 1.0}]}
    assert math.isnan(compare(runs)["x"]["ratio"])
