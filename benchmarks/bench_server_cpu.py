"""Where a served request's CPU goes: per-thread CPU time of `carpool serve` under wrk.

The server runs pinned to CPU 0 (``OMP_NUM_THREADS=1``), ``wrk -t1`` on CPU 1 drives
``POST /v2/models/mlp/infer`` closed-loop (binary KServe body by default, ``--json`` for
the KServe JSON body of bench_peers.py) for ``--duration-s`` per concurrency. The CPU time
of each server thread over the window (``/proc/PID/task/TID/stat``: user + system) divided
by the requests answered gives microseconds of CPU per request per thread: the event loop
(``MainThread``, HTTP and batching) apart from a replica thread (the model), which is how
the per-request overhead and its cause were told apart for `docs/benchmarks.md`. The
batch compute per item (the model with collation and splitting, from the server's own
/stats) is printed next to it, to compare with the offline ceiling.

    .venv/bin/python benchmarks/bench_server_cpu.py [CONFIG.yaml] [--concurrency 64,256]
        [--json] [--duration-s 8]

Without a config the built-in models are served (``mlp`` is W1, 64 / 2 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

import benchlib
from wrkrun import free_port, run_wrk, write_post_script, write_w1_binary_body

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def thread_cpu_ticks(pid: int) -> dict[int, tuple[str, int, int]]:
    """{thread id: (name, user ticks, system ticks)} of a running process."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        threads[int(tid)] = (name, int(fields[11]), int(fields[12]))
    return threads


def _script(folder: Path, as_json: bool) -> Path:
    body, script = folder / "body", folder / "post.lua"
    if as_json:
        x = np.random.default_rng(0).standard_normal(256).astype(np.float32)
        tensor = {"name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": x.tolist()}
        body.write_text(json.dumps({"inputs": [tensor]}))
        write_post_script(script, body, {"Content-Type": "application/json"})
    else:
        header_length = write_w1_binary_body(body)
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(header_length),
        }
        write_post_script(script, body, headers)
    return script


def _counts(url: str) -> tuple[int, int, int]:
    """(items, batches, compute ns) the server's /stats report so far. The compute time
    of the batches is the sum over ``batch_stats`` (each batch's model call once);
    ``inference_stats.compute_infer`` adds a batch's time once per request in it, as
    Triton does."""
    stats = httpx.get(f"{url}/v2/models/mlp/stats").json()["model_stats"][0]
    compute_ns = sum(size["compute_infer"]["ns"] for size in stats["batch_stats"])
    return int(stats["inference_count"]), int(stats["execution_count"]), int(compute_ns)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="?", type=Path)
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--json", action="store_true", help="KServe JSON bodies, not binary")
    args = parser.parse_args()
    benchlib.require_wrk("bench_server_cpu.py")
    print(f"machine: {benchlib.machine_info(**benchlib.wrk_info())}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = ["taskset", "-c", benchlib.SERVER_CPU, *benchlib.carpool_serve(port, 0, args.config)]
    server = subprocess.Popen(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        benchlib.wait_kserve_ready(url, server)
        with tempfile.TemporaryDirectory() as tmp:
            script = _script(Path(tmp), args.json)
            infer = f"{url}/v2/models/mlp/infer"
            run_wrk(infer, script, 16, 2.0, benchlib.LOAD_CPU)  # warm-up
            for connections in (int(c) for c in args.concurrency.split(",")):
                _report(server.pid, url, infer, script, connections, args.duration_s)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


def _report(pid: int, url: str, infer: str, script: Path, connections: int, seconds: float) -> None:
    before, counts_before = thread_cpu_ticks(pid), _counts(url)
    start = time.perf_counter()
    result: dict[str, Any] = run_wrk(infer, script, connections, seconds, benchlib.LOAD_CPU)
    elapsed = time.perf_counter() - start
    after, counts_after = thread_cpu_ticks(pid), _counts(url)
    items = counts_after[0] - counts_before[0]
    batches = counts_after[1] - counts_before[1]
    compute_us = (counts_after[2] - counts_before[2]) / max(items, 1) / 1e3
    print(
        f"c={connections}: {result['rate_rps']:.0f} req/s  p50 {result['p50_ms']:.1f} ms  "
        f"p99 {result['p99_ms']:.1f} ms  mean batch {items / max(batches, 1):.1f}"
    )
    print(  # the model with collation and splitting, timed by the batcher
        f"  batch compute {compute_us:.1f} us/item; {1e6 / result['rate_rps']:.1f} us of "
        "wall time per request in all"
    )
    for tid, (name, user, system) in sorted(after.items()):
        _, user_before, system_before = before.get(tid, (name, 0, 0))
        used, kernel = user + system - user_before - system_before, system - system_before
        if used:
            role = "event loop" if tid == pid else "other thread"
            share = used / TICKS_PER_S / elapsed
            per_request_us = used / TICKS_PER_S / max(items, 1) * 1e6
            print(
                f"  {role:12s} {tid}: {share:6.1%} of a core, {per_request_us:6.1f} us/request "
                f"({kernel / used:.0%} in the kernel)"
            )


if __name__ == "__main__":
    main()
