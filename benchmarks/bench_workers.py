"""CPU per request of the whole server with ``carpool serve --workers N``.

For each model (a no-op one, whose answer is a slice of its input, and W1's ``mlp``)
and each worker count, the server starts pinned to ``--server-cpus``, ``wrk -t1`` on
``CARPOOL_BENCH_LOAD_CPU`` drives ``POST /v2/models/{m}/infer`` (binary KServe body)
closed-loop for ``--duration-s``, and the CPU the server used meanwhile (user + system
of the engine and every worker, from ``/proc/PID/stat``) is divided by the requests the
engine answered (its ``/stats``). The ratio of workers-N to workers-1 is the front
end's overhead: the issue's target is within 1.10, so that throughput scales with the
cores given to the workers. On a machine with many cores, ``--server-cpus 0-7`` with
``--wrk-threads 8`` and ``CARPOOL_BENCH_LOAD_CPU=8-15`` measures the other target: the
no-op's req/s with N workers against one (``rate_ratio_to_first``; at least 3x on 16).

    .venv/bin/python benchmarks/bench_workers.py [--workers 1,2,4] [--duration-s 4]
        [--concurrency 64] [--server-cpus 0] [--repeat 3] [--wrk-threads 1]

The worker counts run interleaved, ``--repeat`` rounds of them, and each keeps its
median CPU per request: on a loaded machine one run can be far off. The system share
(kernel time: syscalls, wake-ups) is printed and kept with each run.

Writes benchmarks/results/workers.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

import benchlib
from wrkrun import free_port, run_wrk, write_post_script, write_w1_binary_body

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
NOOP_MODULE = '''\
def noop(inputs):
    """W1's shapes, no compute: the first 16 values of each row."""
    return {"OUTPUT0": inputs["INPUT0"][:, :16]}
