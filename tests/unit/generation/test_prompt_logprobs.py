"""Prompt log-probabilities against Hugging Face ``transformers``' log-softmax, whole and
in chunks."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from carpool.generation.runner import ModelRunner
from carpool.generation.types import SamplingParams, SeqChunk, StepInput
from carpool.generation.weights import load_model, random_llama, save_hf_folder

from .test_llama import CONFIG

PROMPT = [5, 17, 200, 3, 99, 42, 42, 7, 180, 64, 11]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save_hf_folder(random_llama(CONFIG, seed=3), path)
    return path


def expected(folder: Path, num_top: int) -> tuple[list[float], list[list[int]]]:
    """transformers: each prompt token's log-probability after the ones before it, and
    the ids of the ``num_top`` most likely there."""
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([PROMPT])).logits[0, :-1].float().log_softmax(-1)
    own = logprobs.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0].tolist()
    return own, logprobs.topk(num_top, dim=-1).indices.tolist()


@pytest.mark.parametrize("chunk_size", [len(PROMPT), 4, 3, 1])
def test_each_prompt_token_after_the_first_has_the_log_probability_transformers_gives(
    folder: Path, chunk_size: int
) -> None:
    runner = ModelRunner(load_model(folder), 8, 4)
    sampling = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    found = []
    for start in range(0, len(PROMPT), chunk_size):
        ids = tuple(PROMPT[start : start + chunk_size])
        is_last = start + len(ids) == len(PROMPT)
        table = tuple(range(-(-(start + len(ids)) // 4)))
        chunk = SeqChunk(0, ids, start, table, is_last, sampling, len(PROMPT))
        output = runner.execute(StepInput((chunk,)))
        found.extend(output.prompt_logprobs[0])
    own, top = expected(folder, 2)
    assert [f.token_id for f in found] == PROMPT[1:]
    torch.testing.assert_close([f.logprob for f in found], own, atol=1e-4, rtol=0)
    assert [[token for token, _ in f.top] for f in found] == top


def test_a_request_without_prompt_logprobs_gets_none(folder: Path) -> None:
    runner = ModelRunner(load_model(folder), 8, 4)
    chunk = SeqChunk(0, tuple(PROMPT), 0, (0, 1, 2), True, SamplingParams(), len(PROMPT))
    assert runner.execute(StepInput((chunk,))).prompt_logprobs == ()


async def test_a_prompt_recomputed_after_a_preemption_has_each_log_probability_once() -> None:
    """A background request is preempted mid-prefill by an interactive one and its prompt
    recomputed from the start, the first chunk of the recompute one token long (the
    step's budget is two tokens): it scores nothing yet, and the log-probabilities of the
    first try must still be dropped, not kept ahead of the recompute's."""
    from carpool.generation.build import GenerationSettings
    from carpool.server.generation import GenerationService

    settings = GenerationSettings(
        num_blocks=4,
        block_size=4,
        max_model_len=16,
        max_num_seqs=2,
        max_num_batched_tokens=2,
        dtype="float64",
        decode_attention="torch",
    )
    service = GenerationService.tiny_random("tiny", settings)
    engine = service.engine
    await engine.start()
    try:
        first = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
        scored = SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1, logprobs=1
        )
        prompt = [256, *range(97, 108)]  # 12 tokens

        async def run(tokens: list[int], params: SamplingParams, priority: str) -> list[Any]:
            return [event async for event in engine.generate(tokens, params, priority)]

        _, events = await asyncio.wait_for(
            asyncio.gather(run([256], first, "interactive"), run(prompt, scored, "background")),
            60,
        )
        assert engine._scheduler.num_preemptions >= 1
        (found,) = [e.prompt_logprobs for e in events if e.prompt_logprobs]
        assert [t.token_id for t in found] == prompt[1:]
    finally:
        await engine.stop()
