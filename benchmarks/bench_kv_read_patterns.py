"""How fast one core reads a decode step's KV cache, by the order it reads it in: what
bounds the decode attention kernel (``csrc/paged_decode.cpp``), measured apart from its
arithmetic.

The cache is the 88 M model's (4 KV heads of 64 floats, blocks of 16 tokens, 12 layers,
float32, on huge pages where Linux has them, as the runner keeps it), with ``--seqs``
sequences of contexts uniform in ``--contexts`` (seed 0) whose blocks are scattered over
the pool, as a busy server's are. Each pattern reads every layer's K and V of every
sequence's context once (summing them, so nothing is skipped) in one order:

    per_head              per (sequence, KV head), each block's 16 rows of that head:
                          256 B every 1 KiB (the kernel's task order)
    per_head_prefetch     the same, with the next block's rows of the head prefetched
    head_major            per (sequence, KV head), a 4 KiB run per block: what a block laid
                          out head by head ([kv_heads, block, D]) would give
    head_major_prefetch   the same, with the next block's run prefetched
    whole_block           per sequence, each block's K then its V front to back, 16 KiB
                          each (all heads together)
    whole_block_prefetch  the same, with the next block prefetched

against the decode kernel itself on the same cache (``kernel``), the kernel with every
sequence's blocks the same few (in cache: ``kernel_hot``, its arithmetic alone), and
torch's sum over each layer's whole cache in address order (``sequential``). Reported:
median ms per step (12 layers) over ``--repeats``, and GB/s of what each reads (the
kernel: the contexts' K/V; the patterns: their whole blocks; the sum: the whole pool).

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/bench_kv_read_patterns.py

The patterns are compiled with ``torch.utils.cpp_extension.load_inline`` (the compiler
the kernels use); where that fails, the script says why and measures the kernel only.
Writes benchmarks/results/kv_read_patterns.json.
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

KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 4, 64, 16, 12

SOURCE = r"""
#include <torch/extension.h>

namespace {
constexpr int64_t kLine = 16;  // floats in 64 bytes

// Sums `count` floats from p, a cache line at a time (16 independent sums, no gather).
inline void add_run(float* acc, const float* p, int64_t count) {
  for (int64_t i = 0; i < count; i += kLine) {
#pragma omp simd
    for (int64_t j = 0; j < kLine; ++j) acc[j] += p[i + j];
  }
}

inline void prefetch_run(const float* p, int64_t count) {
  for (int64_t i = 0; i < count; i += kLine) __builtin_prefetch(p + i, 0, 2);
}
}  // namespace

