"""W1 served over HTTP by 2 process replicas, one per core, against twice the one-core
offline ceiling (issue 24's target: >= 0.9 on a machine with more than 2 cores).

Two servers run side by side, each `carpool serve --workers 1` with the built-in W1
(``mlp``, batch 64 within 2 ms): ``process``, with ``executor: process``,
``num_replicas: 2`` and ``replica_cpus: [[0], [1]]``; and, the baseline, ``thread``, the
default thread executor with 1 replica, pinned to one core as bench_http.py pins it.
`carpool bench` (closed loop, binary KServe, 1 x 256 float32 a request) drives each at
concurrency 64 and 256, interleaved, ``--repeats`` times. For the baseline the load
generator is pinned to the other core; for the process replicas on 2 cores it cannot be:
both cores are the replicas', and what it takes of them is what the served rate loses.
Where two more cores are free (of the replicas' and the baseline's), the process server's
loop runs on the first and the load generator on the second.

Over a window inside each measured run the script reads every process's CPU time (user
+ system, /proc/PID/stat): the server, each of its children (the replicas, Python's
resource tracker) and the load generator, as shares of one core, and how long its
threads waited, ready, for a CPU something else held (/proc/PID/task/*/schedstat): on a
shared machine that tells "the replica had nothing to do" from "it could not get its core".
The offline ceiling
(W1 at batch 64, torch 1 thread, pinned to one core, in a child process) is measured on
each core before the served runs and after them; the median is "the one-core ceiling".

    .venv/bin/python benchmarks/bench_w1_process_replicas.py            # ~2 minutes
    .venv/bin/python benchmarks/bench_w1_process_replicas.py --quick    # smoke run

Writes benchmarks/results/w1_process_replicas.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchlib import (
    LOAD_CPU,
    RESULTS,
    SERVER_CPU,
    carpool_serve,
    machine_info,
    process_cpu_s,
    start_server,
    stop_server,
    utc_now,
    wait_kserve_ready,
    write_results,
)
from wrkrun import free_port

BENCHMARKS = Path(__file__).resolve().parent
DEFAULT_JSON = RESULTS / "w1_process_replicas.json"
CONCURRENCY = (64, 256)
TARGET_RATIO = 0.9
CORES = ("0", "1")
W1_MODEL = """\
models:
  - name: mlp
    kind: python
    source: carpool.server.defaults:w1_factory
    inputs:  [{name: INPUT0, datatype: FP32, shape: [256]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [16]}]
    max_batch_size: 64
    max_delay_s: 0.002
"""
CONFIGS = {
    "process": W1_MODEL + "    executor: process\n    num_replicas: 2\n"
    "    replica_cpus: [[0], [1]]\n",
    "thread": W1_MODEL + "    executor: thread\n    num_replicas: 1\n",
}
# Where each server runs: the thread baseline is pinned as bench_http.py pins the server.
# The process server's replicas pin themselves to cores 0 and 1; where two more cores are
# free of those and of the baseline's two (the machine of more than 2 cores), its
# own loop gets the first and the load generator the second, else both float over the
# replicas' cores.
TAKEN = {int(c) for c in (*CORES, *SERVER_CPU.split(","), *LOAD_CPU.split(",")) if c.isdigit()}
SPARE_CORES = sorted(os.sched_getaffinity(0) - TAKEN)[:2]
HAS_SPARE_CORES = len(SPARE_CORES) == 2
SERVER_CPUS = {
    "process": str(SPARE_CORES[0]) if HAS_SPARE_CORES else ",".join(CORES),
    "thread": SERVER_CPU,
}
LOAD_CPUS = {"process": str(SPARE_CORES[1]) if HAS_SPARE_CORES else None, "thread": LOAD_CPU}


@dataclass(slots=True)
class Served:
    """A running server: its name, URL and process."""

    name: str
    url: str
    process: subprocess.Popen[bytes]


def one_core_ceiling(cpu: str, seconds: float) -> float:
    """W1's offline items/s at batch 64 on ``cpu`` alone, torch 1 thread, measured by
    bench_http.py's own routine in a child process pinned there."""
    code = f"import bench_http; print(bench_http.offline_ceiling({seconds!r}))"
    done = subprocess.run(
        ["taskset", "-c", cpu, sys.executable, "-c", code],
        cwd=BENCHMARKS,
        env={**_env(), "CARPOOL_BENCH_SERVER_CPU": cpu},
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout.strip().splitlines()[-1])


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]


