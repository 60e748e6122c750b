"""bench_guidellm: guidellm's JSON report read into a row, points as medians over the
rounds, carpool against vLLM, and refusing names it does not know."""

from __future__ import annotations

from typing import Any

import pytest

import bench_guidellm
from bench_vs_vllm import CHAT_TEMPLATE
from carpool.generation.chat import ChatMessage, render_chat


def _stats(median: float, p95: float, total: float = 0.0, mean: float = 0.0) -> dict[str, Any]:
    return {
        "successful": {
            "mean": mean,
            "median": median,
            "total_sum": total,
            "percentiles": {"p50": median, "p95": p95, "p99": p95},
        },
        "errored": {"mean": 0.0, "median": 0.0, "total_sum": 0.0, "percentiles": {}},
    }


def _report(tokens: float, duration_s: float, ttft_ms: float, errored: int = 0) -> dict[str, Any]:
    """A report shaped as guidellm 0.8.1 writes it (only what the script reads)."""
    metrics = {
        "request_totals": {"successful": 16, "errored": errored, "incomplete": 0, "total": 16},
        "output_token_count": _stats(128.0, 128.0, total=tokens),
        "output_tokens_per_second": _stats(900.0, 2000.0, mean=tokens / duration_s * 0.98),
        "time_to_first_token_ms": _stats(ttft_ms, 2 * ttft_ms),
        "inter_token_latency_ms": _stats(5.0, 6.5),
        "request_latency": _stats(0.8, 0.9),
    }
    return {"benchmarks": [{"duration": duration_s, "metrics": metrics}]}


def test_a_report_becomes_a_row_of_its_figures() -> None:
    row = bench_guidellm.row_of(_report(tokens=2048.0, duration_s=2.0, ttft_ms=100.0, errored=1))
    assert row["output_tokens_per_s"] == 1024.0  # the tokens over the benchmark's duration
    assert row["guidellm_output_tokens_per_s"] == pytest.approx(1024.0 * 0.98)  # its own mean
    assert (row["ttft_p50_ms"], row["ttft_p95_ms"]) == (100.0, 200.0)
    assert (row["itl_p50_ms"], row["itl_p95_ms"], row["latency_p50_s"]) == (5.0, 6.5, 0.8)
    assert (row["successful"], row["errored"]) == (16.0, 1.0)


def _row(system: str, tokens_per_s: float, ttft_ms: float, round_index: int) -> dict[str, Any]:
    row: dict[str, Any] = {"system": system, "format": "chat", "concurrency": 8,
                           "round": round_index}  # fmt: skip
    row.update(bench_guidellm.row_of(_report(tokens_per_s * 2.0, 2.0, ttft_ms)))
    row["output_tokens_per_cpu_s"] = tokens_per_s / 2.0
    return row


def test_points_are_medians_over_the_rounds_and_ratios_put_carpool_over_vllm() -> None:
    rows = [
        _row("carpool", 1000.0, 50.0, 0),
        _row("carpool", 1300.0, 40.0, 1),
        _row("carpool", 1100.0, 45.0, 2),
        _row("vllm", 1000.0, 90.0, 0),
        _row("vllm", 900.0, 100.0, 1),
        _row("vllm", 1100.0, 80.0, 2),
    ]
    points = bench_guidellm.medians(rows)
    assert [(p["system"], p["rounds"]) for p in points] == [("carpool", 3), ("vllm", 3)]
    carpool, vllm = points
    assert carpool["output_tokens_per_s"] == 1100.0
    assert vllm["ttft_p50_ms"] == 90.0
    (ratio,) = bench_guidellm.ratios(points)
    assert ratio["output_tokens_per_s"] == pytest.approx(1.1)
    assert ratio["output_tokens_per_cpu_s"] == pytest.approx(1.1)
    assert ratio["ttft_p50_vllm_over_carpool"] == pytest.approx(2.0)
    assert "carpool 1.10x vLLM's output tokens/s" in bench_guidellm.table(points, [ratio])


def test_without_vllm_there_is_no_ratio() -> None:
    assert bench_guidellm.ratios(bench_guidellm.medians([_row("carpool", 1.0, 1.0, 0)])) == []


def test_unknown_systems_and_formats_are_refused_naming_the_choices() -> None:
    assert bench_guidellm.parse_list("carpool,vllm", bench_guidellm.SYSTEMS, "--systems") == [
        "carpool",
        "vllm",
    ]
    with pytest.raises(ValueError, match=r"--formats: unknown \['chats'\].*'completions'"):
        bench_guidellm.parse_list("chats", tuple(bench_guidellm.FORMATS), "--formats")
    with pytest.raises(ValueError, match="empty list"):
        bench_guidellm.parse_list(",", bench_guidellm.SYSTEMS, "--systems")


def test_the_command_is_guidellms_own_cli_with_nothing_adapted_to_carpool(tmp_path) -> None:
    command = bench_guidellm.guidellm_command(
        "guidellm", "http://127.0.0.1:9", "/v1/chat/completions", tmp_path, 8, 32, 128, 64,
        tmp_path / "out.json",
    )  # fmt: skip
    backend = command[command.index("--backend") + 1]
    assert (
        backend == "kind=openai_http,target=http://127.0.0.1:9,request_format=/v1/chat/completions"
    )
    assert command[command.index("--profile") + 1] == "kind=concurrent,streams=8"
    assert command[command.index("--constraint") + 1] == "kind=max_requests,count=32"


def test_the_folders_chat_template_renders_as_carpool_reads_it() -> None:
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    prompt = render_chat(messages, CHAT_TEMPLATE)
    assert prompt == "system: Be brief.\nuser: Hi\nassistant: "