// mode: 0 per_head, 1 head_major, 2 whole_block; prefetch: the next block's part too.
double read_pattern(torch::Tensor k, torch::Tensor v, torch::Tensor table, torch::Tensor lens,
                    int64_t mode, bool prefetch) {
  const float* K = k.data_ptr<float>();
  const float* V = v.data_ptr<float>();
  const int64_t* ids_all = table.data_ptr<int64_t>();
  const int64_t* lengths = lens.data_ptr<int64_t>();
  const int64_t n = table.size(0), max_blocks = table.size(1);
  const int64_t B = k.size(1), H = k.size(2), D = k.size(3);
  const int64_t token = H * D, block = B * token;
  alignas(64) float acc[kLine] = {};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t num_blocks = (lengths[i] + B - 1) / B;
    const int64_t* ids = ids_all + i * max_blocks;
    if (mode == 2) {
      for (int64_t b = 0; b < num_blocks; ++b) {
        if (prefetch && b + 1 < num_blocks) {
          prefetch_run(K + ids[b + 1] * block, block);
          prefetch_run(V + ids[b + 1] * block, block);
        }
        add_run(acc, K + ids[b] * block, block);
        add_run(acc, V + ids[b] * block, block);
      }
      continue;
    }
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t b = 0; b < num_blocks; ++b) {
        // head_major: the head's rows as one run of B * D floats at h * B * D
        const int64_t at = mode == 1 ? h * B * D : h * D;
        const int64_t rows = mode == 1 ? 1 : B, stride = mode == 1 ? 0 : token;
        const int64_t run = mode == 1 ? B * D : D;
        for (int64_t r = 0; r < rows; ++r) {
          if (prefetch && b + 1 < num_blocks) {
            prefetch_run(K + ids[b + 1] * block + at + r * stride, run);
            prefetch_run(V + ids[b + 1] * block + at + r * stride, run);
          }
          add_run(acc, K + ids[b] * block + at + r * stride, run);
          add_run(acc, V + ids[b] * block + at + r * stride, run);
        }
      }
    }
  }
  double total = 0;
  for (float x : acc) total += x;
  return total;
}
"""

PATTERNS = {
    "per_head": (0, False),
    "per_head_prefetch": (0, True),
    "head_major": (1, False),
    "head_major_prefetch": (1, True),
    "whole_block": (2, False),
    "whole_block_prefetch": (2, True),
}


def build_patterns() -> Any:
    """The compiled ``read_pattern`` (raises what the compiler or loader raised)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "carpool_kv_read_patterns",
        [SOURCE],
        functions=["read_pattern"],
        extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--contexts", default="128,256", help="least,most context length")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, default=RESULTS / "kv_read_patterns.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    low, high = (int(x) for x in args.contexts.split(","))
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(low, high + 1, (args.seqs,), generator=generator)
    blocks_per = (lengths + BLOCK - 1) // BLOCK
    used = int(blocks_per.sum())
    num_blocks = used + 64
    order = torch.randperm(num_blocks, generator=generator)[:used]
    table = torch.zeros(args.seqs, int(blocks_per.max()), dtype=torch.long)
    hot_table = torch.zeros_like(table)
    start = 0
    for i, count in enumerate(blocks_per.tolist()):
        table[i, :count] = order[start : start + count]
        hot_table[i, :count] = torch.arange(count)
        start += count
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = []
    for _ in range(LAYERS):
        pair = []
        for _ in range(2):
            tensor, pages = huge_pages.placed_zeros(shape, torch.float32)
            tensor.normal_(generator=generator)
            pair.append(tensor)
        caches.append(pair)
    token_bytes = KV_HEADS * HEAD_DIM * 4 * 2 * LAYERS  # K and V of one token, every layer
    context_bytes = int(lengths.sum()) * token_bytes  # what the kernel reads
    block_bytes = used * BLOCK * token_bytes  # the patterns read whole blocks
    cache_bytes = num_blocks * BLOCK * token_bytes  # the sum reads the whole pool
    query = torch.randn(args.seqs, 3 * KV_HEADS, HEAD_DIM, generator=generator)
    build = load_kernel()
    machine = machine_info(torch_threads=1, huge_pages=pages, decode_kernel=build.is_available)
    print("machine:", machine, flush=True)
    steps: dict[str, Callable[[], object]] = {
        "sequential": lambda: [(k.sum(), v.sum()) for k, v in caches],
    }
    if build.is_available:
        steps["kernel"] = lambda: [
            torch.ops.carpool.paged_decode(query, k, v, table, lengths, 0.125) for k, v in caches
        ]
        k0, v0 = caches[0]
        steps["kernel_hot"] = lambda: [
            torch.ops.carpool.paged_decode(query, k0, v0, hot_table, lengths, 0.125) for _ in caches
        ]
    notes = []
    try:
        module = build_patterns()
        for name, (mode, prefetch) in PATTERNS.items():
            steps[name] = lambda mode=mode, prefetch=prefetch: [
                module.read_pattern(k, v, table, lengths, mode, prefetch) for k, v in caches
            ]
    except Exception as error:  # no compiler here: the kernel's figures alone
        notes.append(f"patterns not built: {type(error).__name__}: {str(error)[-300:]}")
        print(notes[-1], flush=True)
    rows: list[dict[str, Any]] = []
    for name, step in steps.items():
        step()  # warm-up
        ms = median_ms(step, args.repeats)
        read = {"sequential": cache_bytes}.get(
            name, context_bytes if "kernel" in name else block_bytes
        )
        rows.append({"pattern": name, "ms": ms, "bytes": read, "gb_per_s": read / ms / 1e6})
        print(f"{name:22s} {ms:8.2f} ms  {read / ms / 1e6:6.1f} GB/s", flush=True)
    write_results(
        args.json,
        {
            "benchmark": "kv_read_patterns",
            "date": utc_now(),
            "machine": machine,
            "seqs": args.seqs,
            "contexts": f"uniform in [{low}, {high}], seed 0",
            "cache": {
                "kv_heads": KV_HEADS,
                "head_dim": HEAD_DIM,
                "block_size": BLOCK,
                "layers": LAYERS,
                "dtype": "float32",
            },
            "context_mb": context_bytes / 1e6,
            "repeats": args.repeats,
            "notes": notes,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
