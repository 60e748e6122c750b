"""W1 over HTTP/JSON: peer servers vs `carpool serve`, each on one core, `wrk` on the other.

Every server serves the reference MLP W1 (one request = 256 float32 values as JSON) pinned
to CPU 0 with OMP_NUM_THREADS=1; Debian's `wrk` (pinned to CPU 1) drives it closed-loop at
concurrency 1, 16, 64 and 256 after a 2 s warm-up. Peers run from a separate virtual
environment (benchmarks/.peers-venv, never a carpool dependency), scripts in
benchmarks/peers/. carpool runs from this venv with the KServe v2 JSON body for the same
JSON-style workload. Each server's first answer is checked against W1 computed here.

Set up the peers venv once:

    python3 -m venv benchmarks/.peers-venv
    benchmarks/.peers-venv/bin/pip install torch==2.13.0 numpy fastapi uvicorn litserve \\
        "ray[serve]" bentoml nvidia-pytriton
    # the later installs leave protobuf 6.33 and opentelemetry-sdk 1.45.1, which break Ray:
    benchmarks/.peers-venv/bin/pip install "grpcio-reflection<1.80" "opentelemetry-sdk~=1.45.2"

Then:

    .venv/bin/python benchmarks/bench_peers.py [--duration-s 8] [--servers fastapi,carpool]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from wrkrun import free_port, run_wrk

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / "peers"
PEERS_VENV = ROOT / "benchmarks" / ".peers-venv"
PEER_PY = PEERS_VENV / "bin" / "python"
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "peers.json"
CONCURRENCY = (1, 16, 64, 256)
SERVER_CPU, LOAD_CPU = "0", "1"
READY_TIMEOUT_S = 300.0

LUA = """
local f = io.open("{body}", "rb")
wrk.method = "POST"
wrk.body = f:read("*all")
f:close()
wrk.headers["Content-Type"] = "application/json"
"""


@dataclass
class Server:
    name: str
    label: str
    command: Callable[[int], list[str]]
    path: str
    body: Callable[[list[float]], Any]
    output: Callable[[Any], list[float]]
    env: dict[str, str]


def _kserve_body(x: list[float]) -> Any:
    return {"inputs": [{"name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": x}]}


def _servers() -> list[Server]:
    peer = str(PEER_PY)
    stub_env = {"LD_LIBRARY_PATH": str(sysconfig.get_config_var("LIBDIR"))}
    return [
        Server(
            "fastapi",
            "FastAPI+uvicorn (no batching)",
            lambda port: [peer, str(PEERS / "fastapi_w1.py"), "--port", str(port)],
            "/predict",
            lambda x: {"data": x},
            lambda r: r["output"],
            {},
        ),
        Server(
            "litserve",
            "LitServe (batch 64, 10 ms)",
            lambda port: [peer, str(PEERS / "litserve_w1.py"), "--port", str(port)],
            "/predict",
            lambda x: {"data": x},
            lambda r: r["output"],
            {},
        ),
        Server(
            "rayserve",
            "Ray Serve (batch 64, 10 ms)",
            lambda port: [peer, str(PEERS / "rayserve_w1.py"), "--port", str(port)],
            "/predict",
            lambda x: {"data": x},
            lambda r: r["output"],
            {"RAY_USAGE_STATS_ENABLED": "0"},
        ),
        Server(
            "bentoml",
            "BentoML (batch 64, 10 ms)",
            lambda port: [
                str(PEERS_VENV / "bin" / "bentoml"),
                "serve",
                "bentoml_w1:W1",
                "--working-dir",
                str(PEERS),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            "/predict",
            lambda x: {"data": [x]},
            lambda r: r[0],
            {"BENTOML_DO_NOT_TRACK": "true"},
        ),
        Server(
            "bentoml-60s",
            "BentoML (batch 64, 60 s budget)",
            lambda port: [
                str(PEERS_VENV / "bin" / "bentoml"),
                "serve",
                "bentoml_w1:W1",
                "--working-dir",
                str(PEERS),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            "/predict",
            lambda x: {"data": [x]},
            lambda r: r[0],
            {"BENTOML_DO_NOT_TRACK": "true", "W1_BENTO_MAX_LATENCY_MS": "60000"},
        ),
        Server(
            "pytriton",
            "PyTriton (batch 64, 10 ms)",
            lambda port: [
                peer,
                str(PEERS / "pytriton_w1.py"),
                "--port",
                str(port),
                "--grpc-port",
                str(free_port()),
                "--metrics-port",
                str(free_port()),
            ],
            "/v2/models/mlp/infer",
            _kserve_body,
            lambda r: r["outputs"][0]["data"],
            stub_env,
        ),
        Server(
            "carpool",
            "carpool serve (KServe v2 JSON)",
            lambda port: [
                sys.executable,
                "-m",
                "carpool.cli",
                "serve",
                "--port",
                str(port),
                "--grpc-port",
                "0",
            ],
            "/v2/models/mlp/infer",
            _kserve_body,
            lambda r: r["outputs"][0]["data"],
            {},
        ),
    ]


def _peer_version(package: str) -> str | None:
    out = subprocess.run(
        [str(PEER_PY), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() if out.returncode == 0 else None


def _machine() -> dict[str, Any]:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    versions = {}
    if PEER_PY.exists():
        for package in ("torch", "fastapi", "uvicorn", "litserve", "ray", "bentoml"):
            versions[package] = _peer_version(package)
        versions["nvidia-pytriton"] = _peer_version("nvidia-pytriton")
    return {
        "platform": platform.platform(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "peers_venv": versions,
        "server_cpu": SERVER_CPU,
        "load_cpu": LOAD_CPU,
        "wrk": subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split(
            "\n"
        )[0],
    }


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's whole process group (it was started as its own session)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # stragglers left in the group
    process.wait(timeout=10)


def _wait_ready(process: subprocess.Popen[bytes], url: str, body: Any) -> tuple[float, list[float]]:
    start = time.perf_counter()
    while time.perf_counter() - start < READY_TIMEOUT_S:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        try:
            response = httpx.post(url, json=body, timeout=5)
            if response.status_code == 200:
                return time.perf_counter() - start, response.json()
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not ready within {READY_TIMEOUT_S:.0f} s")


def _run(server: Server, x: list[float], expected: np.ndarray, duration_s: float) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}{server.path}"
    log = Path(tempfile.gettempdir()) / f"bench_peers_{server.name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **server.env}
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            ["taskset", "-c", SERVER_CPU, *server.command(port)],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
    result: dict[str, Any] = {"server": server.name, "label": server.label, "log": str(log)}
    try:
        ready_s, answer = _wait_ready(process, url, server.body(x))
        got = np.asarray(server.output(answer), dtype=np.float32).reshape(-1)
        result["startup_s"] = ready_s
        result["max_abs_err"] = float(np.max(np.abs(got - expected)))
        if got.shape != expected.shape or result["max_abs_err"] > 1e-3:
            raise RuntimeError(f"wrong answer: {got[:4]}... vs {expected[:4]}...")
        print(f"{server.name}: ready in {ready_s:.1f} s, answer ok", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            body = Path(tmp) / "body.json"
            body.write_text(json.dumps(server.body(x)))
            script = Path(tmp) / "post.lua"
            script.write_text(LUA.format(body=body))
            run_wrk(url, script, 16, 2.0, LOAD_CPU)  # warm-up
            rows = []
            for connections in CONCURRENCY:
                row = {
                    "concurrency": connections,
                    **run_wrk(url, script, connections, duration_s, LOAD_CPU),
                }
                rows.append(row)
                print(
                    f"  c={connections:>3}: {row['rate_rps']:8.0f} req/s  "
                    f"p50 {row['p50_ms']:8.2f} ms  p99 {row['p99_ms']:8.2f} ms  "
                    f"non-2xx {row['non_2xx']}  {row['socket_errors']}",
                    flush=True,
                )
        result["rows"] = rows
    except Exception as exc:  # a peer that fails is reported, not fatal
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"{server.name}: SKIPPED ({result['error']}); log {log}", flush=True)
    finally:
        _stop(process)
    return result


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        f"{'server':32} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'non-2xx':>7}",
    ]
    for result in results:
        if "error" in result:
            lines.append(f"{result['label']:32} skipped: {result['error']}")
            continue
        for row in result["rows"]:
            lines.append(
                f"{result['label']:32} {row['concurrency']:>4} {row['rate_rps']:8.0f} "
                f"{row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['non_2xx']:>7}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument(
        "--servers",
        default="fastapi,litserve,rayserve,bentoml,bentoml-60s,pytriton,carpool",
        help="comma-separated subset; results for others already in --json are kept",
    )
    args = parser.parse_args()
    if shutil.which("wrk") is None or shutil.which("taskset") is None:
        sys.exit("bench_peers needs wrk and taskset: apt-get install wrk util-linux")
    wanted = args.servers.split(",")
    servers = [s for s in _servers() if s.name in wanted]
    if any(s.name != "carpool" for s in servers) and not PEER_PY.exists():
        sys.exit(f"no peers venv at {PEERS_VENV}; see this script's docstring")
    machine = _machine()
    print(
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, "
        f"python {machine['python']}, torch {machine['torch']}; peers {machine['peers_venv']}"
    )

    from carpool.models.mlp import W1Runner

    x = np.random.default_rng(0).standard_normal((1, 256), dtype=np.float32)
    expected = W1Runner()(x).reshape(-1)
    x_list = [float(v) for v in x[0]]

    results = [_run(server, x_list, expected, args.duration_s) for server in servers]
    kept: list[dict[str, Any]] = []
    if args.json.exists():
        kept = [
            r
            for r in json.loads(args.json.read_text()).get("results", [])
            if r["server"] not in wanted
        ]
    order = [s.name for s in _servers()]
    merged = sorted(kept + results, key=lambda r: order.index(r["server"]))
    print()
    print(
        f"{machine['cpu_model']}, {machine['cpu_count']} cores, python {machine['python']}, "
        f"torch {machine['torch']}; server on cpu {SERVER_CPU}, wrk on cpu {LOAD_CPU}, "
        f"{args.duration_s:g} s per point"
    )
    print(_table(merged))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "machine": machine,
                "duration_s": args.duration_s,
                "results": merged,
                "command": " ".join(sys.argv),
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
