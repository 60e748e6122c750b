"""What a batch pays to run on a Ray actor replica, against a process and a thread replica
(issue 24 §3).

One replica of each kind (``executor="thread"``, ``"process"``, ``"ray"`` on a local Ray
started here), one caller submitting one batch at a time (``submit_many``), so each call
is one batch through the batcher, the replica and back: its wall time is the model's time
plus what the replica kind adds. Two models: a no-op (a batch of one small item,
returned) and W1 (the reference MLP) on batches of 64 rows of 256 float32. The figures
are medians over ``--calls`` calls, per repeat, then the median over ``--repeats``
repeats; the kinds are measured alternately so that drift hits them alike. "overhead"
is a kind's median minus the thread replica's for the same model. Every replica kind runs
torch on ``--torch-threads`` threads (``OMP_NUM_THREADS``, which Ray sets to an actor's
``num_cpus`` otherwise, and ``torch.set_num_threads`` here): W1's time then differs by
what the replica adds, not by how many threads each kind gave torch.

    .venv/bin/python benchmarks/bench_ray.py            # ~1 minute
    .venv/bin/python benchmarks/bench_ray.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchlib import machine_info, utc_now, write_results
from carpool import Batcher, BatchPolicy
from carpool.core.replicas import usable_cpus
from carpool.models.mlp import W1_INPUT_DIM

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "ray.json"
SEED = 0
EXECUTORS = ("thread", "process", "ray")
W1_BATCH = 64
NOOP_WIDTH = 4


def make_noop(device: str) -> Any:
    """A factory of the no-op model (a module's top level: it reaches a process by name)."""
    return noop


def noop(batch: np.ndarray) -> np.ndarray:
    return batch


MODELS: dict[str, tuple[Any, tuple[int, int]]] = {
    # name: (fn_factory, the shape of one submitted batch)
    "noop": ("bench_ray:make_noop", (1, NOOP_WIDTH)),
    "w1_64": ("carpool.models.mlp:make_w1", (W1_BATCH, W1_INPUT_DIM)),
}


async def _per_batch_s(executor: str, factory: str, shape: tuple[int, int], calls: int) -> float:
    """The median wall time of one batch, over ``calls`` calls after a few to warm up."""
    source: Any = factory
    if executor == "thread":  # a thread takes the factory itself
        module, attr = factory.split(":")
        source = getattr(importlib.import_module(module), attr)
    batcher = Batcher(
        fn_factory=source,
        policy=BatchPolicy(max_batch_size=shape[0], max_delay_s=0.0, batch_timeout_s=None),
        num_replicas=1,
        executor=executor,
    )
    rng = np.random.default_rng(SEED)
    x = rng.random(shape, dtype=np.float32)
    times: list[float] = []
    async with batcher:
        for i in range(calls + 5):
            started = time.perf_counter()
            await batcher.submit_many(x)
            if i >= 5:
                times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    if args.quick:
        args.calls, args.repeats = 30, 1
    threads = str(args.torch_threads)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads  # children too
    import ray
    import torch

    torch.set_num_threads(args.torch_threads)  # the thread replica's, in this process
    ray.init(num_cpus=usable_cpus(), include_dashboard=False, log_to_driver=False)
    machine = machine_info(ray=ray.__version__, cpus_usable=usable_cpus())
    print(
        f"machine: {machine['cpu_model']}, {machine['cpus_usable']} usable CPUs, "
        f"Python {machine['python']}, torch {machine['torch']}, ray {machine['ray']}"
    )
    per_batch_s: dict[str, dict[str, list[float]]] = {
        model: {e: [] for e in EXECUTORS} for model in MODELS
    }
    for repeat in range(args.repeats):
        for model, (factory, shape) in MODELS.items():
            for executor in EXECUTORS:  # alternated: drift hits each alike
                measured = asyncio.run(_per_batch_s(executor, factory, shape, args.calls))
                per_batch_s[model][executor].append(measured)
                print(f"repeat {repeat}: {model:6s} {executor:7s} {measured * 1e6:9.0f} us/batch")
    medians = {m: {e: statistics.median(v) for e, v in by.items()} for m, by in per_batch_s.items()}
    overhead = {m: {e: by[e] - by["thread"] for e in EXECUTORS} for m, by in medians.items()}
    for model, by in medians.items():
        line = ", ".join(
            f"{e} {by[e] * 1e6:.0f} us (+{overhead[model][e] * 1e6:.0f})" for e in EXECUTORS
        )
        print(f"median {model}: {line}")
    ray.shutdown()
    payload: dict[str, Any] = {
        "benchmark": "ray",
        "when": utc_now(),
        "machine": machine,
        "settings": {
            "seed": SEED,
            "calls": args.calls,
            "repeats": args.repeats,
            "quick": args.quick,
            "batch_shapes": {m: list(shape) for m, (_, shape) in MODELS.items()},
            "num_replicas": 1,
            "torch_threads": args.torch_threads,
        },
        "per_batch_s": per_batch_s,
        "median_per_batch_s": medians,
        "overhead_over_thread_s": overhead,
    }
    write_results(args.json, payload)


if __name__ == "__main__":
    main()