def process_tree(pid: int) -> dict[str, int]:
    """``pid`` as "server" and its children, named by what they run: "replica 1", ...,
    or "tracker" (multiprocessing's resource tracker) or "child N"."""
    named = {"server": pid}
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    replicas = 0
    for number, child in enumerate(children, 1):
        command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"resource_tracker" in command:
            named["tracker"] = int(child)
        elif b"spawn_main" in command:
            replicas += 1
            named[f"replica {replicas}"] = int(child)
        else:
            named[f"child {number}"] = int(child)
    return named


def _inference_count(url: str) -> int:
    stats = httpx.get(f"{url}/v2/models/mlp/stats", timeout=10).json()["model_stats"][0]
    return int(stats["inference_count"])


def run_queue_wait_s(pid: int) -> float:
    """Seconds the threads of ``pid`` have been ready to run but waiting for a CPU, summed
    (/proc/PID/task/TID/schedstat): time other threads held the core they wanted."""
    total_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that has just ended
            total_ns += int((task / "schedstat").read_text().split()[1])
    return total_ns / 1e9


def _read(pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    return {name: (process_cpu_s(pid), run_queue_wait_s(pid)) for name, pid in pids.items()}


def window_shares(
    before: dict[str, tuple[float, float]],
    after: dict[str, tuple[float, float]],
    elapsed_s: float,
) -> tuple[dict[str, float], dict[str, float]]:
    """Each process's CPU over the window, and its threads' wait for a CPU, as shares of
    the window (of one core; waits of several threads add up, so may pass 1)."""
    used = {name: (after[name][0] - before[name][0]) / elapsed_s for name in before}
    waited = {name: (after[name][1] - before[name][1]) / elapsed_s for name in before}
    return used, waited


def run_point(
    served: Served, concurrency: int, warmup_s: float, window_s: float, out: Path
) -> dict[str, Any]:
    """One closed-loop `carpool bench` run at ``concurrency``; the CPU window sits inside
    its measured part, from ``warmup_s`` after the first answers plus half a second."""
    load_cpu = LOAD_CPUS[served.name]
    pin = ["taskset", "-c", load_cpu] if load_cpu is not None else []
    command = [
        *pin, sys.executable, "-m", "carpool.cli", "bench", served.url, "--model", "mlp",
        "--protocol", "kserve-binary", "--input-shape", "1,256",
        "--concurrency", str(concurrency), "--warmup", f"{warmup_s:g}s",
        "--duration", f"{window_s + 1.5:g}s", "--seed", "0", "--no-progress",
        "--json", str(out),
    ]  # fmt: skip
    first = _inference_count(served.url)
    load = subprocess.Popen(command, env=_env(), stdout=subprocess.DEVNULL)
    while _inference_count(served.url) == first and load.poll() is None:
        time.sleep(0.1)
    time.sleep(warmup_s + 0.5)
    pids = {**process_tree(served.process.pid), "load generator": load.pid}
    before = _read(pids)
    count, started = _inference_count(served.url), time.perf_counter()
    time.sleep(window_s)
    elapsed = time.perf_counter() - started
    shares, waits = window_shares(before, _read(pids), elapsed)
    window_rate = (_inference_count(served.url) - count) / elapsed
    if load.wait(timeout=120) != 0:
        raise RuntimeError(f"carpool bench exited with {load.returncode}")
    point = orjson.loads(out.read_bytes())["points"][0]
    summary, server = point["summary"], point["server"] or {}
    return {
        "rate_rps": summary["rate_rps"],
        "window_items_per_s": window_rate,
        "p50_ms": (summary["latency"] or {}).get("p50_s", 0.0) * 1e3,
        "p99_ms": (summary["latency"] or {}).get("p99_s", 0.0) * 1e3,
        "mean_batch_size": server.get("mean_batch_size") or 0.0,
        "num_errors": summary["num_errors"],
        "core_shares": shares,
        "run_queue_wait_shares": waits,
    }


def _median_by_name(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Per name, the median over ``dicts``; a name missing from one counts as 0 there."""
    names = sorted({name for d in dicts for name in d})
    return {name: statistics.median(d.get(name, 0.0) for d in dicts) for name in names}


def summarize(runs: list[dict[str, Any]], ceiling: float) -> dict[str, Any]:
    """Medians over the repeats of one server and concurrency, each rate also against the
    one-core ``ceiling`` and twice it; each repeat kept under "runs"."""
    rate = statistics.median(r["rate_rps"] for r in runs)
    return {
        "rate_rps": rate,
        "ratio_to_ceiling": rate / ceiling,
        "ratio_to_twice_ceiling": rate / (2 * ceiling),
        "p50_ms": statistics.median(r["p50_ms"] for r in runs),
        "p99_ms": statistics.median(r["p99_ms"] for r in runs),
        "mean_batch_size": statistics.median(r["mean_batch_size"] for r in runs),
        "core_shares": _median_by_name([r["core_shares"] for r in runs]),
        "run_queue_wait_shares": _median_by_name([r["run_queue_wait_shares"] for r in runs]),
        "runs": runs,
    }


def _shares_text(row: dict[str, Any]) -> str:
    waits = row["run_queue_wait_shares"]
    return "cores used (waiting for one): " + ", ".join(
        f"{name} {used:.2f} ({waits[name]:.2f})" for name, used in row["core_shares"].items()
    )


def _start(name: str, folder: Path) -> Served:
    config = folder / f"{name}.yaml"
    config.write_text(CONFIGS[name])
    port = free_port()
    argv = [*carpool_serve(port, 0, config), "--workers", "1"]
    process = start_server(argv, {}, folder / f"{name}.log", SERVER_CPUS[name])
    served = Served(name, f"http://127.0.0.1:{port}", process)
    wait_kserve_ready(served.url, process, timeout_s=120)
    return served


def _ceilings(seconds: float) -> list[float]:
    measured = [one_core_ceiling(cpu, seconds) for cpu in CORES]
    print("offline W1 ceiling at batch 64: " + ", ".join(f"{c:.0f}" for c in measured))
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--window-s", type=float, default=4.0)
    parser.add_argument("--ceiling-s", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    if args.quick:
        args.warmup_s, args.window_s, args.ceiling_s, args.repeats = 0.3, 0.5, 0.5, 1
    machine = machine_info(server_cpus=SERVER_CPUS, load_cpus=LOAD_CPUS)
    print(f"machine: {machine}")
    load_before = load_average()
    ceilings = _ceilings(args.ceiling_s)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {
        name: {c: [] for c in CONCURRENCY} for name in CONFIGS
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        servers = [_start(name, folder) for name in CONFIGS]
        try:
            for repeat in range(args.repeats):
                for concurrency in CONCURRENCY:
                    for served in servers:  # interleaved: drift hits both alike
                        out = folder / f"{served.name}_{concurrency}.json"
                        row = run_point(served, concurrency, args.warmup_s, args.window_s, out)
                        runs[served.name][concurrency].append(row)
                        print(
                            f"repeat {repeat + 1} {served.name:7s} c={concurrency:>3}: "
                            f"{row['rate_rps']:7.0f} req/s, mean batch "
                            f"{row['mean_batch_size']:4.1f}, {_shares_text(row)}",
                            flush=True,
                        )
        finally:
            statuses = {s.name: stop_server(s.process) for s in servers}
    ceilings += _ceilings(args.ceiling_s)
    ceiling = statistics.median(ceilings)
    load_after = load_average()
    rows = {
        name: {str(c): summarize(runs[name][c], ceiling) for c in CONCURRENCY} for name in CONFIGS
    }
    print(f"one-core ceiling (median): {ceiling:.0f} items/s; twice: {2 * ceiling:.0f}")
    for name, by_concurrency in rows.items():
        for c, row in by_concurrency.items():
            print(
                f"{name:7s} c={c:>3}: {row['rate_rps']:7.0f} req/s = "
                f"{row['ratio_to_twice_ceiling']:.2f} of 2x ceiling "
                f"({row['ratio_to_ceiling']:.2f} of 1x); {_shares_text(row)}"
            )
    print(f"load average before {load_before}, after {load_after}")
    write_results(
        args.json,
        {
            "benchmark": "w1_process_replicas",
            "when": utc_now(),
            "machine": machine,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "settings": {
                "concurrency": list(CONCURRENCY),
                "warmup_s": args.warmup_s,
                "window_s": args.window_s,
                "ceiling_s": args.ceiling_s,
                "repeats": args.repeats,
                "quick": args.quick,
                "configs": CONFIGS,
            },
            "ceilings_items_per_s": ceilings,
            "ceiling_items_per_s": ceiling,
            "rows": rows,
            "server_exit_statuses": statuses,
            "target_ratio_to_twice_ceiling": TARGET_RATIO,
        },
    )


if __name__ == "__main__":
    main()
