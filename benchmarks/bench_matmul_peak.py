"""What one core's float32 matmul reaches: oneDNN's prepacked Linear (the kernel carpool's
generation and W1 use) at the 88 M Llama's shapes, in GFLOP/s, against a square product.

The roofline for the generation comparisons (docs/benchmarks.md): a decode step of n
sequences multiplies n rows by each weight, so its matmul time cannot go below its FLOPs
over this peak whoever schedules it. One torch thread; each shape runs ``--repeats``
times after a warm-up, the median kept.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/bench_matmul_peak.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchlib import RESULTS, machine_info, utc_now, write_results
from carpool.models import onednn

# (rows, in, out): square products, then the 88 M model's Linear layers at 64 and 8 rows
# (fused QKV 768 -> 1280, output 768 -> 768, gate+up 768 -> 4096, down 2048 -> 768, the
# LM head 768 -> 8000) and a 1024-row prefill chunk.
SHAPES = [
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (64, 768, 1280),
    (64, 768, 768),
    (64, 768, 4096),
    (64, 2048, 768),
    (64, 768, 8000),
    (8, 768, 4096),
    (1024, 768, 4096),
]


def gflops(rows: int, k: int, n: int, repeats: int) -> float:
    x, weight = torch.randn(rows, k), torch.randn(n, k)
    packed = onednn.reorder_weight(weight) if onednn.can_prepack(torch.float32) else None

    def run() -> None:
        if packed is None:
            torch.nn.functional.linear(x, weight)
        else:
            onednn.linear(x, packed, None)

    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 2 * rows * k * n / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=RESULTS / "matmul_peak.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    kernel = onednn.kernel_name(onednn.can_prepack(torch.float32))
    machine = machine_info(torch_threads=1, linear=kernel)
    print("machine:", machine, flush=True)
    rows = []
    for m, k, n in SHAPES:
        rate = gflops(m, k, n, args.repeats)
        rows.append({"rows": m, "in": k, "out": n, "gflops": rate})
        print(f"{m:5d} x {k:5d} -> {n:5d}: {rate:6.1f} GFLOP/s ({kernel})", flush=True)
    write_results(
        args.json,
        {
            "benchmark": "matmul_peak",
            "date": utc_now(),
            "machine": machine,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
