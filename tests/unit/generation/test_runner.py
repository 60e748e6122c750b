"""The runner's KV-cache layout: slot mapping, block-table writes, sizes, generator lifetime."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from carpool.generation.runner import ModelRunner
from carpool.generation.types import SamplingParams, SeqChunk, StepInput
from carpool.generation.weights import random_llama

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


@pytest.fixture
def runner() -> ModelRunner:
    return ModelRunner(random_llama(CONFIG, seed=0), num_blocks=6, block_size=2)


def _written(runner: ModelRunner) -> set[tuple[int, int]]:
    """(block, slot in block) pairs whose K in layer 0 is not all zero."""
    k = runner.kv_cache[0, 0]  # [num_blocks, block_size, kv_heads, head_dim]
    return {tuple(ix) for ix in torch.nonzero(k.abs().sum((-1, -2)))[:, :2].tolist()}


def test_tokens_land_in_the_slots_their_block_table_names(runner: ModelRunner) -> None:
    # Seq 0: positions 0,1,2 -> block 4 slots 0,1; block 1 slot 0.
    # Seq 1: position 3 (decode) -> block 2 slot 1 (its cached 0..2 are not rewritten).
    chunks = (
        SeqChunk(0, (5, 6, 7), 0, (4, 1), needs_logits=True),
        SeqChunk(1, (8,), 3, (0, 2), needs_logits=True),
    )
    runner.execute(StepInput(chunks))
    assert _written(runner) == {(4, 0), (4, 1), (1, 0), (2, 1)}


def test_cache_contents_do_not_depend_on_which_blocks(runner: ModelRunner) -> None:
    chunk = SeqChunk(0, (5, 6, 7), 0, (4, 1), needs_logits=True)
    runner.execute(StepInput((chunk,)))
    other = ModelRunner(random_llama(CONFIG, seed=0), num_blocks=6, block_size=2)
    other.execute(StepInput((SeqChunk(0, (5, 6, 7), 0, (0, 3), needs_logits=True),)))
    a = runner.kv_cache[:, :, [4, 1]].flatten(2, 3)[:, :, :3]
    b = other.kv_cache[:, :, [0, 3]].flatten(2, 3)[:, :, :3]
    torch.testing.assert_close(a, b)


def test_bytes_per_token_counts_k_and_v_of_every_layer(runner: ModelRunner) -> None:
    head_dim = 64 // 4
    expected = 2 * 2 * 2 * head_dim * 4  # layers x (K, V) x kv_heads x head_dim x float32
    assert runner.bytes_per_token == expected
    assert ModelRunner.bytes_per_token_of(runner.model, torch.bfloat16) == expected // 2
    assert runner.kv_cache.numel() * 4 == expected * 6 * 2


def test_only_chunks_that_need_logits_get_a_token(runner: ModelRunner) -> None:
    chunks = (
        SeqChunk(0, (5, 6), 0, (0,), needs_logits=False),
        SeqChunk(1, (9,), 0, (1,), needs_logits=True, sampling=SamplingParams(temperature=0)),
    )
    out = runner.execute(StepInput(chunks))
    assert out.sampled[0] is None
    assert isinstance(out.sampled[1], int)
    assert out.model_time_s > 0


def test_an_empty_step_returns_nothing(runner: ModelRunner) -> None:
    assert runner.execute(StepInput(())).sampled == ()


def test_a_short_block_table_is_refused(runner: ModelRunner) -> None:
    chunk = SeqChunk(0, (5, 6, 7), 0, (4,), needs_logits=True)
    with pytest.raises(ValueError, match="need 2 blocks of 2, block_table has 1"):
        runner.execute(StepInput((chunk,)))


def test_finished_sequences_drop_their_generators(runner: ModelRunner) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1)
    chunks = tuple(SeqChunk(i, (5,), 0, (i,), True, seeded) for i in range(2))
    runner.execute(StepInput(chunks))
    assert runner.sampler.has_generator(0) and runner.sampler.has_generator(1)
    runner.execute(StepInput((), finished_seq_ids=(0,)))
    assert not runner.sampler.has_generator(0)
    assert runner.sampler.has_generator(1)


def test_seeded_request_samples_the_same_alone_and_batched() -> None:
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=7)
    prompt = (3, 1, 4, 1, 5, 9, 2, 6)

    def run(batched: bool) -> list[int]:
        runner = ModelRunner(random_llama(CONFIG, seed=0), num_blocks=16, block_size=4)
        tokens = list(prompt)
        for _ in range(5):
            start = 0 if len(tokens) == len(prompt) else len(tokens) - 1
            chunks = [SeqChunk(0, tuple(tokens[start:]), start, (0, 1, 2), True, seeded)]
            if batched:
                other = SamplingParams(temperature=0.9)
                chunks.append(
                    SeqChunk(1, (7, 7, 7), 0, (8 + len(tokens) - len(prompt),), True, other)
                )
            token = runner.execute(StepInput(tuple(chunks))).sampled[0]
            assert token is not None
            tokens.append(token)
        return tokens[len(prompt) :]

    assert run(batched=False) == run(batched=True)
