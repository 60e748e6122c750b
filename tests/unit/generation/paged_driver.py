"""A minimal engine for the model tests: blocks from a shuffled free list, chunked
prefill and staggered starts, greedy, no scheduler (the scheduler has its own tests)."""

from __future__ import annotations

import random

from carpool.generation.runner import ModelRunner
from carpool.generation.types import SamplingParams, SeqChunk, StepInput

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0)


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    *,
    chunk_size: int | None = None,
    start_steps: list[int] | None = None,
) -> list[list[int]]:
    """A minimal engine: blocks from a shuffled free list, chunked prefill, staggered starts."""
    bs = runner.block_size
    free = list(range(runner.num_blocks))
    random.Random(0).shuffle(free)
    tokens = [list(p) for p in prompts]
    cached = [0] * len(prompts)
    tables: list[list[int]] = [[] for _ in prompts]
    starts = start_steps or [0] * len(prompts)
    step = 0
    while any(len(t) - len(p) < MAX_NEW for t, p in zip(tokens, prompts, strict=True)):
        chunks, active = [], []
        for i, prompt in enumerate(prompts):
            if step < starts[i] or len(tokens[i]) - len(prompt) >= MAX_NEW:
                continue
            end = len(tokens[i])
            if chunk_size is not None:
                end = min(end, cached[i] + chunk_size)
            while len(tables[i]) * bs < end:
                tables[i].append(free.pop())
            ids = tuple(tokens[i][cached[i] : end])
            is_last = end == len(tokens[i])
            chunks.append(SeqChunk(i, ids, cached[i], tuple(tables[i]), is_last, GREEDY))
            active.append(i)
        out = runner.execute(StepInput(tuple(chunks)))
        for i, chunk, token in zip(active, chunks, out.sampled, strict=True):
            cached[i] += len(chunk.token_ids)
            if token is not None:
                tokens[i].append(token)
        step += 1
    return [t[len(p) :] for t, p in zip(tokens, prompts, strict=True)]
