"""W1 over HTTP: `carpool serve` on one core, Debian's `wrk` on the other.

Closed-loop concurrency 1, 16, 64 and 256 against POST /v2/models/mlp/infer with a
pre-encoded binary KServe v2 body (one request = 1 x 256 float32, what tritonclient sends
by default). Reports req/s, p50/p99 from wrk, and the mean batch size from the server's
own statistics; the offline W1 ceiling at batch 64 is measured in the same run, before
and after the HTTP runs (their mean), for a ratio.

    .venv/bin/python benchmarks/bench_http.py [--duration-s 8] [--repeats 3] [--json PATH]

Each sweep runs every concurrency once; the figures reported are medians over the sweeps.

Needs `wrk` (apt-get install wrk) and `taskset` (util-linux).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchlib import (
    LOAD_CPU,
    RESULTS,
    SERVER_CPU,
    carpool_serve,
    machine_info,
    require_wrk,
    wait_kserve_ready,
    write_results,
    wrk_info,
)
from wrkrun import free_port, run_wrk, write_post_script

DEFAULT_JSON = RESULTS / "http.json"
CONCURRENCY = (1, 16, 64, 256)


def _body(path: Path) -> int:
    import tritonclient.http as httpclient

    x = np.random.default_rng(0).standard_normal((1, 256), dtype=np.float32)
    tensor = httpclient.InferInput("INPUT0", [1, 256], "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor], [output])
    path.write_bytes(body)
    return int(json_size)


def _offline_ceiling(seconds: float = 3.0) -> float:
    import torch

    from carpool.models.mlp import W1Runner

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {int(SERVER_CPU)})
    runner = W1Runner()
    x = np.random.default_rng(1).standard_normal((64, 256), dtype=np.float32)
    for _ in range(5):
        runner(x)
    start, done = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        runner(x)
        done += 64
    rate = done / (time.perf_counter() - start)
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return rate


def _stats(url: str) -> tuple[int, int]:
    stats = httpx.get(f"{url}/v2/models/mlp/stats").json()["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def _median_row(connections: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per field, the median over the sweeps; each sweep's figures kept under "runs"."""
    fields = ("rate_rps", "p50_ms", "p99_ms", "mean_batch_size", "non_2xx")
    row: dict[str, Any] = {f: statistics.median(r[f] for r in runs) for f in fields}
    return {"concurrency": connections, **row, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--repeats", type=int, default=3, help="sweeps; medians reported")
    args = parser.parse_args()
    require_wrk("bench_http")
    machine = machine_info(**wrk_info())
    print(f"machine: {machine}")
    # The ceiling is measured before and after the HTTP runs and averaged: on a shared
    # machine the core's speed drifts over a minute, and the ratio should not ride on it.
    ceiling_before = _offline_ceiling()
    print(f"offline W1 ceiling at batch 64 on cpu {SERVER_CPU}: {ceiling_before:.0f} items/s")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    infer_url = f"{url}/v2/models/mlp/infer"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        ["taskset", "-c", SERVER_CPU, *carpool_serve(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rows: list[dict[str, Any]] = []
    try:
        wait_kserve_ready(url)
        with tempfile.TemporaryDirectory() as tmp:
            body = Path(tmp) / "body.bin"
            header_length = _body(body)
            script = Path(tmp) / "post.lua"
            write_post_script(
                script,
                body,
                {
                    "Content-Type": "application/octet-stream",
                    "Inference-Header-Content-Length": str(header_length),
                },
            )
            run_wrk(infer_url, script, 16, 2.0, LOAD_CPU)  # warm-up
            runs: dict[int, list[dict[str, Any]]] = {c: [] for c in CONCURRENCY}
            for repeat in range(args.repeats):
                for connections in CONCURRENCY:
                    before = _stats(url)
                    result = run_wrk(infer_url, script, connections, args.duration_s, LOAD_CPU)
                    after = _stats(url)
                    items, batches = after[0] - before[0], after[1] - before[1]
                    result["mean_batch_size"] = items / batches if batches else 0.0
                    runs[connections].append(result)
                    print(
                        f"sweep {repeat + 1} concurrency {connections:>3}: "
                        f"{result['rate_rps']:8.0f} req/s  p50 {result['p50_ms']:7.2f} ms  "
                        f"p99 {result['p99_ms']:7.2f} ms  mean batch "
                        f"{result['mean_batch_size']:5.1f}  non-2xx {result['non_2xx']}"
                    )
            rows = [_median_row(c, runs[c]) for c in CONCURRENCY]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    ceiling_after = _offline_ceiling()
    ceiling = (ceiling_before + ceiling_after) / 2
    print(
        f"offline W1 ceiling again: {ceiling_after:.0f} items/s; "
        f"mean {ceiling:.0f} items/s is the ceiling below"
    )
    print("medians of the sweeps:")
    for result in rows:
        result["ratio_to_ceiling"] = result["rate_rps"] / ceiling
        print(
            f"concurrency {result['concurrency']:>3}: {result['rate_rps']:8.0f} req/s  "
            f"p50 {result['p50_ms']:7.2f} ms  p99 {result['p99_ms']:7.2f} ms  mean batch "
            f"{result['mean_batch_size']:5.1f}  {result['ratio_to_ceiling']:.2f} of ceiling"
        )
    write_results(
        args.json,
        {
            "machine": machine,
            "ceiling_items_per_s": ceiling,
            "ceiling_before_after": [ceiling_before, ceiling_after],
            "rows": rows,
            "repeats": args.repeats,
            "duration_s": args.duration_s,
        },
    )


if __name__ == "__main__":
    main()