'''
MODEL_CONFIG = """\
models:
  - name: {name}
    kind: python
    source: {source}
    inputs:  [{{name: INPUT0, datatype: FP32, shape: [256]}}]
    outputs: [{{name: OUTPUT0, datatype: FP32, shape: [16]}}]
    max_batch_size: 64
    max_delay_s: {max_delay_s}{slo}
    executor: thread
"""
MODELS = {"noop": "bench_noop_model:noop", "mlp": "carpool.server.defaults:w1_factory"}


def tree_cpu_ticks(pid: int) -> tuple[int, int, int]:
    """User and system ticks of ``pid`` and all its descendants now alive, and the
    ticks (both) of ``pid`` alone: the engine's share, where the workers are its
    children."""
    user = system = own = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except FileNotFoundError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        user += int(fields[11])
        system += int(fields[12])
        if current == pid:
            own = int(fields[11]) + int(fields[12])
        pending += [int(child) for child in children]
    return user, system, own


def _answered(url: str, model: str) -> tuple[int, int]:
    """Requests the engine answered, and the batches it ran for them."""
    # A loaded machine can take a while to answer past a run: 30 s, not httpx's 5.
    stats = httpx.get(f"{url}/v2/models/{model}/stats", timeout=30).json()["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def measure(
    folder: Path, model: str, workers: int, args: argparse.Namespace, script: Path
) -> dict[str, Any]:
    config = folder / f"{model}.yaml"
    slo = "\n    slo_s: 0.05" if args.max_delay_s == "auto" else ""  # what auto waits within
    delay = args.max_delay_s
    config.write_text(
        MODEL_CONFIG.format(name=model, source=MODELS[model], max_delay_s=delay, slo=slo)
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*benchlib.carpool_serve(port, 0, config), "--workers", str(workers)]
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    log = folder / f"serve-{model}-{workers}.log"
    server = benchlib.start_server(argv, {"PYTHONPATH": path}, log, args.server_cpus)
    try:
        benchlib.wait_kserve_ready(url, server)
        time.sleep(1.0)  # every worker listening (the ready lines come after the last)
        infer = f"{url}/v2/models/{model}/infer"
        cpu, threads = benchlib.LOAD_CPU, args.wrk_threads
        run_wrk(infer, script, args.concurrency, 1.0, cpu, threads=threads)  # warm-up
        (user, system, own), (answered, batches) = tree_cpu_ticks(server.pid), _answered(url, model)
        start = time.perf_counter()
        result = run_wrk(infer, script, args.concurrency, args.duration_s, cpu, threads=threads)
        elapsed_s = time.perf_counter() - start
        user_end, system_end, own_end = tree_cpu_ticks(server.pid)
        user_s, system_s = (user_end - user) / TICKS_PER_S, (system_end - system) / TICKS_PER_S
        used_s = user_s + system_s
        engine_s = (own_end - own) / TICKS_PER_S
        answered_end, batches_end = _answered(url, model)
        requests = answered_end - answered - 1  # less the /stats scrape's own
        batch_size = requests / max(batches_end - batches, 1)
    finally:
        status = benchlib.stop_server(server)
    cpu_us = used_s / max(requests, 1) * 1e6
    row = {
        "model": model,
        "workers": workers,
        "rate_rps": result["rate_rps"],
        "p99_ms": result["p99_ms"],
        "requests": requests,
        "server_cpu_s": round(used_s, 3),
        "cpu_us_per_request": round(cpu_us, 1),
        "system_share": round(system_s / max(used_s, 1e-9), 2),
        # With workers, the engine's process (batchers, hand-offs) and the workers' (HTTP,
        # codec, hand-offs); with one, the whole server is the "engine".
        "engine_cpu_us_per_request": round(engine_s / max(requests, 1) * 1e6, 1),
        "workers_cpu_us_per_request": round((used_s - engine_s) / max(requests, 1) * 1e6, 1),
        "mean_batch_size": round(batch_size, 1),
        "server_cores_used": round(used_s / elapsed_s, 2),
        "non_2xx": result["non_2xx"],
        "exit_status": status,
    }
    print(
        f"{model:5s} --workers {workers}: {result['rate_rps']:8.0f} req/s  "
        f"{cpu_us:6.1f} us CPU/request ({system_s / max(used_s, 1e-9):.0%} system; "
        f"engine {row['engine_cpu_us_per_request']:.1f})  "
        f"({used_s / elapsed_s:.2f} cores)  batch {batch_size:.1f}  "
        f"p99 {result['p99_ms']:.1f} ms  exit {status}"
    )
    return row


def _medians(
    model: str, counts: list[int], runs: dict[int, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Per worker count, the run with the median CPU per request (its other figures
    with it, and every run's CPU per request), and its ratios to the first count's."""
    rows = []
    base: dict[str, Any] | None = None
    for workers in counts:
        ranked = sorted(runs[workers], key=lambda r: float(r["cpu_us_per_request"]))
        row = {**ranked[len(ranked) // 2], "cpu_us_per_request_runs": [
            r["cpu_us_per_request"] for r in runs[workers]
        ]}  # fmt: skip
        base = base or row
        row["cpu_ratio_to_first"] = round(row["cpu_us_per_request"] / base["cpu_us_per_request"], 3)
        row["rate_ratio_to_first"] = round(row["rate_rps"] / base["rate_rps"], 3)
        print(
            f"{model:5s} --workers {workers}: median {row['cpu_us_per_request']:.1f} us "
            f"CPU/request of {row['cpu_us_per_request_runs']}, ratio to --workers "
            f"{counts[0]}: CPU/request {row['cpu_ratio_to_first']:.2f}, "
            f"req/s {row['rate_ratio_to_first']:.2f}"
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--models", default="noop,mlp")
    parser.add_argument("--duration-s", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--max-delay-s",
        default="0.002",
        help="the models' max_delay_s: seconds, or auto (the adaptive controller, slo_s 50 ms)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds; medians are kept")
    parser.add_argument("--server-cpus", default=benchlib.SERVER_CPU)
    parser.add_argument(
        "--wrk-threads", type=int, default=1, help="on CARPOOL_BENCH_LOAD_CPU (a CPU list)"
    )
    parser.add_argument("--out", "--json", type=Path, default=benchlib.RESULTS / "workers.json")
    args = parser.parse_args()
    benchlib.require_wrk("bench_workers.py")
    machine = benchlib.machine_info(**benchlib.wrk_info(), server_cpus=args.server_cpus)
    print(f"machine: {machine}")
    counts = [int(w) for w in args.workers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "bench_noop_model.py").write_text(NOOP_MODULE)
        body, script = folder / "body", folder / "post.lua"
        header_length = write_w1_binary_body(body)
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(header_length),
        }
        write_post_script(script, body, headers)
        for model in args.models.split(","):
            runs: dict[int, list[dict[str, Any]]] = {workers: [] for workers in counts}
            for round_index in range(args.repeat):  # the counts interleaved, round by round
                print(f"{model}: round {round_index + 1} of {args.repeat}")
                for workers in counts:
                    runs[workers].append(measure(folder, model, workers, args, script))
            rows += _medians(model, counts, runs)
    benchlib.write_results(
        args.out,
        {
            "machine": machine,
            "utc": benchlib.utc_now(),
            "duration_s": args.duration_s,
            "concurrency": args.concurrency,
            "wrk_threads": args.wrk_threads,
            "max_delay_s": args.max_delay_s,
            "repeat": args.repeat,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
