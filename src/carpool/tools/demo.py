"""What batching buys: the reference MLP W1 served one request at a time, then batched.

``carpool demo`` runs it in one process, without a network. Many concurrent callers each
send one 256-float request at a time (closed loop) for a fixed time; the same model runs
first with ``max_batch_size=1`` (no batching) and then with carpool's dynamic batching.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import time
from dataclasses import dataclass

import numpy as np

from carpool.core.batcher import Batcher
from carpool.core.policy import BatchPolicy
from carpool.models.mlp import W1_INPUT_DIM, W1Runner


@dataclass(frozen=True, slots=True)
class DemoResult:
    label: str
    num_requests: int
    elapsed_s: float
    p50_s: float
    p99_s: float
    mean_batch_size: float
    fill_ratio: float
    effective_compute_ratio: float

    @property
    def rate_rps(self) -> float:
        return self.num_requests / self.elapsed_s


async def _drive(batcher: Batcher, num_clients: int, duration_s: float, seed: int) -> DemoResult:
    rng = np.random.default_rng(seed)
    payloads = rng.standard_normal((num_clients, W1_INPUT_DIM), dtype=np.float32)
    latencies: list[float] = []
    async with batcher:
        warm_until = time.perf_counter() + min(1.0, duration_s / 4)
        stop_at = warm_until + duration_s

        async def client(i: int) -> None:
            x = payloads[i]
            while (start := time.perf_counter()) < stop_at:
                await batcher.submit(x)
                if start >= warm_until:
                    latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(client(i) for i in range(num_clients)))
    snap = batcher.snapshot()
    p50, p99 = np.percentile(latencies, [50, 99]) if latencies else (np.nan, np.nan)
    return DemoResult(
        label=batcher.name,
        num_requests=len(latencies),
        elapsed_s=duration_s,
        p50_s=float(p50),
        p99_s=float(p99),
        mean_batch_size=snap.batches.mean_batch_size,
        fill_ratio=snap.batches.fill_ratio,
        effective_compute_ratio=snap.batches.effective_compute_ratio,
    )


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _row(r: DemoResult) -> str:
    return (
        f"{r.label:<22} {r.rate_rps:>9.0f} req/s  p50 {r.p50_s * 1e3:7.2f} ms  "
        f"p99 {r.p99_s * 1e3:7.2f} ms  mean batch {r.mean_batch_size:5.1f}  "
        f"fill {r.fill_ratio:4.2f}  compute ratio {r.effective_compute_ratio:4.2f}"
    )


async def run_demo(num_clients: int, duration_s: float, max_delay_s: float) -> None:
    import torch

    torch.set_num_threads(1)
    print("carpool demo: reference MLP W1 (256 -> 2048 -> 2048 -> 2048 -> 16, float32)")
    print(f"machine: {_machine()}, torch {torch.__version__}, 1 torch thread")
    print(
        f"{num_clients} concurrent callers, one request each at a time, {duration_s:g} s per run\n"
    )
    runner = W1Runner()
    alone = Batcher(runner, BatchPolicy(max_batch_size=1, max_delay_s=0.0), name="one at a time")
    batched = Batcher(
        runner, BatchPolicy(max_batch_size=64, max_delay_s=max_delay_s), name="carpool batching"
    )
    results = [await _drive(b, num_clients, duration_s, seed=0) for b in (alone, batched)]
    for result in results:
        print(_row(result))
    base, best = results
    print(
        f"\nbatching carried {best.rate_rps / base.rate_rps:.1f}x the traffic on the same core; "
        f"p99 went from {base.p99_s * 1e3:.1f} ms to {best.p99_s * 1e3:.1f} ms."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="carpool demo", description=__doc__)
    parser.add_argument("--clients", type=int, default=128, help="concurrent callers")
    parser.add_argument("--duration-s", type=float, default=4.0, help="seconds per run")
    parser.add_argument("--max-delay-s", type=float, default=0.002, help="batching delay window")
    args = parser.parse_args(argv)
    if args.clients < 1:
        parser.error(f"--clients {args.clients}: expected an integer >= 1")
    if not 0 < args.duration_s < math.inf:
        parser.error(f"--duration-s {args.duration_s}: expected a finite number of seconds > 0")
    if not 0 <= args.max_delay_s < math.inf:
        parser.error(f"--max-delay-s {args.max_delay_s}: expected a finite number of seconds >= 0")
    asyncio.run(run_demo(args.clients, args.duration_s, args.max_delay_s))


if __name__ == "__main__":
    main()
