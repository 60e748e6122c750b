"""What uvicorn itself costs per request, and so the best share of the W1 ceiling any
uvicorn-based server can reach when HTTP and model share one core.

A bare ASGI app on uvicorn (uvloop, httptools, no access log) reads the body of the same
binary KServe request `bench_http.py` sends and answers a pre-encoded 112-byte body: no
decoding, no batching, no model. It runs pinned to CPU 0; `wrk -t1` on CPU 1 drives it
closed-loop at concurrency 64 for 8 s after a 2 s warm-up, 3 repeats. With W1's offline
batch-64 ceiling measured on CPU 0 in the same run (t_model per item), the best share of
the ceiling a server could reach if uvicorn's work were all it added is

    t_model / (t_model + t_uvicorn)

    .venv/bin/python benchmarks/bench_uvicorn_floor.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import benchlib
from bench_http import _body, offline_ceiling
from wrkrun import free_port, run_wrk, write_post_script

ANSWER = b'{"model_name":"mlp","outputs":[{"name":"OUTPUT0","datatype":"FP32","shape":[1,16]}]}'
APP = f"""
ANSWER = {ANSWER!r}
HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({{"type": "http.response.start", "status": 200, "headers": HEADERS}})
    await send({{"type": "http.response.body", "body": ANSWER}})
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=benchlib.RESULTS / "uvicorn_floor.json")
    args = parser.parse_args()
    benchlib.require_wrk("bench_uvicorn_floor.py")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "noop_asgi.py").write_text(APP)
        json_size = _body(folder / "body.bin")
        script = folder / "post.lua"
        write_post_script(
            script,
            folder / "body.bin",
            {
                "Inference-Header-Content-Length": str(json_size),
                "Content-Type": "application/octet-stream",
            },
        )
        port = free_port()
        command = [
            "taskset", "-c", benchlib.SERVER_CPU, sys.executable, "-m", "uvicorn",
            "noop_asgi:app", "--port", str(port), "--loop", "uvloop", "--http", "httptools",
            "--no-access-log", "--log-level", "warning", "--lifespan", "off",
        ]  # fmt: skip
        server = subprocess.Popen(command, cwd=folder)
        try:
            url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
            deadline = time.monotonic() + 30
            while True:
                try:
                    httpx.post(url, content=b"x", timeout=1)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            run_wrk(url, script, 64, 2.0, benchlib.LOAD_CPU)
            rates = [
                run_wrk(url, script, 64, args.duration_s, benchlib.LOAD_CPU)["rate_rps"]
                for _ in range(args.repeats)
            ]
        finally:
            server.terminate()
            server.wait()
    ceiling = offline_ceiling()
    rate = statistics.median(rates)
    t_http_us, t_model_us = 1e6 / rate, 1e6 / ceiling
    best = t_model_us / (t_model_us + t_http_us)
    print(f"machine: {benchlib.cpu_model()}, {os.cpu_count()} cores")
    print(f"uvicorn no-op ASGI, c=64: {rate:.0f} req/s (repeats {[round(r) for r in rates]})")
    print(f"  = {t_http_us:.1f} us of server CPU per request")
    print(f"W1 offline ceiling at batch 64: {ceiling:.0f} items/s = {t_model_us:.1f} us per item")
    print(f"best share of the ceiling with uvicorn's cost alone: {best:.2f}")
    benchlib.write_results(
        args.json,
        {
            "machine": benchlib.machine_info(),
            "uvicorn_noop_rps": rates,
            "uvicorn_noop_median_rps": rate,
            "uvicorn_us_per_request": t_http_us,
            "w1_ceiling_items_per_s": ceiling,
            "w1_us_per_item": t_model_us,
            "best_share_of_ceiling": best,
        },
    )


if __name__ == "__main__":
    main()
