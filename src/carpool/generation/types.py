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
    """How one request picks its next token. ``temperature`` below 1e-5 (0 included) is greedy.

    The penalties are vLLM's (``generation/penalties.py``): ``repetition_penalty`` (1.0:
    off) on every token of the prompt and the output, ``presence_penalty`` and
    ``frequency_penalty`` (0: off) on the output's. ``logit_bias`` adds to the logits of
    its ids; ``min_tokens`` holds back the stop token ids and ``eos_token_ids`` (filled by
    the engine) until that many tokens are out. ``logprobs``: None for none, k for the
    sampled token's log-probability and the k most likely alternatives'.
    ``prompt_logprobs``: None for none, k for each prompt token's log-probability after
    the tokens before it (the first token has none) and the k most likely there; such a
    request shares no cached prefix, so every prompt position is computed.
    """

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler needs the sequence's tokens (``SeqChunk.history``)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's tokens to run this step (see the module docstring)."""

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    needs_logits: bool  # True when the chunk ends at the sequence's newest token: sample
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_prompt_tokens: int = 0  # the rest of the sequence is output (min_tokens, penalties)
    history: tuple[int, ...] = ()  # every token so far, when it samples with penalties


@dataclass(frozen=True, slots=True)
class StepInput:
    """Everything the runner needs for one forward pass."""

    chunks: tuple[SeqChunk, ...]
    finished_seq_ids: tuple[int, ...] = ()  # sequences the runner may forget (RNG state)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A sampled token's log-probability under the model (before penalties, bias and
    temperature, as vLLM reports it) and the ``top`` most likely tokens' ``(id, logprob)``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class StepOutput:
    """The runner's answer: one sampled token per chunk that ``needs_logits`` (else None),
    and, where its request asked for them, that token's log-probabilities (``logprobs``
    empty when no chunk asked)."""

    sampled: tuple[int | None, ...]
    model_time_s: float = 0.0
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    # Per chunk, the prompt tokens it scored (``prompt_logprobs``), in order; () when no
    # chunk asked. A chunk scores its own tokens after its first, and its first with the
    # previous chunk's last logits.
    prompt_logprobs: tuple[tuple[TokenLogprobs, ...], ...] = ()
