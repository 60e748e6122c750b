"""The memory path on a CUDA GPU (issue 28): pinned pooled copies and CUDA graphs.

1. copies: a copy-heavy model (batches of 3x224x224 float32 images into a small CNN) through
   ``TorchRunner`` on ``cuda:0``, fed from pageable NumPy batches (a new array per batch,
   synchronous copies: the runner as it was) against pinned batches from the buffer pool
   (``BufferPool(pin_memory=True)``: ``non_blocking`` copies on the runner's copy stream).
   Target: pinned >= 1.3x.
2. graphs: W1 through ``TorchRunner`` at batch 1, 2, 4 and 8 with ``cuda_graphs`` (sizes
   1, 2, 4, 8) against without. Target: >= 1.5x.

Each variant runs ``--seconds`` after a warm-up, the variants interleaved ``--repeats``
times; medians and ratios from the same run.

    python benchmarks/bench_cuda_memory_path.py [--seconds 1] [--repeats 3] [--json PATH]

Needs a GPU torch can use; not run on the CPU-only development VM.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchlib import RESULTS, machine_info, utc_now, write_results
from carpool.core.buffer_pool import BufferPool
from carpool.models.mlp import build_w1
from carpool.models.torch import TorchRunner

DEFAULT_JSON = RESULTS / "cuda_memory_path.json"
IMAGE_BATCH = 64
GRAPH_BATCHES = (1, 2, 4, 8)


def small_cnn() -> Any:
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    ).eval()


def rate(call: Callable[[], object], items: int, seconds: float) -> float:
    """Items per second of ``call`` over ``seconds`` (after two warm-up calls)."""
    call()
    call()
    torch.cuda.synchronize()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        call()
        done += items
    return done / (time.perf_counter() - started)


def copies(seconds: float, repeats: int) -> dict[str, Any]:
    runner = TorchRunner(small_cnn(), input_names=["x"], output_names=["y"], device="cuda:0")
    rng = np.random.default_rng(0)
    shape = (IMAGE_BATCH, 3, 224, 224)
    source = rng.standard_normal(shape, dtype=np.float32)
    pool = BufferPool(1 << 30, pin_memory=True)

    def pageable() -> object:
        batch = np.empty(shape, np.float32)  # a new array per batch, as without the pool
        batch[:] = source
        return runner({"x": batch})

    def pinned() -> object:
        batch = pool.acquire_numpy(shape, np.float32)
        batch[:] = source
        try:
            return runner({"x": batch})
        finally:
            pool.release(batch)

    runs: dict[str, list[float]] = {"pageable": [], "pinned": []}
    for _ in range(repeats):
        runs["pageable"].append(rate(pageable, IMAGE_BATCH, seconds))
        runs["pinned"].append(rate(pinned, IMAGE_BATCH, seconds))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"runs": runs, "median": med, "ratio": med["pinned"] / med["pageable"]}


def graphs(seconds: float, repeats: int) -> dict[str, Any]:
    eager = TorchRunner(build_w1(), input_names=["x"], output_names=["y"], device="cuda:0")
    graphed = TorchRunner(
        build_w1(),
        input_names=["x"],
        output_names=["y"],
        device="cuda:0",
        cuda_graphs=GRAPH_BATCHES,
    )
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for batch in GRAPH_BATCHES:
        x = {"x": rng.standard_normal((batch, 256), dtype=np.float32)}
        runs: dict[str, list[float]] = {"eager": [], "graphs": []}
        for _ in range(repeats):
            runs["eager"].append(rate(lambda: eager(x), batch, seconds))  # noqa: B023
            runs["graphs"].append(rate(lambda: graphed(x), batch, seconds))  # noqa: B023
        med = {k: statistics.median(v) for k, v in runs.items()}
        out[str(batch)] = {"runs": runs, "median": med, "ratio": med["graphs"] / med["eager"]}
        print(f"  W1 batch {batch}: graphs/eager {out[str(batch)]['ratio']:.2f}x")
    assert graphed.graphs is not None
    stats = graphed.graphs.stats
    out["padding_share"] = stats.padding_share
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: torch sees none here")
    result: dict[str, Any] = {
        "machine": machine_info(gpu=torch.cuda.get_device_name(0)),
        "utc": utc_now(),
    }
    print("[1] copy-heavy CNN, pinned pooled vs pageable batches")
    result["copies"] = copies(args.seconds, args.repeats)
    print(f"  pinned/pageable {result['copies']['ratio']:.2f}x")
    print("[2] W1 with CUDA graphs vs eager")
    result["graphs"] = graphs(args.seconds, args.repeats)
    write_results(Path(args.json), result)


if __name__ == "__main__":
    main()
