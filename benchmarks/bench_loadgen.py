"""How fast is `carpool bench` itself? Its req/s on one core vs `wrk -t1` on the same core.

A no-op HTTP endpoint (benchmarks/noop_server.py: uvloop + httptools, 200 ``{}``) runs
pinned to CPU 0; each load generator runs pinned to CPU 1, one after the other, against
the same endpoint with the same POST body (an OpenAI embeddings request):

* ``carpool bench --concurrency 64`` (closed loop, 64 keep-alive connections);
* ``wrk -t1 -c64`` (the same, in C);
* ``carpool bench --rate R --arrival constant`` (open loop): whether the generator keeps
  a 20k req/s schedule, and how much of it went out late.

Three repeats, medians; the endpoint is shared, so when it (not the client) is the
bottleneck both clients read alike. Results go to benchmarks/results/loadgen.json.

    .venv/bin/python benchmarks/bench_loadgen.py [--duration-s 5] [--repeats 3] [--rate 20000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from wrkrun import free_port, run_wrk

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "loadgen.json"
SERVER_CPU, LOAD_CPU = "0", "1"
CONNECTIONS = 64
MODEL = "noop"


def _machine() -> dict[str, Any]:
    cpu = platform.machine()
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    wrk = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout
    return {
        "platform": platform.platform(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "uvloop": metadata.version("uvloop"),
        "httptools": metadata.version("httptools"),
        "wrk": wrk.split("\n")[0],
        "server_cpu": SERVER_CPU,
        "load_cpu": LOAD_CPU,
    }


def _loadavg() -> list[float]:
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]


def _wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the no-op server did not listen on {port}")


def _carpool_bench(url: str, duration_s: float, load: list[str], out: Path) -> dict[str, Any]:
    command = [
        "taskset", "-c", LOAD_CPU, sys.executable, "-m", "carpool.cli", "bench", url,
        "--model", MODEL, "--protocol", "openai-embeddings", "--duration", f"{duration_s}s",
        "--warmup", "1s", "--no-progress", "--json", str(out), *load,
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    summary: dict[str, Any] = json.loads(out.read_text())["points"][0]["summary"]
    latency = summary["latency"] or {}
    return {
        "rate_rps": summary["rate_rps"],
        "num_errors": summary["num_errors"],
        "p50_ms": latency.get("p50_s", 0.0) * 1e3,
        "p99_ms": latency.get("p99_s", 0.0) * 1e3,
        "behind_schedule_ratio": summary["behind_schedule_ratio"],
        "max_lag_ms": summary["max_lag_s"] * 1e3,
    }


def _wrk(url: str, duration_s: float, folder: Path) -> dict[str, Any]:
    from carpool.tools.targets import DEFAULT_TEXT

    body = json.dumps({"model": MODEL, "input": DEFAULT_TEXT}, separators=(",", ":"))
    script = folder / "post.lua"
    script.write_text(
        f'wrk.method = "POST"\nwrk.body = {json.dumps(body)}\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    return run_wrk(url + "/v1/embeddings", script, CONNECTIONS, duration_s, LOAD_CPU)


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=float, default=20000.0, help="open-loop check (req/s)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    if shutil.which("wrk") is None or shutil.which("taskset") is None:
        sys.exit("bench_loadgen.py needs wrk and taskset: apt-get install wrk util-linux")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        ["taskset", "-c", SERVER_CPU, sys.executable, str(ROOT / "benchmarks" / "noop_server.py"),
         "--port", str(port)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    rows: dict[str, list[dict[str, Any]]] = {"carpool_closed": [], "wrk": [], "carpool_open": []}
    load_before = _loadavg()
    try:
        _wait_port(port)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            for repeat in range(args.repeats):
                closed = ["--concurrency", str(CONNECTIONS)]
                rows["carpool_closed"].append(
                    _carpool_bench(url, args.duration_s, closed, folder / "c.json")
                )
                rows["wrk"].append(_wrk(url, args.duration_s, folder))
                open_loop = ["--rate", f"{args.rate:g}", "--arrival", "constant"]
                rows["carpool_open"].append(
                    _carpool_bench(url, args.duration_s, open_loop, folder / "o.json")
                )
                last = {name: runs[-1]["rate_rps"] for name, runs in rows.items()}
                print(
                    f"repeat {repeat + 1}: carpool closed {last['carpool_closed']:,.0f}  "
                    f"wrk {last['wrk']:,.0f}  carpool open@{args.rate:g} "
                    f"{last['carpool_open']:,.0f} req/s",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait(timeout=10)

    medians = {
        "carpool_closed_rps": _median(rows["carpool_closed"], "rate_rps"),
        "wrk_rps": _median(rows["wrk"], "rate_rps"),
        "carpool_open_rps": _median(rows["carpool_open"], "rate_rps"),
        "carpool_open_behind_schedule_ratio": _median(
            rows["carpool_open"], "behind_schedule_ratio"
        ),
        "carpool_open_p50_ms": _median(rows["carpool_open"], "p50_ms"),
    }
    medians["carpool_to_wrk"] = medians["carpool_closed_rps"] / medians["wrk_rps"]
    print(
        f"median of {args.repeats}: carpool bench {medians['carpool_closed_rps']:,.0f} req/s, "
        f"wrk -t1 {medians['wrk_rps']:,.0f} req/s (ratio {medians['carpool_to_wrk']:.2f}); "
        f"open loop at {args.rate:g}/s: {medians['carpool_open_rps']:,.0f} req/s achieved, "
        f"{medians['carpool_open_behind_schedule_ratio']:.1%} sent >1 ms late"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": _machine(),
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "connections": CONNECTIONS,
        "duration_s": args.duration_s,
        "open_loop_rate_rps": args.rate,
        "medians": medians,
        "runs": rows,
        "command": " ".join(sys.argv),
    }
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
