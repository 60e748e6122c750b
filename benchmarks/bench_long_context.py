"""Where a long-context run's time goes: prefill steps against decode steps, and by operator.

The long-context run of ``bench_vs_vllm.py`` without the HTTP server: ``--num-prompts``
random prompts with the lengths ``vllm bench serve --random-input-len 1024
--random-output-len 256 --random-range-ratio 0.9`` draws (input uniform in 102-1946 tokens,
output in 25-487, capped at ``max_model_len`` 2048), all waiting at once, through the
engine's own ``Scheduler`` and ``ModelRunner`` (step budget 1024 tokens, 64 sequences,
blocks of 16), greedy, one CPU thread. Reported: the time of the steps that prefill (a
prompt chunk, with or without decodes beside it) and of the decode-only steps, and with
``--profile`` a second, profiled pass split by operator kind (``bench_decode_step.py``'s
kinds).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_long_context.py --model small --profile
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench_decode_step import KINDS
from bench_generation import MODELS
from bench_prefill_step import BLOCK_SIZE
from benchlib import RESULTS, machine_info, utc_now, write_results
from carpool.generation.block_pool import BlockPool
from carpool.generation.kv_cache import KVCacheManager
from carpool.generation.runner import ModelRunner
from carpool.generation.scheduler import Scheduler, SchedulerConfig
from carpool.generation.types import SamplingParams
from carpool.generation.weights import random_llama

MAX_MODEL_LEN = 2048
INPUT_LENS = (102, 1946)
OUTPUT_LENS = (25, 487)


def run(runner: ModelRunner, num_prompts: int, seed: int = 0) -> dict[str, float]:
    """The whole run once; seconds in prefill and decode-only steps, and their counts."""
    pool = BlockPool(runner.num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    config = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=64)
    scheduler = Scheduler(config, KVCacheManager(pool))
    rng = np.random.default_rng(seed)
    for i in range(num_prompts):
        num_input = int(rng.integers(INPUT_LENS[0], INPUT_LENS[1] + 1))
        num_output = min(int(rng.integers(OUTPUT_LENS[0], OUTPUT_LENS[1] + 1)),
                         MAX_MODEL_LEN - num_input)  # fmt: skip
        prompt = tuple(int(t) for t in rng.integers(2, 1000, num_input))
        sampling = SamplingParams(temperature=0, max_tokens=num_output, ignore_eos=True)
        scheduler.add_request(i, prompt, sampling)
    figures: dict[str, float] = {"prefill_s": 0.0, "decode_s": 0.0}
    figures |= {"prefill_steps": 0, "decode_steps": 0, "output_tokens": 0}
    while scheduler.has_unfinished():
        result = scheduler.schedule()
        started = time.perf_counter()
        output = runner.execute(result.step_input)
        kind = "prefill" if result.num_prefill_tokens else "decode"
        figures[f"{kind}_s"] += time.perf_counter() - started
        figures[f"{kind}_steps"] += 1
        figures["output_tokens"] += sum(t is not None for t in output.sampled)
        scheduler.update_from_output(result, output)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", type=Path, default=RESULTS / "long_context.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    machine = machine_info(torch_threads=torch.get_num_threads())
    print("machine:", machine, flush=True)
    num_blocks = args.num_prompts * MAX_MODEL_LEN // BLOCK_SIZE + 1
    runner = ModelRunner(random_llama(MODELS[args.model], seed=0), num_blocks, BLOCK_SIZE)
    run(runner, 1)  # warm-up
    figures: dict[str, Any] = run(runner, args.num_prompts)
    total_s = figures["prefill_s"] + figures["decode_s"]
    print(
        f"prefill steps {figures['prefill_steps']}: {figures['prefill_s']:.2f} s "
        f"({figures['prefill_s'] / total_s:.0%}); decode-only steps {figures['decode_steps']}: "
        f"{figures['decode_s']:.2f} s; {figures['output_tokens'] / total_s:.0f} output tokens/s",
        flush=True,
    )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(runner, args.num_prompts)
        by_kind: dict[str, float] = {}
        for event in prof.key_averages():
            kind = KINDS.get(event.key, "other")
            by_kind[kind] = by_kind.get(kind, 0.0) + event.self_cpu_time_total / 1e6
        figures["profile_s"] = by_kind
        print(" ".join(f"{k} {v:.2f} s" for k, v in sorted(by_kind.items())), flush=True)
    write_results(
        args.json,
        {"benchmark": "long_context", "date": utc_now(), "machine": machine,
         "model": {**MODELS[args.model], "seed": 0, "dtype": "float32"},
         "num_prompts": args.num_prompts, "figures": figures},
    )  # fmt: skip


if __name__ == "__main__":
    main()
