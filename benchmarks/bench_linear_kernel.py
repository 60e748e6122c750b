"""The generation runner's Linear layers, one kernel against the other: carpool's packed
kernel (``csrc/packed_linear.cpp``) and oneDNN's prepacked one (torch's private mkldnn ops,
which the runner used before), on the 88 M model's weights; and carpool's kernel with its
packed weights on 2 MiB pages (``carpool.generation.huge_pages``, as the runner keeps them
where Linux has transparent huge pages) against 4 KiB ones.

Per row count, one "step" runs the four Linear layers of each of the model's 12 layers in
turn (qkv, o, gate/up, down; the LM head apart), 75.5 M float32 weights, 302 MB: more than
any cache, so with few rows the step reads the weights from memory, as a decode step does.
Reported per row count: each kernel's median step, the weights read per second,
carpool/oneDNN and huge/4 KiB pages. For scale, what one core reads from memory (torch's
sum over 400 MB, median of 5, on either kind of page) is measured in the same run. One
thread; medians of ``--repeats`` steps after a warm-up; at each row count the three run
in turn (oneDNN, carpool on huge pages, carpool on 4 KiB pages).

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/bench_linear_kernel.py \\
        [--rows 1,4,8,16,64,256,1024]

Writes benchmarks/results/linear_kernel.json.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench_decode_step import median_ms
from benchlib import RESULTS, machine_info, utc_now, write_results
from carpool.generation import huge_pages
from carpool.generation.paged_decode import load_kernel
from carpool.models import onednn

HIDDEN, INNER, LAYERS = 768, 2048, 12
Q, KV = 768, 256  # 12 heads of 64; 4 KV heads
# (inputs, outputs) of one layer's Linears, as carpool's Llama fuses them
SHAPES = [(HIDDEN, Q + 2 * KV), (Q, HIDDEN), (HIDDEN, 2 * INNER), (INNER, HIDDEN)]


def _median_s(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up
    return median_ms(step, repeats) / 1e3


def memory_read_gbs(repeats: int = 5, huge: bool = False) -> float:
    """What one core reads from memory: torch's sum over 400 MB of float32 (on huge pages
    where ``huge`` and they apply), GB/s. (NumPy's pairwise sum, used before, tops out
    at about 23 GB/s here whatever the pages: its adds, not the memory, set the pace.)"""
    size = 100_000_000
    data = huge_pages.zeros((size,), torch.float32) if huge else torch.zeros(size)
    data += 1  # every page touched before timing
    return data.nbytes / _median_s(lambda: float(data.sum()), repeats) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,4,8,16,64,256,1024")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, default=RESULTS / "linear_kernel.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    build = load_kernel()
    if not build.is_available:
        raise SystemExit(f"the carpool kernels did not build: {build.reason}")
    if not onednn.can_prepack(torch.float32):
        raise SystemExit("oneDNN's prepacked Linear is not available here: nothing to compare")
    machine = machine_info(torch_threads=1, huge_pages=huge_pages.setting())
    print("machine:", machine, flush=True)
    generator = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(n, k, generator=generator) * 0.02 for _ in range(LAYERS) for k, n in SHAPES
    ]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    ours_small = [torch.ops.carpool.pack_linear(w) for w in weights]  # 4 KiB pages
    ours = [huge_pages.copy_of(packed) for packed in ours_small]  # 2 MiB where they apply
    theirs = [onednn.reorder_weight(w) for w in weights]
    read_gbs, read_huge_gbs = memory_read_gbs(), memory_read_gbs(huge=True)
    print(
        f"weights {nbytes / 1e6:.0f} MB; one core reads {read_gbs:.1f} GB/s from memory "
        f"({read_huge_gbs:.1f} on huge pages: {huge_pages.setting()})"
    )
    rows_out: list[dict[str, Any]] = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=generator) for k in {k for k, _ in SHAPES}}

        def carpool_step(
            xs: dict[int, torch.Tensor] = xs, packs: list[torch.Tensor] = ours
        ) -> None:
            for w, packed in zip(weights, packs, strict=True):
                torch.ops.carpool.packed_linear(xs[w.shape[1]], packed, None, w.shape[0])

        def onednn_step(xs: dict[int, torch.Tensor] = xs) -> None:
            for w, packed in zip(weights, theirs, strict=True):
                onednn.linear(xs[w.shape[1]], packed, None)

        repeats = args.repeats if rows <= 64 else max(3, args.repeats // 3)
        with torch.inference_mode():
            theirs_s = _median_s(onednn_step, repeats)
            ours_s = _median_s(carpool_step, repeats)
            small_s = _median_s(lambda: carpool_step(packs=ours_small), repeats)
        row = {
            "rows": rows,
            "onednn_ms": round(theirs_s * 1e3, 2),
            "carpool_ms": round(ours_s * 1e3, 2),
            "onednn_weights_gbs": round(nbytes / theirs_s / 1e9, 1),
            "carpool_weights_gbs": round(nbytes / ours_s / 1e9, 1),
            "carpool_over_onednn": round(ours_s / theirs_s, 3),
            "carpool_4k_pages_ms": round(small_s * 1e3, 2),
            "huge_over_4k_pages": round(ours_s / small_s, 3),
        }
        rows_out.append(row)
        print(
            f"{rows:5d} rows: oneDNN {row['onednn_ms']:8.2f} ms ({row['onednn_weights_gbs']:5.1f}"
            f" GB/s of weights), carpool {row['carpool_ms']:8.2f} ms "
            f"({row['carpool_weights_gbs']:5.1f} GB/s): {row['carpool_over_onednn']:.3f}x; "
            f"4 KiB pages {row['carpool_4k_pages_ms']:8.2f} ms: huge/4 KiB "
            f"{row['huge_over_4k_pages']:.3f}x",
            flush=True,
        )
    write_results(
        args.json,
        {
            "benchmark": "linear_kernel",
            "date": utc_now(),
            "machine": machine,
            "weights_mb": round(nbytes / 1e6, 1),
            "memory_read_gbs": round(read_gbs, 1),
            "memory_read_huge_pages_gbs": round(read_huge_gbs, 1),
            "huge_pages": huge_pages.setting(),
            "repeats": args.repeats,
            "rows": rows_out,
        },
    )


if __name__ == "__main__":
    main()
