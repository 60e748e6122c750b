"""W1 over HTTP/JSON: peer servers vs `carpool serve`, each on one core, `wrk` on the other.

Every server serves the reference MLP W1 (one request = 256 float32 values as JSON) pinned
to CPU 0 with OMP_NUM_THREADS=1; Debian's `wrk` (pinned to CPU 1) drives it closed-loop at
concurrency 1, 16, 64 and 256 after a 2 s warm-up. Peers run from a separate virtual
environment (benchmarks/.peers-venv, never a carpool dependency), scripts in
benchmarks/peers/. carpool runs from this venv with the KServe v2 JSON body for the same
JSON-style workload and the peers' policy (benchmarks/peers/carpool_w1.yaml). Each
server's first answer is checked against W1 computed here.

The two KServe servers run a second time as `pytriton-binary` and `carpool-binary`, loaded
with the binary tensor body that `tritonclient.http` sends by default (its answer checked
through that client): what a Triton user's traffic looks like. The other peers have no
binary form.

Set up the peers venv once:

    python3 -m venv benchmarks/.peers-venv
    benchmarks/.peers-venv/bin/pip install torch==2.13.0 numpy fastapi uvicorn litserve \\
        "ray[serve]" bentoml nvidia-pytriton
    # the later installs leave protobuf 6.33 and opentelemetry-sdk 1.45.1, which break Ray:
    benchmarks/.peers-venv/bin/pip install "grpcio-reflection<1.80" "opentelemetry-sdk~=1.45.2"

Then:

    .venv/bin/python benchmarks/bench_peers.py [--duration-s 8] [--servers fastapi,carpool]

For the figures the issue's target is about, the KServe servers alone at c = 64, several
times in alternating order (medians and per-round ratios, in peers_rounds.json):

    .venv/bin/python benchmarks/bench_peers.py --concurrency 64 --rounds 6 \
        --servers pytriton,carpool,pytriton-binary,carpool-binary
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import benchlib
from bench_http import offline_ceiling
from benchlib import LOAD_CPU, RESULTS, ROOT, SERVER_CPU
from wrkrun import free_port, run_wrk, write_post_script

PEERS = ROOT / "benchmarks" / "peers"
PEERS_VENV = ROOT / "benchmarks" / ".peers-venv"
PEER_PY = PEERS_VENV / "bin" / "python"
DEFAULT_JSON = RESULTS / "peers.json"
DEFAULT_ROUNDS_JSON = RESULTS / "peers_rounds.json"
CONCURRENCY = (1, 16, 64, 256)


@dataclass
class Server:
    name: str
    label: str
    command: Callable[[int], list[str]]
    path: str
    body: Callable[[list[float]], Any]
    output: Callable[[Any], list[float]]
    env: dict[str, str]
    binary: bool = False  # load with the KServe binary body tritonclient sends by default


def _kserve_body(x: list[float]) -> Any:
    return {"inputs": [{"name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": x}]}


def _predict_peer(name: str, label: str, script: str, env: dict[str, str]) -> Server:
    """A peer run as ``PEER_PY benchmarks/peers/SCRIPT --port N``, POST /predict {"data": x}."""
    return Server(
        name,
        label,
        lambda port: [str(PEER_PY), str(PEERS / script), "--port", str(port)],
        "/predict",
        lambda x: {"data": x},
        lambda r: r["output"],
        env,
    )


def _bentoml_peer(name: str, label: str, env: dict[str, str]) -> Server:
    """BentoML's ``bentoml serve bentoml_w1:W1``, POST /predict {"data": [x]}."""

    def command(port: int) -> list[str]:
        return [
            str(PEERS_VENV / "bin" / "bentoml"),
            "serve",
            "bentoml_w1:W1",
            "--working-dir",
            str(PEERS),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]

    return Server(
        name,
        label,
        command,
        "/predict",
        lambda x: {"data": [x]},
        lambda r: r[0],
        {"BENTOML_DO_NOT_TRACK": "true", **env},
    )


