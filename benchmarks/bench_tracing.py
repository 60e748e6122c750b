"""What request tracing costs W1 over HTTP: `carpool serve` on one core, `wrk` on the other.

Three servers of the same build, taking turns (off, otlp, capture, off, ...) so that a
shared machine's drift falls on all alike, each at closed-loop concurrency 64 for
``--duration-s``:

* ``off``: no tracing (the default);
* ``otlp``: ``--otlp-endpoint`` pointing at a sink on this machine that answers every
  export 200 and counts the spans it was sent;
* ``capture``: no OTLP, a ``GET /v2/timelines`` (what ``carpool trace`` asks) recording for
  the whole run.

    .venv/bin/python benchmarks/bench_tracing.py [--duration-s 5] [--rounds 3]

Reports req/s and p50/p99 per mode (medians over the rounds) and each mode's req/s over
``off``'s; results in ``benchmarks/results/tracing.json``. Needs `wrk`, `taskset` and the
otel extra.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from benchlib import (
    LOAD_CPU,
    RESULTS,
    SERVER_CPU,
    carpool_serve,
    machine_info,
    require_wrk,
    utc_now,
    wait_kserve_ready,
    write_results,
    wrk_info,
)
from wrkrun import free_port, run_wrk, write_post_script, write_w1_binary_body

MODES = ("off", "otlp", "capture")
CONCURRENCY = 64


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that reads each export, counts its bytes and answers 200."""

    received_bytes = 0

    def do_POST(self) -> None:
        _Sink.received_bytes += len(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _serve(mode: str, port: int, sink_url: str) -> subprocess.Popen[bytes]:
    extra = ["--otlp-endpoint", sink_url] if mode == "otlp" else []
    return subprocess.Popen(
        ["taskset", "-c", SERVER_CPU, *carpool_serve(port), *extra],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _run(mode: str, sink_url: str, script: Path, duration_s: float) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _serve(mode, port, sink_url)
    captured: dict[str, Any] = {}
    try:
        wait_kserve_ready(url, server)
        run_wrk(f"{url}/v2/models/mlp/infer", script, 16, 1.0, LOAD_CPU)  # warm-up
        recorder = None
        if mode == "capture":
            seconds = duration_s + 2.0

            def record() -> None:
                response = httpx.get(
                    f"{url}/v2/timelines", params={"seconds": seconds}, timeout=seconds + 60
                )
                captured["num_timelines"] = len(response.json()["timelines"])

            recorder = threading.Thread(target=record)
            recorder.start()
        result = run_wrk(f"{url}/v2/models/mlp/infer", script, CONCURRENCY, duration_s, LOAD_CPU)
        if recorder is not None:
            recorder.join()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    return {**result, **captured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=RESULTS / "tracing.json")
    args = parser.parse_args()
    require_wrk("bench_tracing.py")
    machine = machine_info(**wrk_info())
    print(f"machine: {machine}")
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    sink_url = f"http://127.0.0.1:{sink.server_address[1]}"
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body.bin"
        header_length = write_w1_binary_body(body)
        script = Path(tmp) / "post.lua"
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(header_length),
        }
        write_post_script(script, body, headers)
        for number in range(args.rounds):
            for mode in MODES:
                result = _run(mode, sink_url, script, args.duration_s)
                runs[mode].append(result)
                print(
                    f"round {number + 1} {mode:>7}: {result['rate_rps']:8.0f} req/s  "
                    f"p50 {result['p50_ms']:7.2f} ms  p99 {result['p99_ms']:7.2f} ms",
                    flush=True,
                )
    sink.shutdown()
    rows = {
        mode: {
            field: statistics.median(r[field] for r in runs[mode])
            for field in ("rate_rps", "p50_ms", "p99_ms")
        }
        for mode in MODES
    }
    print(f"medians over {args.rounds} rounds, concurrency {CONCURRENCY}:")
    for mode, row in rows.items():
        ratio = row["rate_rps"] / rows["off"]["rate_rps"]
        row["ratio_to_off"] = ratio
        print(
            f"{mode:>7}: {row['rate_rps']:8.0f} req/s ({ratio:.3f} of off)  "
            f"p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms"
        )
    print(f"OTLP sink received {_Sink.received_bytes} bytes")
    write_results(
        args.json,
        {
            "machine": machine,
            "finished": utc_now(),
            "concurrency": CONCURRENCY,
            "duration_s": args.duration_s,
            "rounds": args.rounds,
            "medians": rows,
            "runs": runs,
            "otlp_bytes_received": _Sink.received_bytes,
        },
    )


if __name__ == "__main__":
    main()
