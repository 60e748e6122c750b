"""Where a decode step's time goes: one engine step of n sequences on one CPU thread.

The 88 M random Llama of issue 26 (hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 2048, vocab 8000, seed 0, float32), or with ``--model small`` the small
folder's (``bench_generation.py``). Each n in ``--batch-sizes`` decodes one token per
sequence with context lengths log-uniform in ``--contexts`` (default [32, 1024]; seed 0:
spread, as a busy server's are), blocks of 16 scattered over the pool. Per n: the step's median time
(``ModelRunner.execute``) over ``--repeats`` steps, its batch set-up alone (``_prepare``:
block tables, positions, slot mapping, attention plan), and with ``--profile`` a
torch.profiler breakdown of the model's time by operator kind:

    kv gather     aten::index, aten::index_select (K/V blocks gathered for attention, and
                  small indexing)
    attention     SDPA (flash attention for CPU), or the C++ kernels
                  (carpool::paged_decode, carpool::paged_prefill) where the tree has them
    kv write      aten::index_copy_ (the step's new K/V into their slots)
    matmul        Linear layers (oneDNN or aten mm/addmm)
    other         norms, rotary, activations, sampling, ...

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_decode_step.py --profile

The machine line and the JSON say which decode attention ran (``decode_attention``:
``kernel`` or ``torch``; ``torch`` for a tree that predates the kernel). It uses only what
every tree has (``ModelRunner``, ``execute``, ``_prepare``), so ``bench_ab.py`` can run it
over two source trees.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench_generation import MODELS
from benchlib import RESULTS, machine_info, serving_malloc, utc_now, write_results
from carpool.generation.runner import ModelRunner
from carpool.generation.types import SamplingParams, SeqChunk, StepInput
from carpool.generation.weights import random_llama

MODEL_88M: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 8000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}
BLOCK_SIZE = 16
MIN_CONTEXT, MAX_CONTEXT = 32, 1024
KINDS = {
    "aten::index": "kv gather",
    "aten::index_select": "kv gather",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "carpool::paged_decode": "attention",
    "carpool::paged_prefill": "attention",
    "aten::index_copy_": "kv write",
    "mkldnn::_linear_pointwise": "matmul",
    "carpool::packed_linear": "matmul",
    "aten::addmm": "matmul",
    "aten::mm": "matmul",
}


def decode_step(
    n: int, seed: int = 0, contexts: tuple[int, int] = (MIN_CONTEXT, MAX_CONTEXT)
) -> tuple[StepInput, int, float]:
    """n decode chunks with spread contexts; the blocks they need; their mean context."""
    rng = np.random.default_rng(seed)
    lengths = np.rint(np.exp(rng.uniform(math.log(contexts[0]), math.log(contexts[1]), n)))
    needed = [-(-(int(length) + 1) // BLOCK_SIZE) for length in lengths]
    blocks = rng.permutation(sum(needed)).tolist()
    sampling = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    chunks, used = [], 0
    for i, (length, k) in enumerate(zip(lengths, needed, strict=True)):
        table = tuple(blocks[used : used + k])
        used += k
        chunks.append(SeqChunk(i, (7,), int(length), table, True, sampling))
    return StepInput(tuple(chunks)), sum(needed), float(lengths.mean())


def median_ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def breakdown(runner: ModelRunner, step: StepInput, repeats: int) -> dict[str, float]:
    """Milliseconds per step by operator kind (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            runner.execute(step)
    by_kind: dict[str, float] = {}
    for event in prof.key_averages():
        kind = KINDS.get(event.key, "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + event.self_cpu_time_total / 1e3 / repeats
    return by_kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--model", choices=("88m", "small"), default="88m")
    parser.add_argument("--contexts", default=f"{MIN_CONTEXT},{MAX_CONTEXT}",
                        help="the least and the most context length")  # fmt: skip
    parser.add_argument("--json", type=Path, default=RESULTS / "decode_step.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    malloc = serving_malloc()
    config = MODEL_88M if args.model == "88m" else MODELS["small"]
    low, high = (int(c) for c in args.contexts.split(","))
    model = random_llama(config, seed=0)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    num_blocks = max(decode_step(n, contexts=(low, high))[1] for n in sizes) + 1
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    decode_attention = getattr(runner, "decode_attention_path", "torch")  # older trees: torch
    machine = machine_info(
        torch_threads=torch.get_num_threads(),
        decode_attention=decode_attention,
        generation_linear=runner.linear_path,  # the runner's Linear layers: which kernel ran
        huge_pages=getattr(runner, "huge_pages", "off: not in this tree"),
        elementwise=getattr(runner, "elementwise_path", "torch"),  # older trees: torch
        malloc=malloc,
    )
    print("machine:", machine, flush=True)
    rows = []
    for n in sizes:
        step, _, mean_context = decode_step(n, contexts=(low, high))
        runner.execute(step)  # warm-up
        row: dict[str, Any] = {
            "num_seqs": n,
            "mean_context": mean_context,
            "max_context": max(c.start_pos + 1 for c in step.chunks),
            "step_ms": median_ms(lambda s=step: runner.execute(s), args.repeats),
            "prepare_ms": median_ms(lambda s=step: runner._prepare(s.chunks), args.repeats),
        }
        if args.profile:
            row["profile_ms"] = breakdown(runner, step, args.repeats)
        rows.append(row)
        kinds = " ".join(f"{k} {v:.1f}" for k, v in sorted(row.get("profile_ms", {}).items()))
        print(
            f"n={n:3d} context mean {mean_context:5.0f} max {row['max_context']:5d}: "
            f"step {row['step_ms']:8.1f} ms, prepare {row['prepare_ms']:6.2f} ms  {kinds}",
            flush=True,
        )
    write_results(
        args.json,
        {
            "benchmark": "decode_step",
            "date": utc_now(),
            "machine": machine,
            "model": {**config, "seed": 0, "dtype": "float32", "block_size": BLOCK_SIZE},
            "context_lengths": f"log-uniform in [{low}, {high}], seed 0",
            "decode_attention": decode_attention,
            "repeats": args.repeats,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
