"""Concurrency 1 on W1 over HTTP: where a lone request's time goes, `auto` against a zero
window.

Issue 25 asks that at concurrency 1 `auto`'s p50 be within 0.5 ms of W1's batch-1 model
time. This script splits the p50 the client sees into what the server measured itself:
one `carpool serve` (bench_adaptive.py's config, W1 on the server CPU) and `carpool bench
--concurrency 1` on the load CPU; the policies (`auto`, and `max_delay_s` 0 with 64 items)
alternate for ``--rounds`` rounds of ``--seconds`` each. Per round: the client's p50; the
server's p50 for the class (arrival to answer, its telemetry); the model's mean compute
per batch (`compute_infer` of `/v2/models/mlp/stats`, all batches of one here) and the
mean queue time. The offline batch-1 time (W1 in this process on the server CPU, one
torch thread) is measured before and after. Medians over the rounds.

``--busy-core`` adds, in each round, each policy again with the server's CPU kept busy
by a spinning process at the lowest priority (nice 19): the server preempts it whenever
it has work, but the CPU never idles between one request and the next. The difference
is what the CPU's idle periods cost a lone request (waking the core, and whatever its
caches lost meanwhile), which the offline batch-1 time, a tight loop, never pays.

    .venv/bin/python benchmarks/bench_c1.py [--rounds 5] [--seconds 4] [--busy-core]
        [--json PATH]

Writes benchmarks/results/c1_breakdown.json. Needs `taskset` (util-linux).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench_adaptive import CONFIG, W1, goodput, serving, set_policy
from bench_http import offline_ceiling
from benchlib import RESULTS, SERVER_CPU, machine_info, write_results

POLICIES = {
    "auto": {"max_delay_s": "auto", "max_batch_size": "auto"},
    "fixed 0 ms x 64": {"max_delay_s": 0.0, "max_batch_size": 64},
}


SPIN = "import os\nos.nice(19)\nwhile True:\n    pass\n"


@contextlib.contextmanager
def busy_core(cpu: str) -> Iterator[None]:
    """A process spinning at nice 19 on ``cpu`` while the block runs."""
    spinner = subprocess.Popen(["taskset", "-c", cpu, sys.executable, "-c", SPIN])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v2/models/mlp/stats", timeout=10.0).json()["model_stats"][0]


def _round(url: str, seconds: float) -> dict[str, float]:
    goodput(url, W1, ["--concurrency", "1"], 1.0)  # the policy's first batches, unmeasured
    before = _stats(url)
    point = goodput(url, W1, ["--concurrency", "1"], seconds)
    after = _stats(url)
    count = after["inference_count"] - before["inference_count"]
    infer = after["inference_stats"]

    def mean_ms(key: str) -> float:
        ns = infer[key]["ns"] - before["inference_stats"][key]["ns"]
        return ns / max(1, count) / 1e6

    (served,) = [c for c in after["carpool"]["classes"] if c["num_completed"]]
    return {
        "client_p50_ms": point["p50_ms"],
        # The class's recent-window percentile: this round's requests, by far the most.
        "server_p50_ms": served["p50_s"] * 1e3,
        "compute_ms": mean_ms("compute_infer"),
        "queue_ms": mean_ms("queue"),
        "requests": float(count),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--busy-core", action="store_true",
                        help="also each policy with the server's CPU kept from idling")  # fmt: skip
    parser.add_argument("--json", type=Path, default=RESULTS / "c1_breakdown.json")
    args = parser.parse_args()
    machine = machine_info()
    print(f"machine: {machine}")
    batch1_ms = [1e3 / offline_ceiling(batch_size=1)]
    cores = {"": contextlib.nullcontext}
    if args.busy_core:
        cores[", busy core"] = lambda: busy_core(SERVER_CPU)
    runs = [(name + core, policy, keep) for name, policy in POLICIES.items()
            for core, keep in cores.items()]  # fmt: skip
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in runs}
    with serving(CONFIG) as url:
        for i in range(args.rounds):
            for name, policy, keep in runs:
                set_policy(url, W1.model, **policy)
                with keep():
                    row = _round(url, args.seconds)
                rounds[name].append(row)
                print(f"round {i} {name:>28}: " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))
    batch1_ms.append(1e3 / offline_ceiling(batch_size=1))
    offline_ms = float(np.median(batch1_ms))
    medians = {
        name: {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
        for name, rows in rounds.items()
    }
    for name, m in medians.items():
        print(
            f"{name:>28}: client p50 {m['client_p50_ms']:.2f} ms = offline batch-1 "
            f"{offline_ms:.2f} + {m['client_p50_ms'] - offline_ms:.2f}; server p50 "
            f"{m['server_p50_ms']:.2f}, compute {m['compute_ms']:.2f}, queue {m['queue_ms']:.3f}"
        )
    write_results(
        args.json,
        {
            "machine": machine,
            "busy_core": args.busy_core,
            "offline_batch1_ms": offline_ms,
            "offline_batch1_runs_ms": batch1_ms,
            "medians": medians,
            "rounds": rounds,
        },
    )


if __name__ == "__main__":
    main()
