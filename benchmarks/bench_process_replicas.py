"""Process replicas against thread replicas for a GIL-bound model (issue 24 §1).

A pure-Python model (a loop summing floats, about ``--batch-ms`` per batch, holding the
GIL throughout) served by 2 thread replicas and by 2 process replicas
(``executor="process"``), each driven in-process by ``--submitters`` closed-loop
submitters. Threads take turns on the GIL, so 2 thread replicas compute about as much as
one; 2 processes compute in parallel on 2 cores. Target: process/thread requests/s >= 1.7
on 2 cores. The two are measured alternately, after a warm-up, ``--repeats`` times; the
figures are medians. The share of a core each process used is recorded too: where other
work holds a core (a shared machine), the replica processes get less than 2 between
them, and the ratio says so rather than what process replicas give.

    .venv/bin/python benchmarks/bench_process_replicas.py            # ~1 minute
    .venv/bin/python benchmarks/bench_process_replicas.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchlib import machine_info, utc_now, write_results
from carpool import Batcher, BatchPolicy

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "process_replicas.json"
SEED = 0
TARGET_RATIO = 1.7
NUM_REPLICAS = 2
ITEM_WIDTH = 8


def _calibrate() -> int:
    """Loop iterations of the model's inner loop per millisecond on this machine."""
    n = 200_000
    started = time.perf_counter()
    _spin(n)
    return max(1, int(n / ((time.perf_counter() - started) * 1000)))


def _spin(n: int) -> float:
    total = 0.0
    for i in range(n):
        total += i * 0.5
    return total


class GilModel:
    """Sums floats in a Python loop, ``loops`` times per batch (calibrated once, before
    anything runs, so that threads and processes do the same work): holds the GIL."""

    def __init__(self, loops: int) -> None:
        self.loops = loops

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        spun = _spin(self.loops)
        return batch.sum(axis=1) + 0.0 * spun


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(
    executor: str, model: GilModel, submitters: int, warmup_s: float, window_s: float
) -> tuple[float, list[float]]:
    """Requests per second over ``window_s`` after ``warmup_s``, and the share of a core
    each process used meanwhile (this one first, then the replicas' own): on a machine
    where other work takes a core, the replicas cannot show what 2 cores give."""
    batcher = Batcher(
        model,
        BatchPolicy(max_batch_size=8, max_delay_s=0.001),
        num_replicas=NUM_REPLICAS,
        executor=executor,
    )
    rng = np.random.default_rng(SEED)
    payloads = [rng.random(ITEM_WIDTH) for _ in range(64)]
    counting = False
    done = 0
    stop = False

    async def submitter(k: int) -> None:
        nonlocal done
        i = k
        while not stop:
            await batcher.submit(payloads[i % len(payloads)])
            i += submitters
            if counting:
                done += 1

    async with batcher:
        tasks = [asyncio.create_task(submitter(k)) for k in range(submitters)]
        await asyncio.sleep(warmup_s)
        pids = [os.getpid()]
        pids += [pid for r in batcher._dispatch.replicas if (pid := getattr(r, "pid", None))]
        cpu_started = [_cpu_s(pid) for pid in pids]
        counting, started = True, time.perf_counter()
        await asyncio.sleep(window_s)
        counting, elapsed = False, time.perf_counter() - started
        cores = [(_cpu_s(pid) - c) / elapsed for pid, c in zip(pids, cpu_started, strict=True)]
        stop = True
        await asyncio.gather(*tasks)
    return done / elapsed, cores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-ms", type=float, default=2.0)
    parser.add_argument("--submitters", type=int, default=32)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    if args.quick:
        args.warmup_s, args.window_s, args.repeats = 0.3, 0.5, 1
    random.seed(SEED)
    loops_per_ms = statistics.median(_calibrate() for _ in range(5))
    model = GilModel(int(args.batch_ms * loops_per_ms))
    rps: dict[str, list[float]] = {"thread": [], "process": []}
    cores: dict[str, list[list[float]]] = {"thread": [], "process": []}
    for repeat in range(args.repeats):
        for executor in ("thread", "process"):  # alternated: drift hits both alike
            measured, used = asyncio.run(
                _measure(executor, model, args.submitters, args.warmup_s, args.window_s)
            )
            rps[executor].append(measured)
            cores[executor].append(used)
            shares = " ".join(f"{c:.2f}" for c in used)
            print(f"repeat {repeat}: {executor:7s} {measured:9.0f} req/s, cores used {shares}")
    medians = {k: statistics.median(v) for k, v in rps.items()}
    ratio = medians["process"] / medians["thread"]
    print(f"median: thread {medians['thread']:.0f} req/s, process {medians['process']:.0f}")
    print(f"process / thread = {ratio:.2f} (target >= {TARGET_RATIO} on 2 cores)")
    payload: dict[str, Any] = {
        "benchmark": "process_replicas",
        "when": utc_now(),
        "machine": machine_info(),
        "settings": {
            "seed": SEED,
            "num_replicas": NUM_REPLICAS,
            "batch_ms": args.batch_ms,
            "loops_per_batch": model.loops,
            "submitters": args.submitters,
            "warmup_s": args.warmup_s,
            "window_s": args.window_s,
            "repeats": args.repeats,
            "quick": args.quick,
        },
        "requests_per_s": rps,
        "median_requests_per_s": medians,
        "cores_used_server_then_replicas": cores,
        "ratio_process_over_thread": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
    }
    write_results(args.json, payload)


if __name__ == "__main__":
    main()