def _servers() -> list[Server]:
    peer = str(PEER_PY)
    stub_env = {"LD_LIBRARY_PATH": str(sysconfig.get_config_var("LIBDIR"))}
    return [
        _predict_peer("fastapi", "FastAPI+uvicorn (no batching)", "fastapi_w1.py", {}),
        _predict_peer("litserve", "LitServe (batch 64, 10 ms)", "litserve_w1.py", {}),
        _predict_peer(
            "rayserve",
            "Ray Serve (batch 64, 10 ms)",
            "rayserve_w1.py",
            {"RAY_USAGE_STATS_ENABLED": "0"},
        ),
        _bentoml_peer("bentoml", "BentoML (batch 64, 10 ms)", {}),
        _bentoml_peer(
            "bentoml-60s", "BentoML (batch 64, 60 s budget)", {"W1_BENTO_MAX_LATENCY_MS": "60000"}
        ),
        _pytriton(peer, stub_env),
        _carpool(),
        _pytriton(peer, stub_env, binary=True),
        _carpool(binary=True),
    ]


def _pytriton(peer: str, env: dict[str, str], *, binary: bool = False) -> Server:
    return Server(
        "pytriton-binary" if binary else "pytriton",
        f"PyTriton (KServe v2 {'binary' if binary else 'JSON'}, batch 64, 10 ms)",
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
        env,
        binary,
    )


def _carpool(*, binary: bool = False) -> Server:
    return Server(
        "carpool-binary" if binary else "carpool",
        f"carpool serve (KServe v2 {'binary' if binary else 'JSON'}, batch 64, 10 ms)",
        lambda port: benchlib.carpool_serve(port, config=PEERS / "carpool_w1.yaml"),
        "/v2/models/mlp/infer",
        _kserve_body,
        lambda r: r["outputs"][0]["data"],
        {},
        binary,
    )


def _machine() -> dict[str, Any]:
    versions = {}
    if PEER_PY.exists():
        for package in ("torch", "fastapi", "uvicorn", "litserve", "ray", "bentoml"):
            versions[package] = benchlib.venv_version(PEER_PY, package)
        versions["nvidia-pytriton"] = benchlib.venv_version(PEER_PY, "nvidia-pytriton")
    return benchlib.machine_info(peers_venv=versions, **benchlib.wrk_info())


def _run(
    server: Server,
    x: list[float],
    expected: np.ndarray,
    duration_s: float,
    concurrency: tuple[int, ...] = CONCURRENCY,
) -> dict[str, Any]:
    def measure(process: subprocess.Popen[bytes], url: str, result: dict[str, Any]) -> None:
        ready_s, response = benchlib.wait_ready(process, url, server.body(x))
        got = np.asarray(server.output(response.json()), dtype=np.float32).reshape(-1)
        result["startup_s"] = ready_s
        result["max_abs_err"] = float(np.max(np.abs(got - expected)))
        if got.shape != expected.shape or result["max_abs_err"] > 1e-3:
            raise RuntimeError(f"wrong answer: {got[:4]}... vs {expected[:4]}...")
        print(f"{server.name}: ready in {ready_s:.1f} s, answer ok", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            body = Path(tmp) / "body"
            script = Path(tmp) / "post.lua"
            if server.binary:
                headers = _binary_body(x, expected, url, body)
            else:
                body.write_text(json.dumps(server.body(x)))
                headers = {"Content-Type": "application/json"}
            write_post_script(script, body, headers)
            run_wrk(url, script, 16, 2.0, LOAD_CPU)  # warm-up
            rows = []
            for connections in concurrency:
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

    return benchlib.run_server(
        server.name, server.label, server.command, server.path, server.env, "bench_peers", measure
    )


def _binary_body(x: list[float], expected: np.ndarray, url: str, path: Path) -> dict[str, str]:
    """Writes the body ``tritonclient.http`` sends for ``x`` by default (binary input and
    output) to ``path``, checks the server's answer to it through that client, and returns
    the HTTP headers that go with the body."""
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput("INPUT0", [1, 256], "FP32")
    tensor.set_data_from_numpy(np.asarray([x], dtype=np.float32), binary_data=True)
    output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor], [output])
    path.write_bytes(body)
    host = url.split("://", 1)[1].split("/", 1)[0]
    with httpclient.InferenceServerClient(host) as client:
        result = client.infer("mlp", [tensor], outputs=[output])
    got = result.as_numpy("OUTPUT0").reshape(-1)
    if float(np.max(np.abs(got - expected))) > 1e-3:
        raise RuntimeError(f"wrong binary answer: {got[:4]}... vs {expected[:4]}...")
    return {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(json_size),
    }


def _table(results: list[dict[str, Any]]) -> str:
    return benchlib.results_table(results, 32)


# (carpool server, the peer it is compared with) in --rounds mode
PAIRS = (("carpool", "pytriton"), ("carpool-binary", "pytriton-binary"))


