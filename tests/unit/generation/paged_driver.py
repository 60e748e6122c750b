"""A minimal engine for the model tests: blocks from a shuffled free list, chunked
prefill and staggered starts, greedy, no scheduler (the scheduler has its own tests); and
a step driver that also records each step's logits."""

from __future__ import annotations

import random
from dataclasses import replace

import torch

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


def run_steps(
    runner: ModelRunner,
    chunks: tuple[SeqChunk, ...],
    steps: int,
    *,
    rests: dict[int, tuple[int, ...]] | None = None,
    reference: ModelRunner | None = None,
) -> tuple[dict[int, list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """``steps`` steps from ``chunks`` on ``runner``, each sequence going on with the token
    it sampled, or, for a chunk that samples none, with its prompt's rest from ``rests``
    (then sampling). Returns each sequence's tokens, each step's logits before it samples
    (float32, on the CPU) and, with ``reference``, that runner's logits on the same chunks
    (``runner``'s tokens). A chunk with a ``history`` keeps it up to date."""
    tokens: dict[int, list[int]] = {c.seq_id: [] for c in chunks}
    logits: list[torch.Tensor] = []
    reference_logits: list[torch.Tensor] = []
    for _ in range(steps):
        step = StepInput(chunks)
        logits.append(runner.compute_logits(step).float().cpu())  # the same K/V written again
        if reference is not None:
            reference_logits.append(reference.compute_logits(step).float().cpu())
        following = []
        for chunk, token in zip(chunks, runner.execute(step).sampled, strict=True):
            start = chunk.start_pos + len(chunk.token_ids)
            if token is None:
                rest = (rests or {})[chunk.seq_id]
                following.append(replace(chunk, token_ids=rest, start_pos=start, needs_logits=True))
                continue
            tokens[chunk.seq_id].append(token)
            history = (*chunk.history, token) if chunk.history else ()
            following.append(replace(chunk, token_ids=(token,), start_pos=start, history=history))
        chunks = tuple(following)
    return tokens, logits, reference_logits
