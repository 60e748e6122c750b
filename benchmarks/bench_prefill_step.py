"""Where a prefill step's time goes: one chunk of a long prompt, after a cached prefix.

One engine step that prefills ``n`` tokens of one sequence whose first ``s`` positions are
already in the KV cache (the chunks chunked prefill makes of a long prompt: 1024 at 0,
then the rest at 1024), on one CPU thread, blocks of 16 scattered over the pool. Per case
``n:s`` of ``--cases``: the step's median time (``ModelRunner.execute``) over
``--repeats`` steps and, with ``--profile``, a torch.profiler breakdown by operator kind
(``bench_decode_step.py``'s kinds: attention is SDPA, matmul the Linear layers).

Models: ``bench_generation.py``'s ``small`` (hidden 256, 4 layers, 8 heads, 2 KV heads,
intermediate 688, vocab 2000) and ``88m`` (hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 2048, vocab 8000), the two folders of ``bench_vs_vllm.py``, random weights,
seed 0, float32.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_prefill_step.py --model small --profile

It uses only what every tree has (``ModelRunner.execute``), so ``bench_ab.py`` can run it
over two source trees.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench_decode_step import breakdown, median_ms
from bench_generation import MODELS
from benchlib import RESULTS, machine_info, serving_malloc, utc_now, write_results
from carpool.generation.runner import ModelRunner
from carpool.generation.types import SamplingParams, SeqChunk, StepInput
from carpool.generation.weights import random_llama

BLOCK_SIZE = 16


def prefill_step(n: int, num_cached: int, blocks: list[int], seed: int = 0) -> StepInput:
    """A chunk of ``n`` random tokens from position ``num_cached``, its blocks ``blocks``."""
    rng = np.random.default_rng(seed)
    table = tuple(blocks[: -(-(num_cached + n) // BLOCK_SIZE)])
    tokens = tuple(int(t) for t in rng.integers(2, 1000, n))
    sampling = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return StepInput((SeqChunk(0, tokens, num_cached, table, True, sampling),))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--cases", default="1024:0,512:512,1024:1024,646:1024",
                        help="n:s pairs: n tokens after s cached")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", type=Path, default=RESULTS / "prefill_step.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    malloc = serving_malloc()
    cases = [tuple(int(x) for x in case.split(":")) for case in args.cases.split(",")]
    num_blocks = max(-(-(n + s) // BLOCK_SIZE) for n, s in cases) + 1
    runner = ModelRunner(random_llama(MODELS[args.model], seed=0), num_blocks, BLOCK_SIZE)
    machine = machine_info(
        torch_threads=torch.get_num_threads(),
        generation_linear=runner.linear_path,  # the runner's Linear layers: which kernel ran
        huge_pages=getattr(runner, "huge_pages", "off: not in this tree"),
        elementwise=getattr(runner, "elementwise_path", "torch"),  # older trees: torch
        malloc=malloc,
    )
    print("machine:", machine, flush=True)
    blocks = np.random.default_rng(0).permutation(num_blocks).tolist()
    rows = []
    for n, s in cases:
        step = prefill_step(n, s, blocks)
        runner.execute(step)  # warm-up
        row: dict[str, Any] = {
            "num_tokens": n,
            "num_cached": s,
            "step_ms": median_ms(lambda step=step: runner.execute(step), args.repeats),
        }
        if args.profile:
            row["profile_ms"] = breakdown(runner, step, args.repeats)
        rows.append(row)
        kinds = " ".join(f"{k} {v:.1f}" for k, v in sorted(row.get("profile_ms", {}).items()))
        print(f"{n:5d} tokens after {s:5d}: step {row['step_ms']:8.1f} ms  {kinds}", flush=True)
    write_results(
        args.json,
        {
            "benchmark": "prefill_step",
            "date": utc_now(),
            "machine": machine,
            "model": {
                **MODELS[args.model],
                "seed": 0,
                "dtype": "float32",
                "block_size": BLOCK_SIZE,
            },
            "repeats": args.repeats,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
