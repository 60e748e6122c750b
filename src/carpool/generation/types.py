"""Typed values that pass between the generation stages (scheduler → runner → engine).

One engine step::

    Scheduler.schedule() ──▶ ScheduleResult(StepInput(chunks)) ──▶ ModelRunner.execute()
         ▲                                                                  │
         └─────── Scheduler.update_from_output(result, StepOutput) ◀────────┘

A chunk is one sequence's share of the step: a slice of its prompt (prefill, possibly one
of several chunks) or its one newest token (decode). ``start_pos`` is the position of the
chunk's first token, i.e. how many of the sequence's tokens already have K/V in the cache.
``block_table`` lists the physical KV blocks that hold positions ``[0, start_pos +
len(token_ids))``, in order: position ``p`` lives in block ``block_table[p // block_size]``
at slot ``p % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its next token. ``temperature`` below 1e-5 (0 included) is greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's tokens to run this step (see the module docstring)."""

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    needs_logits: bool  # True when the chunk ends at the sequence's newest token: sample
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True, slots=True)
class StepInput:
    """Everything the runner needs for one forward pass."""

    chunks: tuple[SeqChunk, ...]
    finished_seq_ids: tuple[int, ...] = ()  # sequences the runner may forget (RNG state)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """The runner's answer: one sampled token per chunk that ``needs_logits`` (else None)."""

    sampled: tuple[int | None, ...]
    model_time_s: float = 0.0
