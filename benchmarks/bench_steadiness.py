"""How steady this machine is: the same fixed work, timed in short windows on every CPU.

A ratio between two settings measured one after the other means something only if the
machine ran at one speed meanwhile. On a shared VM it may not: a neighbour on the host
takes part of a core and nothing in the guest shows it (no steal time here). This script
measures it directly. One process per CPU, pinned, all at once, repeats a fixed unit of
work for ``--seconds`` and counts the units done in each ``--window-s`` window:

- ``python``: a loop of dict stores, interpreter-bound, like a server's request path;
- ``matmul``: a 256 x 256 float32 NumPy matmul (one BLAS thread), compute-bound, like a
  model's step.

Per CPU and kind it reports the windows' median rate, p10, p90, min and max, and
p90 / p10: the spread a benchmark point of one window's length can carry with nothing
else running. Run it with nothing else running.

    .venv/bin/python benchmarks/bench_steadiness.py [--seconds 30] [--window-s 0.5]
        [--json benchmarks/results/steadiness.json]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchlib import machine_info, write_results

RESULTS = Path(__file__).resolve().parent / "results"


def _python_unit(store: dict[int, int]) -> None:
    for i in range(1000):
        store[i & 255] = i * 2


def _rates(cpu: int, kind: str, seconds: float, window_s: float) -> list[float]:
    """Units per second in each window, on ``cpu``."""
    os.sched_setaffinity(0, {cpu})
    store: dict[int, int] = {}
    a = np.random.default_rng(cpu).standard_normal((256, 256), dtype=np.float32)
    rates = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start, done = time.perf_counter(), 0
        while (now := time.perf_counter()) - start < window_s:
            if kind == "python":
                _python_unit(store)
            else:
                a @ a  # the work is the point
            done += 1
        rates.append(done / (now - start))
    return rates


def summarize(rates: list[float]) -> dict[str, float]:
    """Median, p10, p90, min and max of the windows' rates, and p90 / p10."""
    values = np.array(rates)
    p10, median, p90 = (float(np.percentile(values, q)) for q in (10, 50, 90))
    return {
        "windows": len(rates),
        "median": median,
        "p10": p10,
        "p90": p90,
        "min": float(values.min()),
        "max": float(values.max()),
        "p90_over_p10": p90 / p10 if p10 > 0 else float("inf"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="per kind (default 30)")
    parser.add_argument("--window-s", type=float, default=0.5, help="window (default 0.5 s)")
    parser.add_argument("--json", type=Path, default=RESULTS / "steadiness.json")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned processes' BLAS: one thread each
    machine = machine_info()
    print(f"machine: {machine}")
    cpus = sorted(os.sched_getaffinity(0))
    out: dict[str, Any] = {"machine": machine, "seconds": args.seconds}
    out |= {"window_s": args.window_s, "cpus": {}}
    context = multiprocessing.get_context("spawn")
    for kind in ("python", "matmul"):
        with context.Pool(len(cpus)) as pool:
            jobs = [(cpu, kind, args.seconds, args.window_s) for cpu in cpus]
            for cpu, rates in zip(cpus, pool.starmap(_rates, jobs), strict=True):
                row = summarize(rates)
                out["cpus"].setdefault(str(cpu), {})[kind] = row | {"rates": rates}
                print(
                    f"cpu {cpu} {kind:>6}: median {row['median']:9.1f}/s  p10 {row['p10']:9.1f}"
                    f"  p90 {row['p90']:9.1f}  min {row['min']:9.1f}  max {row['max']:9.1f}"
                    f"  p90/p10 {row['p90_over_p10']:.2f}",
                    flush=True,
                )
    write_results(args.json, out)


if __name__ == "__main__":
    main()
