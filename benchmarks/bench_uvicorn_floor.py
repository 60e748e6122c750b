"""What a Python HTTP server costs per request before it does anything, and so the best
share of the W1 ceiling a server on it can reach when HTTP and model share one core.

Two floors, measured in the same run, each pinned to CPU 0 and driven by `wrk -t1` on
CPU 1 closed-loop at concurrency 64 with the binary KServe request `bench_http.py` sends
(8 s after a 2 s warm-up, 3 repeats):

- ``uvicorn``: a bare ASGI app on uvicorn (uvloop, httptools, no access log) that reads
  the body and answers a pre-encoded 112-byte body: no decoding, no batching, no model;
- ``bare``: ``benchmarks/noop_server.py``, an asyncio Protocol on uvloop with httptools'
  parser writing one pre-encoded answer: the kernel's loopback TCP, the event loop and
  the parser, and nothing else a Python server could leave out. wrk on one core cannot
  saturate it, so its cost is the server's CPU time per request (from /proc), not the
  inverse of its rate.

With W1's offline batch-64 ceiling measured on CPU 0 in the same run (t_model per item),
the best share of the ceiling a server could reach if the floor's work were all it added
is ``t_model / (t_model + t_floor)``; and a peer serving a share p of the ceiling can be
beaten 2x only by a server adding at most ``t_model * (1 / (2 p) - 1)`` per request.

    .venv/bin/python benchmarks/bench_uvicorn_floor.py [--servers uvicorn,bare]
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
from bench_http import offline_ceiling
from wrkrun import free_port, run_wrk, write_post_script, write_w1_binary_body

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

LABELS = {
    "uvicorn": "uvicorn no-op ASGI",
    "bare": "bare uvloop + httptools",
}


def _cpu_s(pid: int) -> float:
    """Seconds of CPU (user + system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _floor_rates(
    name: str, folder: Path, script: Path, duration_s: float, repeats: int
) -> tuple[list[float], list[float]]:
    """wrk's rates against the ``name`` floor server, pinned to the server CPU, and the
    server's CPU time per request in each run (user + system, from /proc): a server wrk
    cannot saturate still counts only what it spent."""
    port = free_port()
    if name == "uvicorn":
        command = [
            "taskset", "-c", benchlib.SERVER_CPU, sys.executable, "-m", "uvicorn",
            "noop_asgi:app", "--port", str(port), "--loop", "uvloop", "--http", "httptools",
            "--no-access-log", "--log-level", "warning", "--lifespan", "off",
        ]  # fmt: skip
    else:
        noop = Path(__file__).resolve().parent / "noop_server.py"
        command = ["taskset", "-c", benchlib.SERVER_CPU, sys.executable, str(noop)]
        command += ["--port", str(port)]
    server = subprocess.Popen(command, cwd=folder, stdout=subprocess.DEVNULL)
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
        rates, cpu_us = [], []
        for _ in range(repeats):
            cpu_before = _cpu_s(server.pid)
            rate = run_wrk(url, script, 64, duration_s, benchlib.LOAD_CPU)["rate_rps"]
            rates.append(rate)
            cpu_us.append(1e6 * (_cpu_s(server.pid) - cpu_before) / (rate * duration_s))
        return rates, cpu_us
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--servers", default="uvicorn,bare")
    parser.add_argument("--json", type=Path, default=benchlib.RESULTS / "uvicorn_floor.json")
    args = parser.parse_args()
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = set(names) - set(LABELS)
    if unknown or not names:
        parser.error(f"--servers: expected some of {', '.join(LABELS)}, got {args.servers!r}")
    benchlib.require_wrk("bench_uvicorn_floor.py")
    rates: dict[str, list[float]] = {}
    cpu_us: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "noop_asgi.py").write_text(APP)
        json_size = write_w1_binary_body(folder / "body.bin")
        script = folder / "post.lua"
        write_post_script(
            script,
            folder / "body.bin",
            {
                "Inference-Header-Content-Length": str(json_size),
                "Content-Type": "application/octet-stream",
            },
        )
        ceilings = [offline_ceiling()]
        for name in names:
            rates[name], cpu_us[name] = _floor_rates(
                name, folder, script, args.duration_s, args.repeats
            )
            ceilings.append(offline_ceiling())
    ceiling = statistics.median(ceilings)
    t_model_us = 1e6 / ceiling
    print(f"machine: {benchlib.cpu_model()}, {os.cpu_count()} cores")
    print(
        f"W1 offline ceiling at batch 64: median {ceiling:.0f} items/s of "
        f"{[round(c) for c in ceilings]} = {t_model_us:.1f} us per item"
    )
    results: dict[str, object] = {
        "machine": benchlib.machine_info(),
        "w1_ceilings_items_per_s": ceilings,
        "w1_ceiling_items_per_s": ceiling,
        "w1_us_per_item": t_model_us,
    }
    for name in names:
        rate = statistics.median(rates[name])
        t_floor_us = statistics.median(cpu_us[name])
        best = t_model_us / (t_model_us + t_floor_us)
        print(f"{LABELS[name]}, c=64: {rate:.0f} req/s (repeats {[round(r) for r in rates[name]]})")
        print(
            f"  = {t_floor_us:.1f} us of server CPU per request "
            f"(repeats {[round(u, 1) for u in cpu_us[name]]}); best share {best:.2f}"
        )
        results[name] = {
            "rates_rps": rates[name],
            "median_rps": rate,
            "cpu_us_per_request": cpu_us[name],
            "us_per_request": t_floor_us,
            "best_share_of_ceiling": best,
        }
    for share in (0.40, 0.43, 0.47):
        budget = t_model_us * (1 / (2 * share) - 1)
        print(f"2x a peer at {share:.2f} of the ceiling: at most {budget:.1f} us per request")
    benchlib.write_results(args.json, results)


if __name__ == "__main__":
    main()
