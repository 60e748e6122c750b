"""The whole generation core (scheduler + KV-cache manager + block pool + paged runner)
against Hugging Face ``generate(do_sample=False)`` on random-weight Llama and GPT-2.

Token budgets small enough to force chunked prefill, staggered arrivals, a pool small
enough to force preemption, shared prefixes that hit the prefix cache, block sizes 1, 2,
3 and 16 with prompt lengths hitting ``len % block_size`` in {0, 1, block_size - 1}: every
request's greedy output must equal Hugging Face's for that prompt alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from carpool.generation.block_pool import BlockPool
from carpool.generation.kv_cache import KVCacheManager
from carpool.generation.runner import ModelRunner
from carpool.generation.scheduler import Scheduler, SchedulerConfig
from carpool.generation.types import SamplingParams
from carpool.generation.weights import load_model

MAX_NEW = 8
VOCAB = 200
LLAMA = LlamaConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.1,
)  # fmt: skip
GPT2 = GPT2Config(
    vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.1
)


def _folder(tmp_path_factory: pytest.TempPathFactory, kind: str) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LLAMA) if kind == "llama" else GPT2LMHeadModel(GPT2)
    path = tmp_path_factory.mktemp(kind)
    model.eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _folder(tmp_path_factory, request.param)


def _prompts(block_size: int) -> list[list[int]]:
    """Lengths hitting len % block_size in {0, 1, bs - 1}; two share a 2-block prefix."""
    g = torch.Generator().manual_seed(block_size)
    lengths = [2 * block_size, 2 * block_size + 1, 3 * block_size - 1, 1 + block_size, 5]
    prompts = [torch.randint(0, VOCAB, (max(1, n),), generator=g).tolist() for n in lengths]
    shared = prompts[0][: 2 * block_size]
    prompts.append(shared + torch.randint(0, VOCAB, (3,), generator=g).tolist())
    prompts.append(list(prompts[0]))  # the whole prompt again: a full prefix hit
    return prompts


def _reference(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def _serve(
    folder: Path,
    prompts: list[list[int]],
    *,
    block_size: int,
    num_blocks: int,
    max_tokens_per_step: int,
    arrive_every: int,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Run every prompt through the real scheduler and runner; arrivals staggered."""
    runner = ModelRunner(load_model(folder), num_blocks=num_blocks, block_size=block_size)
    pool = BlockPool(num_blocks, block_size)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_tokens_per_step, max_num_seqs=4),
        KVCacheManager(pool),
    )
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    step = added = 0
    while added < len(prompts) or scheduler.has_unfinished():
        if added < len(prompts) and step % arrive_every == 0:
            scheduler.add_request(added, prompts[added], greedy)
            added += 1
        result = scheduler.schedule()
        if not result.is_empty:
            assert result.step_input.num_tokens <= max_tokens_per_step
            for event in scheduler.update_from_output(result, runner.execute(result.step_input)):
                outputs[event.request_id] += list(event.new_token_ids)
        step += 1
        assert step < 10_000, "the scheduler stopped making progress"
    stats = scheduler.stats()
    pool.check_invariants()
    assert pool.num_free == num_blocks  # every block is back once all requests drained
    return [outputs[i] for i in range(len(prompts))], {
        "preemptions": stats.num_preemptions,
        "prefix_hits": stats.num_prefix_cache_hits,
    }


@pytest.mark.parametrize("block_size", [1, 2, 3, 16])
def test_greedy_output_equals_transformers_under_pressure(folder: Path, block_size: int) -> None:
    prompts = _prompts(block_size)
    expected = _reference(folder, prompts)
    # Enough blocks for the longest request alone, too few for all at once.
    longest = max(len(p) for p in prompts) + MAX_NEW
    num_blocks = -(-longest // block_size) + 1
    got, stats = _serve(
        folder, prompts, block_size=block_size, num_blocks=num_blocks,
        max_tokens_per_step=5, arrive_every=2,
    )  # fmt: skip
    assert got == expected
    assert stats["preemptions"] > 0, "the pool was meant to be too small"


def test_prefix_cache_hits_and_roomy_pool_give_the_same_outputs(folder: Path) -> None:
    prompts = _prompts(4)
    expected = _reference(folder, prompts)
    got, stats = _serve(
        folder, prompts, block_size=4, num_blocks=256, max_tokens_per_step=64, arrive_every=3
    )
    assert got == expected
    assert stats["prefix_hits"] > 0 and stats["preemptions"] == 0
    alone = [
        _serve(folder, [p], block_size=4, num_blocks=256, max_tokens_per_step=64,
               arrive_every=1)[0][0]
        for p in prompts[:3]
    ]  # fmt: skip
    assert alone == got[:3]  # the same alone as in a batch