def _rounds_summary(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per server and concurrency the median req/s and p99 over the rounds, and per round
    carpool's rate divided by its peer's (PAIRS) at each concurrency."""
    rows: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for results in rounds:
        for result in results:
            for row in result.get("rows", []):
                rows.setdefault(result["server"], {}).setdefault(row["concurrency"], []).append(row)
    medians = {
        server: {
            str(c): {
                "rate_rps": float(np.median([r["rate_rps"] for r in runs])),
                "p99_ms": float(np.median([r["p99_ms"] for r in runs])),
                "runs": len(runs),
            }
            for c, runs in by_c.items()
        }
        for server, by_c in rows.items()
    }
    ratios: dict[str, dict[str, list[float]]] = {}
    for ours, peer in PAIRS:
        for results in rounds:
            by_name = {r["server"]: r for r in results if "rows" in r}
            if ours not in by_name or peer not in by_name:
                continue
            peer_rows = {row["concurrency"]: row for row in by_name[peer]["rows"]}
            for row in by_name[ours]["rows"]:
                other = peer_rows.get(row["concurrency"])
                if other and other["rate_rps"] > 0:
                    ratio = row["rate_rps"] / other["rate_rps"]
                    key = f"{ours}/{peer}"
                    ratios.setdefault(key, {}).setdefault(str(row["concurrency"]), []).append(ratio)
    return {"medians": medians, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--json", type=Path, default=None, help=f"default {DEFAULT_JSON.name}")
    parser.add_argument(
        "--concurrency", default=",".join(map(str, CONCURRENCY)), help="comma-separated"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="run the servers N times, in alternating order (A B, B A, ...), and report "
        f"medians and per-round ratios (default file {DEFAULT_ROUNDS_JSON.name})",
    )
    benchlib.add_servers_option(parser, [s.name for s in _servers()])
    args = parser.parse_args()
    concurrency = tuple(int(c) for c in args.concurrency.split(","))
    wanted, servers = benchlib.chosen_servers("bench_peers", args.servers, _servers())
    if any(not s.name.startswith("carpool") for s in servers) and not PEER_PY.exists():
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
    where = (
        f"{machine['cpu_model']}, {machine['cpu_count']} cores, python {machine['python']}, "
        f"torch {machine['torch']}; server on cpu {SERVER_CPU}, wrk on cpu {LOAD_CPU}, "
        f"{args.duration_s:g} s per point"
    )

    if args.rounds:
        rounds, ceilings = [], []
        for number in range(args.rounds):
            order = servers if number % 2 == 0 else servers[::-1]
            ceilings.append(offline_ceiling())
            print(
                f"round {number + 1}: offline W1 ceiling {ceilings[-1]:.0f} items/s; "
                f"{[s.name for s in order]}",
                flush=True,
            )
            rounds.append([_run(s, x_list, expected, args.duration_s, concurrency) for s in order])
        ceilings.append(offline_ceiling())
        summary = _rounds_summary(rounds)
        ceiling = float(np.median(ceilings))
        print()
        print(where)
        print(f"offline W1 batch-64 ceiling: median {ceiling:.0f} items/s of {len(ceilings)}")
        for server, by_c in summary["medians"].items():
            for c, median in by_c.items():
                median["of_ceiling"] = median["rate_rps"] / ceiling
                print(
                    f"{server:16} c={c:>3}: median {median['rate_rps']:6.0f} req/s "
                    f"({median['of_ceiling']:.2f} of the ceiling), "
                    f"p99 {median['p99_ms']:6.1f} ms over {median['runs']} rounds"
                )
        for pair, by_c in summary["ratios"].items():
            for c, ratios in by_c.items():
                listed = ", ".join(f"{r:.2f}" for r in ratios)
                print(f"{pair} c={c}: median {np.median(ratios):.2f} ({listed})")
        benchlib.write_results(
            args.json or DEFAULT_ROUNDS_JSON,
            {
                "machine": machine,
                "duration_s": args.duration_s,
                "ceilings_items_per_s": ceilings,
                "rounds": rounds,
                **summary,
            },
        )
        return

    results = [_run(server, x_list, expected, args.duration_s, concurrency) for server in servers]
    path = args.json or DEFAULT_JSON
    merged = benchlib.merge_results(path, results, wanted, [s.name for s in _servers()])
    print()
    print(where)
    print(_table(merged))
    benchlib.write_results(
        path, {"machine": machine, "duration_s": args.duration_s, "results": merged}
    )


if __name__ == "__main__":
    main()
