"""What each sampling option costs a decode step: ``Sampler.sample_chunks`` on one batch of
logits, every row asking for the same thing, against plain greedy in the same run.

    .venv/bin/python benchmarks/bench_sampling.py [--rows 64] [--vocab 32000] [--steps 50]

One torch thread (as the server runs generation on one core); each case is warmed up,
then timed over ``--steps`` calls; the median is reported. Writes
benchmarks/results/sampling.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchlib import RESULTS, machine_info, utc_now, write_results
from carpool.generation.sampling import Sampler
from carpool.generation.types import SamplingParams, SeqChunk

HISTORY = 512  # tokens each sequence holds (prompt 384, output 128): what penalties read
CASES: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.8),
    "top_k_50": SamplingParams(temperature=0.8, top_k=50),
    "top_p_0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "min_p_0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "greedy_repetition_1.1": SamplingParams(temperature=0, repetition_penalty=1.1),
    "greedy_presence_frequency": SamplingParams(
        temperature=0, presence_penalty=0.5, frequency_penalty=0.5
    ),
    "greedy_logit_bias_10": SamplingParams(
        temperature=0, logit_bias=tuple((i, 1.0) for i in range(10))
    ),
    "greedy_logprobs_5": SamplingParams(temperature=0, logprobs=5),
    "vllm_bench_body": SamplingParams(temperature=1.0, repetition_penalty=1.0),
}


def _chunks(rows: int, vocab: int, sampling: SamplingParams) -> list[SeqChunk]:
    g = torch.Generator().manual_seed(0)
    chunks = []
    for i in range(rows):
        history = tuple(torch.randint(0, vocab, (HISTORY,), generator=g).tolist())
        chunks.append(
            SeqChunk(
                seq_id=i, token_ids=history[-1:], start_pos=HISTORY - 1, block_table=(0,),
                needs_logits=True, sampling=sampling, num_prompt_tokens=384,
                history=history if sampling.has_penalties else (),
            )
        )  # fmt: skip
    return chunks


def _time_ms(sampler: Sampler, logits: torch.Tensor, chunks: list[SeqChunk], steps: int) -> float:
    for _ in range(3):
        sampler.sample_chunks(logits, chunks)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        sampler.sample_chunks(logits, chunks)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    machine = machine_info(torch_threads=1)
    print(f"machine: {machine['cpu_model']}, torch {machine['torch']}, 1 thread")
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(1)) * 4
    sampler = Sampler(seed=0)
    results: dict[str, dict[str, float]] = {}
    for name, sampling in CASES.items():
        ms = _time_ms(sampler, logits, _chunks(args.rows, args.vocab, sampling), args.steps)
        results[name] = {"median_ms": round(ms, 3)}
    base = results["greedy"]["median_ms"]
    print(f"{'case':<28} {'ms/step':>9} {'x greedy':>9}")
    for name, row in results.items():
        row["vs_greedy"] = round(row["median_ms"] / base, 2)
        print(f"{name:<28} {row['median_ms']:>9.3f} {row['vs_greedy']:>9.2f}")
    write_results(
        RESULTS / "sampling.json",
        {
            "benchmark": "sampling",
            "when": utc_now(),
            "machine": machine,
            "rows": args.rows,
            "vocab": args.vocab,
            "history_tokens": HISTORY,
            "steps": args.steps,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
