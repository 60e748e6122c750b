"""Memory under a burst of pipelined request bodies, and after it (issue 22, defect 7).

Many connections each pipeline several W1 requests of ~64 KiB (63 rows x 256 float32,
binary) at ``carpool serve`` (built-in ``mlp``, pinned to one core) faster than the model
takes them, then leave. The server's RSS is sampled every 0.2 s: before, at its peak,
and 5 s after the last client left. Two servers in the same run: the default
``--max-inflight-bytes`` (256 MiB), and one with a budget too large to bind (1 TiB),
which is the server without the budget.

    .venv/bin/python benchmarks/burst_memory.py                 # 300 connections x 16
    .venv/bin/python benchmarks/burst_memory.py --connections 1000 --pipeline 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections import Counter
from pathlib import Path
from statistics import median
from typing import Any

from benchlib import (
    LOAD_CPU,
    RESULTS,
    carpool_serve,
    machine_info,
    start_server,
    stop_server,
    utc_now,
    wait_kserve_ready,
    write_results,
)
from soakmonitor import read_rss_kib
from wrkrun import free_port

ROWS = 63  # 63 x 256 float32 = 63 KiB of tensor, plus its JSON header: ~64 KiB a body
CONFIGS = {"default budget": [], "no budget": ["--max-inflight-bytes", str(1 << 40)]}


def rss_mib(pid: int) -> float:
    kib = read_rss_kib(pid)
    return float("nan") if kib is None else kib / 1024


def request_bytes() -> bytes:
    data = bytes(ROWS * 256 * 4)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [ROWS, 256],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(data)},
                }
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    head = (
        b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: bench\r\nContent-Length: %d\r\n"
        b"Inference-Header-Content-Length: %d\r\n\r\n" % (len(header) + len(data), len(header))
    )
    return head + header + data


async def one_client(port: int, pipeline: int, request: bytes, statuses: Counter[str]) -> None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request * pipeline)
        await writer.drain()
        data = b""
        while data.count(b"HTTP/1.1 ") < pipeline:
            chunk = await asyncio.wait_for(reader.read(1 << 16), 300)
            if not chunk:
                break
            data += chunk
        for status in re.findall(rb"HTTP/1.1 (\d+)", data):
            statuses[status.decode()] += 1
        statuses["lost"] += pipeline - data.count(b"HTTP/1.1 ")
        writer.close()
    except (TimeoutError, OSError) as exc:
        statuses[type(exc).__name__] += pipeline


async def burst(port: int, pid: int, connections: int, pipeline: int) -> dict[str, Any]:
    request = request_bytes()
    samples: list[float] = []

    async def sample() -> None:
        while True:
            samples.append(rss_mib(pid))
            await asyncio.sleep(0.2)

    before = rss_mib(pid)
    sampler = asyncio.create_task(sample())
    statuses: Counter[str] = Counter()
    start = time.perf_counter()
    clients = [one_client(port, pipeline, request, statuses) for _ in range(connections)]
    await asyncio.gather(*clients)
    took_s = time.perf_counter() - start
    await asyncio.sleep(5.0)
    sampler.cancel()
    after = rss_mib(pid)
    return {
        "rss_before_mib": round(before, 1),
        "rss_peak_mib": round(max(samples), 1),
        "rss_after_5s_mib": round(after, 1),
        "peak_growth_mib": round(max(samples) - before, 1),
        "after_growth_mib": round(after - before, 1),
        "load_s": round(took_s, 1),
        "statuses": dict(sorted(statuses.items())),
    }


def run(name: str, flags: list[str], args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    log = Path(f"/tmp/burst_memory_{name.replace(' ', '_')}.log")
    process = start_server([*carpool_serve(port), *flags], {}, log)
    try:
        wait_kserve_ready(f"http://127.0.0.1:{port}", process, timeout_s=120)
        time.sleep(1.0)
        rounds = [
            asyncio.run(burst(port, process.pid, args.connections, args.pipeline))
            for _ in range(args.repeats)
        ]
    finally:
        stop_server(process)
    result = {"server": name, "flags": flags, "rounds": rounds}
    for key in ("peak_growth_mib", "after_growth_mib"):
        result[f"median_{key}"] = median(r[key] for r in rounds)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--pipeline", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="bursts per server")
    parser.add_argument("--out", type=Path, default=RESULTS / "burst_memory.json")
    args = parser.parse_args()
    import os

    os.sched_setaffinity(0, {int(LOAD_CPU)})
    results = []
    for name, flags in CONFIGS.items():
        result = run(name, flags, args)
        results.append(result)
        print(
            f"{name:>15}: RSS +{result['median_peak_growth_mib']:.0f} MiB at peak, "
            f"+{result['median_after_growth_mib']:.0f} MiB 5 s after "
            f"(medians of {args.repeats}); statuses {result['rounds'][-1]['statuses']}",
            flush=True,
        )
    write_results(
        args.out,
        {
            "benchmark": "burst_memory",
            "date": utc_now(),
            "machine": machine_info(),
            "connections": args.connections,
            "pipeline": args.pipeline,
            "body_bytes": len(request_bytes()),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
