"""Settings resolved against a model, and the engine built from them (pool sizing through
the generation service: tests/unit/server/test_generation.py)."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.errors import ConfigError
from carpool.generation.build import GenerationSettings, build_engine, resolve_settings
from carpool.generation.tokenizer import ByteTokenizer
from carpool.generation.types import SamplingParams
from carpool.generation.weights import random_llama

from .test_engine import TINY

TOKENIZER = ByteTokenizer()
CONFIG = {**TINY, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def model() -> Any:
    return random_llama(CONFIG, seed=0)


def test_resolved_settings_fill_what_was_left_to_the_model(model: Any) -> None:
    given = GenerationSettings(block_size=8, max_num_seqs=4, max_num_batched_tokens=2)
    resolved = resolve_settings(model, given)
    assert resolved.max_model_len == 64  # the model's own limit
    assert resolved.num_blocks == 4 * (64 // 8)  # max_num_seqs full-length sequences
    assert resolved.max_num_batched_tokens == 4  # at least one token per sequence
    assert resolve_settings(model, GenerationSettings(max_model_len=10**6)).max_model_len == 64


def test_a_pool_that_cannot_hold_one_sequence_is_refused(model: Any) -> None:
    with pytest.raises(ConfigError, match="at least 4 blocks"):
        resolve_settings(model, GenerationSettings(block_size=16, num_blocks=3))


async def test_the_built_engine_runs_a_step_limited_by_its_settings(model: Any) -> None:
    settings = resolve_settings(model, GenerationSettings(block_size=4, num_blocks=16))
    engine = build_engine("tiny", model, TOKENIZER, settings)
    assert (engine.name, engine.max_model_len) == ("tiny", 64)
    await engine.start()
    try:
        sampling = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        events = [e async for e in engine.generate(TOKENIZER.encode("hi"), sampling)]
    finally:
        await engine.stop()
    assert sum(len(e.token_ids) for e in events) == 4
    stats = engine.snapshot().scheduler
    assert (stats.num_generation_tokens, stats.num_finished, stats.kv_cache_usage) == (4, 1, 0.0)
