"""``carpool bench`` as a user runs it: a subprocess against ``carpool serve`` (the
built-in models) on loopback, about a second per protocol."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import ServedProcess, start_served_process

BENCH_TIMEOUT_S = 120.0  # a net against a hung run, not a timing assertion


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    process = start_served_process(None, tmp_path_factory.mktemp("serve-bench"))
    yield process
    assert process.stop() == 0, process.output()


def _bench(served: ServedProcess, out: Path, *argv: str) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "carpool.cli", "bench", f"http://{served.http_url}",
        "--duration", "1s", "--warmup", "0.2s", "--no-progress", "--json", str(out), *argv,
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "req/s" in run.stdout
    document: dict[str, Any] = json.loads(out.read_text())
    return document


def _check(document: dict[str, Any], model: str, num_points: int) -> None:
    assert document["model"] == model
    assert len(document["points"]) == num_points
    for point in document["points"]:
        summary, server = point["summary"], point["server"]
        assert summary["rate_rps"] > 0
        assert summary["num_errors"] == 0, summary["errors"]
        assert summary["latency"]["p99_s"] >= summary["latency"]["p50_s"] > 0
        assert server is not None and server["model"] == model
        assert server["num_batches"] > 0
        assert server["mean_batch_size"] >= 1


def test_bench_kserve_binary_on_mlp_closed_loop(served: ServedProcess, tmp_path: Path) -> None:
    document = _bench(
        served, tmp_path / "mlp.json", "--model", "mlp", "--protocol", "kserve-binary",
        "--concurrency", "1,8",
    )  # fmt: skip
    _check(document, "mlp", 2)
    assert document["protocol"] == "kserve-binary"


def test_bench_openai_embeddings_open_loop(served: ServedProcess, tmp_path: Path) -> None:
    texts = tmp_path / "texts.txt"
    texts.write_text("a short sentence\nanother, slightly longer sentence to embed\n")
    document = _bench(
        served, tmp_path / "emb.json", "--model", "all-MiniLM-L6-v2",
        "--protocol", "openai-embeddings", "--rate", "50", "--arrival", "poisson",
        "--texts", str(texts),
    )  # fmt: skip
    _check(document, "all-MiniLM-L6-v2", 1)
    assert document["points"][0]["summary"]["mode"] == "open"


def test_bench_streaming_completions_reports_ttft_and_itl(
    served: ServedProcess, tmp_path: Path
) -> None:
    document = _bench(
        served, tmp_path / "gen.json", "--model", "tiny-random-llama",
        "--protocol", "openai-completions", "--concurrency", "4", "--max-tokens", "8",
    )  # fmt: skip
    (point,) = document["points"]
    summary = point["summary"]
    assert summary["rate_rps"] > 0
    assert summary["num_errors"] == 0, summary["errors"]
    assert summary["ttft"]["p50_s"] > 0
    assert summary["itl"]["p50_s"] > 0
