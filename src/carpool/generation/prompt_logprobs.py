"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``): each prompt token's
log-probability after the tokens before it, computed while the prompt is prefilled.

The logits at position p score the token at p + 1. A chunk of a prompt ``P`` tokens long
covers positions [start, end); its rows up to position P - 2 are scored (the row at P - 1
samples the first output token)::

    prompt       t0  t1  t2  t3 | t4  t5  t6      P = 7, chunks [0, 4) and [4, 7)
    chunk 1 rows  0   1   2   3                   rows 0-2 score t1-t3; row 3's
                                                  log-probabilities wait for t4
    chunk 2 rows                  4   5  (6)      the waiting row scores t4, rows
                                                  4-5 score t5-t6; row 6 samples

t0 has no log-probability (nothing comes before it). A prompt recomputed after a
preemption is scored again from position 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch

from carpool.generation.sampling import token_logprobs
from carpool.generation.types import SeqChunk, TokenLogprobs


def num_scored_rows(chunk: SeqChunk) -> int:
    """How many of ``chunk``'s rows (from its first) give prompt log-probabilities."""
    if chunk.sampling.prompt_logprobs is None:
        return 0
    return max(0, min(len(chunk.token_ids), chunk.num_prompt_tokens - 1 - chunk.start_pos))


class PromptScorer:
    """Turns the logits of the scored rows into each chunk's prompt log-probabilities;
    keeps the last row of a chunk whose prompt goes on in the next one."""

    def __init__(self) -> None:
        self._waiting: dict[int, torch.Tensor] = {}  # seq id -> logits [V] of its last row

    def score(
        self, chunks: Sequence[SeqChunk], logits: torch.Tensor | None
    ) -> tuple[tuple[TokenLogprobs, ...], ...]:
        """``logits`` [sum of ``num_scored_rows``, V], the chunks' scored rows in order
        (None: none) -> per chunk, the prompt tokens it scored (``StepOutput``)."""
        found: list[tuple[TokenLogprobs, ...]] = []
        offset = 0
        for chunk in chunks:
            params = chunk.sampling
            if params.prompt_logprobs is None or chunk.start_pos >= chunk.num_prompt_tokens:
                found.append(())
                continue
            num_rows = num_scored_rows(chunk)
            parts: list[torch.Tensor] = []
            tokens: list[int] = []
            waiting = self._waiting.pop(chunk.seq_id, None) if chunk.start_pos else None
            if waiting is not None:  # the previous chunk's last row scores this one's first
                parts.append(waiting[None])
                tokens.append(chunk.token_ids[0])
            if num_rows and logits is not None:
                rows = logits[offset : offset + num_rows]
                offset += num_rows
                tokens.extend(chunk.token_ids[1 : num_rows + 1])
                if num_rows == len(chunk.token_ids):  # the prompt goes on in the next chunk
                    self._waiting[chunk.seq_id] = rows[-1].clone()
                    rows = rows[:-1]
                parts.append(rows)
            if not tokens:
                found.append(())
                continue
            asking = dataclasses.replace(params, logprobs=params.prompt_logprobs)
            scored = token_logprobs(torch.cat(parts), tokens, [asking] * len(tokens))
            found.append(tuple(s for s in scored if s is not None))
        return tuple(found)

    def forget(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._waiting.pop(seq_id, None)
