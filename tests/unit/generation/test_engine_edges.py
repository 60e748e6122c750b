"""Edge cases of the whole generation path, judged against vLLM's behaviour.

The engine runs over the real scheduler, KV-cache manager, block pool and a tiny
random-weight Llama (byte tokenizer): a seeded request must not notice preemption, a
failing step returns every block, a bad prompt is refused alone. Top-p filtering and the
scheduler's aborts are driven directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from carpool.errors import InvalidInput, ModelError
from carpool.generation.block_pool import BlockPool
from carpool.generation.engine import GenerationEngine, GenerationEvent
from carpool.generation.kv_cache import KVCacheManager
from carpool.generation.request import FinishReason, RequestStatus
from carpool.generation.runner import ModelRunner
from carpool.generation.sampling import apply_top_k_top_p
from carpool.generation.scheduler import Scheduler, SchedulerConfig
from carpool.generation.tokenizer import ByteTokenizer, Tokenizer
from carpool.generation.types import SamplingParams, StepInput, StepOutput
from carpool.generation.weights import random_llama

from .test_scheduler import make_scheduler, run_to_end

TOKENIZER = ByteTokenizer()
TINY = {
    "model_type": "llama", "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "vocab_size": TOKENIZER.vocab_size,
}  # fmt: skip


class FlakyRunner:
    """A real runner whose step number ``fail_at`` (counted from 1) raises."""

    def __init__(self, runner: ModelRunner, fail_at: int = 0) -> None:
        self.runner = runner
        self.fail_at = fail_at
        self.num_steps = 0

    def execute(self, step: StepInput) -> StepOutput:
        self.num_steps += 1
        if self.num_steps == self.fail_at:
            raise RuntimeError("device lost")
        return self.runner.execute(step)


def _engine(
    num_blocks: int,
    *,
    block_size: int = 4,
    max_tokens_per_step: int = 64,
    fail_at: int = 0,
    tokenizer: Tokenizer = TOKENIZER,
) -> tuple[GenerationEngine, Scheduler, FlakyRunner]:
    model = random_llama(TINY, seed=0)
    runner = FlakyRunner(ModelRunner(model, num_blocks, block_size, prepack=False, seed=0), fail_at)
    config = SchedulerConfig(max_num_batched_tokens=max_tokens_per_step, max_num_seqs=8)
    scheduler = Scheduler(config, KVCacheManager(BlockPool(num_blocks, block_size)))
    engine = GenerationEngine(scheduler, runner, tokenizer, max_model_len=num_blocks * block_size)
    return engine, scheduler, runner


async def _run(engine: GenerationEngine, prompt: Sequence[int], **sampling: object) -> list[int]:
    params = SamplingParams(**{"ignore_eos": True, **sampling})  # type: ignore[arg-type]
    events: list[GenerationEvent] = [e async for e in engine.generate(prompt, params)]
    assert events[-1].finish_reason is FinishReason.LENGTH
    return [t for e in events for t in e.token_ids]


def _assert_all_blocks_free(scheduler: Scheduler) -> None:
    scheduler.kv_cache.check_invariants()
    assert not scheduler.has_unfinished()
    assert scheduler.kv_cache.pool.num_free == scheduler.kv_cache.pool.num_blocks


# -- bugs -----------------------------------------------------------------------------------


async def test_prompt_token_outside_the_vocabulary_is_refused_and_spares_the_batch() -> None:
    engine, scheduler, _ = _engine(num_blocks=32)
    await engine.start()
    try:
        bad = _run(engine, [*b"hi", TOKENIZER.vocab_size], max_tokens=3, temperature=0)
        good = _run(engine, list(b"hello"), max_tokens=3, temperature=0)
        results = await asyncio.gather(bad, good, return_exceptions=True)
        assert isinstance(results[0], InvalidInput)
        assert "prompt[2]=258" in str(results[0])
        assert isinstance(results[1], list) and len(results[1]) == 3
    finally:
        await engine.stop()
    _assert_all_blocks_free(scheduler)


@pytest.mark.parametrize("top_k", [0, 40, 64])
def test_top_p_of_one_filters_nothing(top_k: int) -> None:
    # Tail probabilities below float32's resolution next to 1.0: top_p=1.0 is "off" in
    # vLLM, so every token of the top-k (all of them for top_k=0) keeps its chance.
    logits = torch.linspace(0.0, -30.0, 64)[None, :]
    filtered = apply_top_k_top_p(logits, torch.tensor([top_k]), torch.tensor([1.0]))
    assert int(torch.isfinite(filtered).sum()) == (top_k or 64)


class PoisonTokenizer(ByteTokenizer):
    """Decoding any text that holds the byte 0x07 raises (a detokenizer bug)."""

    def decode(self, token_ids: Sequence[int]) -> str:
        if 0x07 in token_ids:
            raise UnicodeError("cannot decode BEL")
        return super().decode(token_ids)


async def test_a_request_whose_text_cannot_be_made_fails_alone_and_serving_goes_on() -> None:
    engine, scheduler, _ = _engine(num_blocks=32, tokenizer=PoisonTokenizer())
    await engine.start()
    try:
        poisoned = _run(engine, [*b"bell", 0x07], max_tokens=4)
        healthy = _run(engine, list(b"hello"), max_tokens=4)
        results = await asyncio.wait_for(
            asyncio.gather(poisoned, healthy, return_exceptions=True), timeout=30
        )
        assert isinstance(results[0], ModelError) and "BEL" in str(results[0])
        assert isinstance(results[1], list) and len(results[1]) == 4
        assert len(await _run(engine, list(b"later"), max_tokens=3)) == 3
    finally:
        await engine.stop()
    _assert_all_blocks_free(scheduler)


# -- guarded edges (regressions) --------------------------------------------------------------


async def test_seeded_request_gives_the_same_tokens_whether_or_not_it_was_preempted() -> None:
    prompt = list(b"seeded prompt!")
    sampling = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_tokens": 16}
    roomy, _, _ = _engine(num_blocks=64)
    await roomy.start()
    alone = await _run(roomy, prompt, **sampling)
    await roomy.stop()
    # Four copies need 4 x 8 blocks at the end: 14 blocks force preemption by recompute.
    tight, scheduler, _ = _engine(num_blocks=14)
    await tight.start()
    outputs = await asyncio.gather(*(_run(tight, prompt, **sampling) for _ in range(4)))
    await tight.stop()
    assert scheduler.num_preemptions > 0
    assert outputs == [alone] * 4
    _assert_all_blocks_free(scheduler)


async def test_a_failing_step_fails_its_requests_returns_their_blocks_and_serving_goes_on() -> None:
    engine, scheduler, runner = _engine(num_blocks=32, fail_at=3)
    await engine.start()
    try:
        results = await asyncio.gather(
            *(_run(engine, list(b"a prompt"), max_tokens=6) for _ in range(2)),
            return_exceptions=True,
        )
        assert all(isinstance(r, ModelError) and "device lost" in str(r) for r in results)
        assert len(await _run(engine, list(b"later"), max_tokens=4)) == 4
    finally:
        await engine.stop()
    assert runner.num_steps > 3
    _assert_all_blocks_free(scheduler)


def test_aborting_mid_chunked_prefill_and_after_preemption_leaks_no_block() -> None:
    scheduler, runner = make_scheduler(
        num_blocks=8, block_size=4, max_num_batched_tokens=4, max_num_seqs=2
    )
    shared = list(range(10, 18))
    scheduler.add_request(0, [*shared, 1, 2], SamplingParams(max_tokens=16))
    scheduler.add_request(1, [*shared, 3, 4], SamplingParams(max_tokens=16))
    scheduler.add_request(2, list(range(30, 39)), SamplingParams(max_tokens=4))
    preempted: set[int] = set()
    for _ in range(40):  # until request 1 has been preempted and waits to be recomputed
        result = scheduler.schedule()
        preempted |= set(result.preempted_request_ids)
        scheduler.update_from_output(result, runner.execute(result.step_input))
        scheduler.kv_cache.check_invariants()
        request = scheduler.get_request(1)
        if 1 in preempted and request is not None and request.status is RequestStatus.PREEMPTED:
            break
    else:
        pytest.fail("request 1 was never preempted")
    scheduler.finish_request(1, FinishReason.ABORT)
    scheduler.kv_cache.check_invariants()
    result = scheduler.schedule()  # request 2 starts a chunked prefill of its 9 tokens
    assert [c.needs_logits for c in result.step_input.chunks if c.seq_id == 2] == [False]
    scheduler.update_from_output(result, runner.execute(result.step_input))
    scheduler.finish_request(2, FinishReason.ABORT)
    scheduler.kv_cache.check_invariants()
    run_to_end(scheduler, runner)
    _assert_all_blocks_free(scheduler)
