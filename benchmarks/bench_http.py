"""W1 over HTTP: `carpool serve` on one core, Debian's `wrk` on the other.

Closed-loop concurrency 1, 16, 64 and 256 (wrk), then open-loop constant arrival rates
(`carpool bench`, ``--rates``), against POST /v2/models/mlp/infer with a
pre-encoded binary KServe v2 body (one request = 1 x 256 float32, what tritonclient sends
by default). Reports req/s, p50/p99 from wrk, and the mean batch size from the server's
own statistics; the offline W1 ceiling at batch 64 is measured in the same run, before
each sweep and after the last, and each sweep's rate is divided by the mean of the two
ceilings around it.

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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

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
from wrkrun import free_port, run_wrk, write_post_script, write_w1_binary_body

DEFAULT_JSON = RESULTS / "http.json"
CONCURRENCY = (1, 16, 64, 256)


def offline_ceiling(seconds: float = 3.0, batch_size: int = 64) -> float:
    """W1's items per second in batches of ``batch_size``, in this process on the server
    CPU, one torch thread."""
    import torch

    from carpool.models.mlp import W1Runner

    torch.set_num_threads(1)
    allowed = os.sched_getaffinity(0)  # given back after: a caller pinned to the load CPU
    os.sched_setaffinity(0, {int(SERVER_CPU)})
    runner = W1Runner()
    x = np.random.default_rng(1).standard_normal((batch_size, 256), dtype=np.float32)
    for _ in range(5):
        runner(x)
    start, done = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        runner(x)
        done += batch_size
    rate = done / (time.perf_counter() - start)
    os.sched_setaffinity(0, allowed)
    return rate


def _stats(url: str) -> tuple[int, int]:
    stats = httpx.get(f"{url}/v2/models/mlp/stats").json()["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def _open_loop(url: str, rates: str, duration_s: float, out: Path) -> list[dict[str, Any]]:
    """Constant-rate arrivals at each of ``rates`` from `carpool bench` on the load CPU
    (binary KServe, the same 1 x 256 float32 request); latency counts from each request's
    scheduled send time, and the server's mean batch size comes from its /metrics."""
    command = [
        "taskset", "-c", LOAD_CPU, sys.executable, "-m", "carpool.cli", "bench", url,
        "--model", "mlp", "--protocol", "kserve-binary", "--input-shape", "1,256",
        "--rate", rates, "--arrival", "constant", "--duration", f"{duration_s:g}s",
        "--warmup", "2s", "--seed", "0", "--no-progress", "--json", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    points = []
    measured = orjson.loads(out.read_bytes())["points"]
    for offered, point in zip(rates.split(","), measured, strict=True):
        summary, server = point["summary"], point["server"] or {}
        latency = summary["latency"] or {}
        points.append(
            {
                "offered_rps": float(offered),
                "rate_rps": summary["rate_rps"],
                "p50_ms": latency.get("p50_s", 0.0) * 1e3,
                "p99_ms": latency.get("p99_s", 0.0) * 1e3,
                "mean_batch_size": server.get("mean_batch_size") or 0.0,
                "num_errors": summary["num_errors"],
                "errors": summary.get("errors") or {},  # by kind: status or exception
                "behind_schedule_ratio": summary["behind_schedule_ratio"],
            }
        )
    return points


def _median_row(connections: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per field, the median over the sweeps; each sweep's figures kept under "runs"."""
    fields = ("rate_rps", "p50_ms", "p99_ms", "mean_batch_size", "non_2xx", "ratio_to_ceiling")
    row: dict[str, Any] = {f: statistics.median(r[f] for r in runs) for f in fields}
    return {"concurrency": connections, **row, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--repeats", type=int, default=3, help="sweeps; medians reported")
    parser.add_argument("--rates", default="1000,2000,3000", help="open-loop rates, req/s")
    args = parser.parse_args()
    require_wrk("bench_http")
    machine = machine_info(**wrk_info())
    print(f"machine: {machine}")
    # On a shared machine the core's speed drifts by 10% within a minute, so the ceiling is
    # measured before every sweep and after the last (the server, idle, shares its CPU),
    # and each sweep is divided by the mean of the ceilings on either side of it.
    ceilings = [offline_ceiling()]
    print(f"offline W1 ceiling at batch 64 on cpu {SERVER_CPU}: {ceilings[0]:.0f} items/s")
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
    open_rows: list[dict[str, Any]] = []
    try:
        wait_kserve_ready(url, server)
        with tempfile.TemporaryDirectory() as tmp:
            body = Path(tmp) / "body.bin"
            header_length = write_w1_binary_body(body)
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
                if repeat:
                    ceilings.append(offline_ceiling())
                    print(f"offline W1 ceiling: {ceilings[-1]:.0f} items/s")
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
            ceilings.append(offline_ceiling())
            print(f"offline W1 ceiling: {ceilings[-1]:.0f} items/s")
            for connections in CONCURRENCY:
                for repeat, result in enumerate(runs[connections]):
                    around = (ceilings[repeat] + ceilings[repeat + 1]) / 2
                    result["ratio_to_ceiling"] = result["rate_rps"] / around
            rows = [_median_row(c, runs[c]) for c in CONCURRENCY]
            open_rows = _open_loop(url, args.rates, args.duration_s, Path(tmp) / "open.json")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    print("medians of the sweeps (each sweep against the ceilings around it):")
    for result in rows:
        print(
            f"concurrency {result['concurrency']:>3}: {result['rate_rps']:8.0f} req/s  "
            f"p50 {result['p50_ms']:7.2f} ms  p99 {result['p99_ms']:7.2f} ms  mean batch "
            f"{result['mean_batch_size']:5.1f}  {result['ratio_to_ceiling']:.2f} of ceiling"
        )
    print("open loop, constant arrivals (carpool bench):")
    for point in open_rows:
        print(
            f"offered {point['offered_rps']:6.0f} req/s: {point['rate_rps']:8.0f} req/s  "
            f"p50 {point['p50_ms']:7.2f} ms  p99 {point['p99_ms']:7.2f} ms  mean batch "
            f"{point['mean_batch_size']:5.1f}  errors {point['num_errors']}  "
            f"sent late {point['behind_schedule_ratio']:.1%}"
        )
        if point["errors"]:
            print("  errors: " + ", ".join(f"{k}: {n}" for k, n in point["errors"].items()))
    write_results(
        args.json,
        {
            "machine": machine,
            "ceilings_items_per_s": ceilings,
            "rows": rows,
            "open_loop": open_rows,
            "repeats": args.repeats,
            "duration_s": args.duration_s,
        },
    )


if __name__ == "__main__":
    main()
