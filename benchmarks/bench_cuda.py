"""W1 on a CUDA GPU: offline through the torch runner, and served with and without batching.

Offline: ``TorchRunner`` (what ``kind: torch`` serves) on ``cuda:0``, called on NumPy
batches as a replica calls it (host-to-device copy, forward, device-to-host copy), at
batch 1, 8, 64 and 256, in float32 and float16: items/s, median of 3 one-second runs.

Served: one ``carpool serve CONFIG`` pinned to one CPU (``OMP_NUM_THREADS=1``) holding W1
twice on ``cuda:0``: ``w1_batched`` (``max_batch_size`` 64, ``max_delay_s`` 0.002) and
``w1_unbatched`` (``max_batch_size`` 1, the GPU fed one request at a time). Debian's
``wrk -t1`` on another CPU POSTs the binary KServe request tritonclient sends by default
(1 x 256 float32) at closed-loop concurrency 1, 64 and 256, the two models alternating at
each point, ``--repeats`` sweeps; medians are reported, with the mean batch size from the
server's own statistics.

    python benchmarks/bench_cuda.py [--duration-s 5] [--repeats 2] [--json PATH]

Needs a GPU torch can use, `wrk` and `taskset`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchlib import (
    LOAD_CPU,
    RESULTS,
    carpool_serve,
    machine_info,
    require_wrk,
    start_server,
    stop_server,
    wait_kserve_ready,
    write_results,
    wrk_info,
)
from wrkrun import free_port, run_wrk, write_post_script, write_w1_binary_body

DEFAULT_JSON = RESULTS / "cuda.json"
BATCH_SIZES = (1, 8, 64, 256)
CONCURRENCY = (1, 64, 256)
MODELS = {"w1_batched": (64, 0.002), "w1_unbatched": (1, 0.0)}


def offline(dtype: str, batch_size: int, seconds: float = 1.0, runs: int = 3) -> float:
    """Items/s of the torch runner on cuda:0 at ``batch_size``: the median of ``runs``."""
    from carpool.models.mlp import w1_torch_runner

    runner = w1_torch_runner("cuda:0", dtype)
    x = {"INPUT0": np.random.default_rng(1).standard_normal((batch_size, 256), np.float32)}
    for _ in range(20):
        runner(x)  # each call ends with a copy to the host: it has finished on the GPU
    rates = []
    for _ in range(runs):
        start, done = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            runner(x)
            done += batch_size
        rates.append(done / (time.perf_counter() - start))
    return statistics.median(rates)


def _config(path: Path) -> None:
    entries = [
        f"  - name: {name}\n    kind: torch\n    source: carpool.models.mlp:build_w1\n"
        "    device: cuda:0\n"
        "    inputs: [{name: INPUT0, datatype: FP32, shape: [256]}]\n"
        "    outputs: [{name: OUTPUT0, datatype: FP32, shape: [16]}]\n"
        f"    max_batch_size: {size}\n    max_delay_s: {delay}\n"
        for name, (size, delay) in MODELS.items()
    ]
    path.write_text("models:\n" + "".join(entries), encoding="utf-8")


def _stats(url: str, model: str) -> tuple[int, int]:
    stats = httpx.get(f"{url}/v2/models/{model}/stats").json()["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def served(duration_s: float, repeats: int, folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Each model's wrk runs, by concurrency, over the sweeps (see the module doc)."""
    config = folder / "cuda.yaml"
    _config(config)
    body = folder / "body.bin"
    script = folder / "post.lua"
    header_length = write_w1_binary_body(body)
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(header_length),
    }
    write_post_script(script, body, headers)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_server(carpool_serve(port, config=config), {}, folder / "serve.log")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in MODELS}
    try:
        wait_kserve_ready(url, process, timeout_s=120.0)
        for name in MODELS:
            run_wrk(f"{url}/v2/models/{name}/infer", script, 16, 2.0, LOAD_CPU)  # warm-up
        for sweep in range(repeats):
            for connections in CONCURRENCY:
                for name in MODELS if sweep % 2 == 0 else reversed(MODELS):
                    before = _stats(url, name)
                    result = run_wrk(
                        f"{url}/v2/models/{name}/infer", script, connections, duration_s, LOAD_CPU
                    )
                    after = _stats(url, name)
                    items, batches = after[0] - before[0], after[1] - before[1]
                    result |= {
                        "concurrency": connections,
                        "mean_batch_size": items / batches if batches else 0.0,
                    }
                    runs[name].append(result)
                    print(
                        f"sweep {sweep + 1} {name:<13} c={connections:<3} "
                        f"{result['rate_rps']:8.0f} req/s  p50 {result['p50_ms']:6.2f} ms  "
                        f"p99 {result['p99_ms']:6.2f} ms  mean batch "
                        f"{result['mean_batch_size']:5.1f}  non-2xx {result['non_2xx']}",
                        flush=True,
                    )
    finally:
        stop_server(process)
    return runs


def _medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for connections in CONCURRENCY:
        mine = [r for r in runs if r["concurrency"] == connections]
        fields = ("rate_rps", "p50_ms", "p99_ms", "mean_batch_size", "non_2xx")
        row = {f: statistics.median(r[f] for r in mine) for f in fields}
        rows.append({"concurrency": connections, **row})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    require_wrk("bench_cuda")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda needs a GPU that torch can use")
    machine = machine_info(gpu=torch.cuda.get_device_name(0), **wrk_info())
    print(f"machine: {machine}", flush=True)
    ceilings: dict[str, dict[int, float]] = {}
    for dtype in ("float32", "float16"):
        ceilings[dtype] = {n: offline(dtype, n) for n in BATCH_SIZES}
        rates = "  ".join(f"batch {n}: {rate:9.0f}" for n, rate in ceilings[dtype].items())
        print(f"offline W1 on the GPU, {dtype}, items/s: {rates}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = served(args.duration_s, args.repeats, Path(tmp))
    rows = {name: _medians(model_runs) for name, model_runs in runs.items()}
    print("medians over the sweeps:")
    for name, model_rows in rows.items():
        for row in model_rows:
            print(
                f"{name:<13} c={row['concurrency']:<3} {row['rate_rps']:8.0f} req/s  "
                f"p50 {row['p50_ms']:6.2f} ms  p99 {row['p99_ms']:6.2f} ms  "
                f"mean batch {row['mean_batch_size']:5.1f}"
            )
    for b, u in zip(rows["w1_batched"], rows["w1_unbatched"], strict=True):
        print(
            f"c={b['concurrency']:<3} batched / unbatched: {b['rate_rps'] / u['rate_rps']:.2f}x "
            f"req/s, p99 {u['p99_ms'] / b['p99_ms']:.2f}x lower"
        )
    write_results(
        args.json,
        {
            "machine": machine,
            "offline_items_per_s": ceilings,
            "served": rows,
            "runs": runs,
            "duration_s": args.duration_s,
            "repeats": args.repeats,
        },
    )


if __name__ == "__main__":
    main()
