"""What batch-time line `auto` fits to W1 over HTTP, load after load.

The adaptive controller (`max_delay_s: auto`, `max_batch_size: auto`) fits ``t(b) =
overhead + per_item * b`` to the model's own time per batch (docs/core.md); its knee
(`max_batch_size: auto`) and its caps read that line. This script serves W1 as
bench_adaptive.py does (one replica on the server CPU, `carpool bench` on the other),
puts `auto` in force with the queue bound in time, runs a fixed sequence of loads
(closed loops of 1, 4, 16 and 64 clients, bursty gamma arrivals at 2,200 req/s, Poisson
at 3,400 req/s, bursty again, 4 clients again; 5 s each) and after each load reads the
line, its stretch and the cap in force from `/v2/models/mlp/policy`. W1's own line
offline, for comparison: bench_adaptive.py's offline ceiling, or `W1Runner` timed at
batch 32-128 (about 0.19-0.21 ms an item there).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_adaptive_fit.py [--json PATH]

`PYTHONPATH` picks the tree whose controller is measured (bench_ab.py's way of comparing
two commits).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx

from bench_adaptive import CONFIG, W1, goodput, serving, set_policy
from benchlib import machine_info, write_results

RESULTS = Path(__file__).resolve().parent / "results"
LOADS = (
    ("c=1", ["--concurrency", "1"]),
    ("c=4", ["--concurrency", "4"]),
    ("c=16", ["--concurrency", "16"]),
    ("c=64", ["--concurrency", "64"]),
    ("bursty 2200/s", ["--rate", "2200", "--arrival", "gamma", "--burstiness", "4"]),
    ("poisson 3400/s", ["--rate", "3400", "--arrival", "poisson"]),
    ("bursty 2200/s again", ["--rate", "2200", "--arrival", "gamma", "--burstiness", "4"]),
    ("c=4 again", ["--concurrency", "4"]),
)
POINT_S = 5.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "adaptive_fit.json")
    args = parser.parse_args()
    machine = machine_info()
    print(f"machine: {machine}")
    rows: list[dict[str, Any]] = []
    with serving(CONFIG) as url:
        set_policy(
            url, W1.model, max_delay_s="auto", max_batch_size="auto", max_queue_time_s="auto"
        )
        for label, flags in LOADS:
            point = goodput(url, W1, flags, POINT_S)
            policy = httpx.get(f"{url}/v2/models/{W1.model}/policy", timeout=10.0).json()
            fit = policy["adaptive"]["batch_time_fit"]
            background = policy["adaptive"]["classes"]["background"]
            row = {
                "load": label,
                "goodput_rps": point["goodput_rps"],
                "p99_ms": point["p99_ms"],
                "mean_batch_size": point["mean_batch_size"],
                "overhead_ms": fit["overhead_s"] * 1e3,
                "per_item_ms": fit["per_item_s"] * 1e3,
                "stretch": fit["stretch"],
                "max_batch_size": background["max_batch_size"],
                "refusing": background["refusing"],
            }
            rows.append(row)
            print(
                f"{label:>20}: batches of {row['mean_batch_size']:5.1f}, line "
                f"{row['overhead_ms']:5.2f} ms + {row['per_item_ms']:.3f} ms an item, stretch "
                f"{row['stretch']:.2f}, cap {row['max_batch_size']}, refusing {row['refusing']}",
                flush=True,
            )
    write_results(args.json, {"machine": machine, "point_s": POINT_S, "loads": rows})


if __name__ == "__main__":
    main()
