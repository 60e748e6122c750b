"""The generation scheduler, driven step by step with a fake runner.

The fake runner keeps a fake KV cache: each position's token id, stored at its slot of the
block its chunk's ``block_table`` names. To sample, it reads the whole sequence back
through the block table and returns ``next_token(sequence)``, so a wrong table, a wrong
prefix hit, or a lost block after preemption changes the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import event as note_event
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.errors import InvalidInput, ModelError
from carpool.generation.block_pool import BlockPool
from carpool.generation.kv_cache import KVCacheManager
from carpool.generation.request import FinishReason, RequestEvent, RequestStatus
from carpool.generation.scheduler import (
    Scheduler,
    SchedulerConfig,
    ScheduleResult,
)
from carpool.generation.types import SamplingParams, StepInput, StepOutput

NextToken = Callable[[Sequence[int]], int]


def mix_token(sequence: Sequence[int]) -> int:
    """A deterministic next token that depends on every token and its position."""
    return 10 + sum((i + 1) * t for i, t in enumerate(sequence)) % 89


def reference_output(prompt: Sequence[int], max_tokens: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(max_tokens):
        sequence.append(mix_token(sequence))
    return sequence[len(prompt) :]


@dataclass
class FakeRunner:
    pool: BlockPool
    next_token: NextToken = mix_token
    kv: dict[tuple[int, int], int] = field(default_factory=dict)  # (block, slot) -> token

    def execute(self, step: StepInput) -> StepOutput:
        size = self.pool.block_size
        sampled: list[int | None] = []
        for chunk in step.chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            assert len(chunk.block_table) == -(-end // size)
            for pos, token_id in enumerate(chunk.token_ids, start=chunk.start_pos):
                block_id = chunk.block_table[pos // size]
                assert self.pool.ref_count(block_id) == 1, "wrote into a shared block"
                self.kv[block_id, pos % size] = token_id
            if chunk.needs_logits:
                sequence = [self.kv[chunk.block_table[p // size], p % size] for p in range(end)]
                sampled.append(self.next_token(sequence))
            else:
                sampled.append(None)
        return StepOutput(tuple(sampled))


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    long_prefill_token_threshold: int = 0,
    next_token: NextToken = mix_token,
) -> tuple[Scheduler, FakeRunner]:
    pool = BlockPool(num_blocks, block_size)
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    scheduler = Scheduler(config, KVCacheManager(pool))
    return scheduler, FakeRunner(pool, next_token)


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[ScheduleResult, list[RequestEvent]]:
    result = scheduler.schedule()
    events = scheduler.update_from_output(result, runner.execute(result.step_input))
    scheduler.kv_cache.check_invariants()
    return result, events


def run_to_end(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int = 500
) -> tuple[dict[int, list[int]], dict[int, RequestEvent], list[ScheduleResult]]:
    outputs: dict[int, list[int]] = {}
    finals: dict[int, RequestEvent] = {}
    results: list[ScheduleResult] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs, finals, results
        result, events = step(scheduler, runner)
        results.append(result)
        for event in events:
            outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.is_finished:
                assert event.request_id not in finals
                finals[event.request_id] = event
    raise AssertionError(f"still unfinished after {max_steps} steps")


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    scheduler.kv_cache.check_invariants()
    assert not scheduler.has_unfinished()
    assert scheduler.kv_cache.pool.num_free == scheduler.kv_cache.pool.num_blocks


def chunk_shapes(result: ScheduleResult) -> list[tuple[int, int, bool]]:
    """(request id, tokens, needs_logits) of each chunk, in order."""
    return [(c.seq_id, len(c.token_ids), c.needs_logits) for c in result.step_input.chunks]


# -- ordering, budgets, chunked prefill ------------------------------------------------------


def test_running_decodes_come_first_and_prefill_takes_the_rest() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(1, [1, 2, 3])
    scheduler.add_request(2, [4, 5, 6])
    assert chunk_shapes(step(scheduler, runner)[0]) == [(1, 3, True), (2, 3, True)]
    scheduler.add_request(3, list(range(20)))
    shapes = [chunk_shapes(step(scheduler, runner)[0]) for _ in range(3)]
    assert shapes == [
        [(1, 1, True), (2, 1, True), (3, 8, False)],
        [(1, 1, True), (2, 1, True), (3, 8, False)],
        [(1, 1, True), (2, 1, True), (3, 4, True)],
    ]


def test_higher_class_prefill_leaves_room_for_running_decodes() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(1, [1, 2, 3])
    scheduler.add_request(2, [4, 5, 6])
    step(scheduler, runner)
    scheduler.add_request(3, list(range(30)), class_name="interactive")
    step(scheduler, runner)  # admitted after the decodes
    # Now running order is 3 (interactive) first, yet its chunk leaves 2 tokens for decodes.
    result, events = step(scheduler, runner)
    assert chunk_shapes(result) == [(3, 8, False), (1, 1, True), (2, 1, True)]
    assert {e.request_id for e in events} == {1, 2}
    assert result.step_input.num_tokens == 10


def test_chunked_prefill_keeps_decoding_every_step() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(1, [1, 2], SamplingParams(max_tokens=20))
    step(scheduler, runner)
    request = scheduler.add_request(2, list(range(1, 41)), SamplingParams(max_tokens=2))
    num_prefill_steps = 0
    while request.num_output_tokens == 0:
        result, events = step(scheduler, runner)
        num_prefill_steps += 1
        assert [e.request_id for e in events if e.request_id == 1] == [1]  # a token each step
        assert result.step_input.num_tokens <= 8
    assert num_prefill_steps == 6  # 40 prompt tokens, 7 a step


def test_long_prefill_threshold_caps_each_chunk() -> None:
    scheduler, runner = make_scheduler(long_prefill_token_threshold=5)
    scheduler.add_request(1, list(range(12)))
    shapes = [chunk_shapes(step(scheduler, runner)[0]) for _ in range(3)]
    assert shapes == [[(1, 5, False)], [(1, 5, False)], [(1, 2, True)]]


def test_seq_cap_limits_running_requests() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=2)
    for request_id in range(4):
        scheduler.add_request(request_id, [1, 2])
    result, _ = step(scheduler, runner)
    assert [c.seq_id for c in result.step_input.chunks] == [0, 1]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 2)


# -- priorities -----------------------------------------------------------------------------


def test_waiting_requests_are_admitted_by_class_then_arrival() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=1)
    scheduler.add_request(1, [1], SamplingParams(max_tokens=1), class_name="background")
    scheduler.add_request(2, [1], SamplingParams(max_tokens=1))
    scheduler.add_request(3, [1], SamplingParams(max_tokens=1), class_name="interactive")
    scheduler.add_request(4, [1], SamplingParams(max_tokens=1))
    order = [step(scheduler, runner)[0].step_input.chunks[0].seq_id for _ in range(4)]
    assert order == [3, 2, 4, 1]


# -- held requests (the engine's back-pressure) -------------------------------------------


def test_a_held_request_sits_out_the_steps_and_resumes_with_its_output_unchanged() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(1, [1, 2], SamplingParams(max_tokens=6))
    scheduler.add_request(2, [3, 4], SamplingParams(max_tokens=6))
    outputs: dict[int, list[int]] = {1: [], 2: []}

    def take(events: list[RequestEvent]) -> list[int]:
        for event in events:
            outputs[event.request_id].extend(event.new_token_ids)
        return [e.request_id for e in events]

    assert take(step(scheduler, runner)[1]) == [1, 2]
    num_free = scheduler.kv_cache.pool.num_free
    scheduler.hold(1)
    assert scheduler.stats().num_held == 1
    for _ in range(2):
        assert take(step(scheduler, runner)[1]) == [2]  # 1 sits out, keeping its blocks
    assert scheduler.kv_cache.pool.num_free <= num_free
    scheduler.hold(1, held=False)
    more, _, _ = run_to_end(scheduler, runner)
    for request_id, tokens in more.items():
        outputs[request_id].extend(tokens)
    assert outputs == {1: reference_output([1, 2], 6), 2: reference_output([3, 4], 6)}
    assert scheduler.stats().num_held == 0
    assert_all_blocks_free(scheduler)


def test_a_step_with_every_request_held_is_empty() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(1, [1, 2], SamplingParams(max_tokens=6))
    step(scheduler, runner)
    scheduler.hold(1)
    assert scheduler.schedule().is_empty
    assert scheduler.has_unfinished()


def test_a_held_waiting_request_does_not_stop_admission_behind_it() -> None:
    """A preempted request whose reader is behind waits at the front of its class; those
    behind it are admitted past it, and it comes back when let in."""
    scheduler, runner = make_scheduler(max_num_seqs=1)
    scheduler.add_request(1, [1, 2], SamplingParams(max_tokens=1))
    scheduler.add_request(2, [3, 4], SamplingParams(max_tokens=1))
    scheduler.hold(1)
    result, _ = step(scheduler, runner)
    assert [c.seq_id for c in result.step_input.chunks] == [2]
    assert scheduler.get_request(1) is not None and scheduler.num_waiting == 1
    assert scheduler.schedule().is_empty
    scheduler.hold(1, held=False)
    _, finals, _ = run_to_end(scheduler, runner)
    assert list(finals) == [1]
    assert_all_blocks_free(scheduler)


def test_a_held_request_takes_no_seat_from_a_waiting_one() -> None:
    """Was (with the hold): a client that stopped reading kept its running request's seat
    of max_num_seqs for as long as it stayed connected, and the waiting ones out."""
    scheduler, runner = make_scheduler(max_num_seqs=1)
    scheduler.add_request(1, [1, 2], SamplingParams(max_tokens=6))
    step(scheduler, runner)
    scheduler.add_request(2, [3, 4], SamplingParams(max_tokens=6))
    scheduler.hold(1)
    result, _ = step(scheduler, runner)
    assert [c.seq_id for c in result.step_input.chunks] == [2]


def test_a_held_request_gives_its_blocks_to_the_head_of_the_waiting_line() -> None:
    scheduler, runner = make_scheduler(num_blocks=3, block_size=2)
    scheduler.add_request(1, [1, 2, 3], SamplingParams(max_tokens=3))  # 3 blocks at most
    step(scheduler, runner)
    step(scheduler, runner)
    scheduler.add_request(2, [4, 5, 6], SamplingParams(max_tokens=3))
    scheduler.hold(1)
    result, _ = step(scheduler, runner)
    assert result.preempted_request_ids == (1,)
    assert [c.seq_id for c in result.step_input.chunks] == [2]
    outputs: list[int] = []
    for _ in range(20):  # 2 runs while 1 waits held
        _, events = step(scheduler, runner)
        outputs.extend(t for e in events for t in e.new_token_ids)
        if scheduler.get_request(2) is None:
            break
    assert outputs == reference_output([4, 5, 6], 3)[1:]
    assert scheduler.get_request(1) is not None  # held, waiting: it does not run
    scheduler.hold(1, held=False)
    rest, _, _ = run_to_end(scheduler, runner)
    assert rest[1] == reference_output([1, 2, 3], 3)[2:]
    assert_all_blocks_free(scheduler)


def test_a_running_request_out_of_blocks_preempts_a_held_one_before_the_tail() -> None:
    scheduler, runner = make_scheduler(num_blocks=4, block_size=2)
    max_tokens = SamplingParams(max_tokens=6)
    scheduler.add_request(1, [1, 2], max_tokens)  # admitted first: not the tail
    scheduler.add_request(2, [3, 4], max_tokens)
    step(scheduler, runner)
    scheduler.hold(1)
    preempted: list[int] = []
    outputs: list[int] = []
    for _ in range(20):
        result, events = step(scheduler, runner)
        preempted.extend(result.preempted_request_ids)
        outputs.extend(t for e in events if e.request_id == 2 for t in e.new_token_ids)
        if scheduler.get_request(2) is None:
            break
    assert preempted == [1]  # where the tail, 2 itself, was the victim before
    assert outputs == reference_output([3, 4], 6)[1:]
    scheduler.hold(1, held=False)
    run_to_end(scheduler, runner)
    assert_all_blocks_free(scheduler)


def test_requests_let_back_in_from_a_hold_never_make_a_step_past_max_num_seqs() -> None:
    """Was: two held requests gave their seats to two new ones, then, let back in, all
    four ran every step with max_num_seqs 2 (80 sequences a step at 64 over HTTP)."""
    scheduler, runner = make_scheduler(max_num_seqs=2)
    max_tokens = SamplingParams(max_tokens=8)
    for request_id in (1, 2):
        scheduler.add_request(request_id, [request_id, 5], max_tokens)
    step(scheduler, runner)
    scheduler.hold(1)
    scheduler.hold(2)
    for request_id in (3, 4):
        scheduler.add_request(request_id, [request_id, 6], max_tokens)
    step(scheduler, runner)
    scheduler.hold(1, held=False)
    scheduler.hold(2, held=False)
    outputs, _, results = run_to_end(scheduler, runner)
    assert max(len(r.step_input.chunks) for r in results) == 2
    assert [c.seq_id for c in results[0].step_input.chunks] == [1, 2]  # first in order
    for request_id in (3, 4):
        assert len(outputs[request_id]) == 7  # its first token came before
    assert_all_blocks_free(scheduler)


def test_held_requests_keep_their_blocks_when_the_waiting_head_would_not_fit_anyway() -> None:
    """Was: preempted one by one for the head of the waiting line, which still did not
    fit once they were all gone: their K/V thrown away, nothing admitted."""
    scheduler, runner = make_scheduler(num_blocks=8, block_size=2)
    scheduler.add_request(1, list(range(1, 10)), SamplingParams(max_tokens=2))
    scheduler.add_request(2, [1, 2, 3], SamplingParams(max_tokens=4))
    step(scheduler, runner)
    scheduler.hold(2)
    scheduler.add_request(3, list(range(20, 28)), SamplingParams(max_tokens=2))
    result, _ = step(scheduler, runner)
    assert result.preempted_request_ids == ()
    assert [c.seq_id for c in result.step_input.chunks] == [1]


def test_held_requests_sharing_a_prompt_give_their_blocks_to_a_waiting_head_that_then_fits() -> (
    None
):
    """Was: blocks the held requests shared (the n > 1 choices of one stalled completion
    share the prompt's) were not counted as freed, and a head that fits once they are all
    preempted waited forever, its steps empty."""
    scheduler, runner = make_scheduler(num_blocks=8, block_size=2)
    scheduler.add_request(1, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    step(scheduler, runner)  # its two full prompt blocks are cached
    scheduler.add_request(2, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    step(scheduler, runner)
    scheduler.hold(1)
    scheduler.hold(2)
    scheduler.add_request(3, list(range(20, 34)), SamplingParams(max_tokens=1))  # 7 blocks
    result, _ = step(scheduler, runner)
    assert sorted(result.preempted_request_ids) == [1, 2]
    assert [c.seq_id for c in result.step_input.chunks] == [3]


def test_a_held_request_whose_blocks_are_the_heads_prefix_is_not_preempted_for_nothing() -> None:
    """Was: its cached blocks counted both as freed and as the head's prefix (no new block
    needed), where reviving them takes free blocks: preempted, and the head still waited."""
    scheduler, runner = make_scheduler(num_blocks=8, block_size=2)
    scheduler.add_request(1, [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=6))
    step(scheduler, runner)
    scheduler.add_request(2, [9, 9, 9], SamplingParams(max_tokens=4))
    step(scheduler, runner)
    scheduler.hold(1)
    scheduler.add_request(3, [1, 2, 3, 4, 5, 6, *range(30, 38)], SamplingParams(max_tokens=1))
    result, _ = step(scheduler, runner)
    assert result.preempted_request_ids == ()
    assert [c.seq_id for c in result.step_input.chunks] == [2]


def test_a_held_request_that_finishes_is_no_longer_counted_held() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(1, [1, 2], SamplingParams(max_tokens=6))
    step(scheduler, runner)
    scheduler.hold(1)
    scheduler.finish_request(1, FinishReason.ABORT)
    assert scheduler.stats().num_held == 0
    scheduler.hold(1, held=False)  # finished: ignored
    assert_all_blocks_free(scheduler)


def test_a_held_running_request_may_be_preempted_and_still_gives_its_output() -> None:
    scheduler, runner = make_scheduler(num_blocks=4, block_size=2)
    max_tokens = SamplingParams(max_tokens=6)
    scheduler.add_request(1, [1, 2], max_tokens)
    scheduler.add_request(2, [3, 4], max_tokens)
    outputs: dict[int, list[int]] = {1: [], 2: []}
    for event in step(scheduler, runner)[1]:
        outputs[event.request_id].extend(event.new_token_ids)
    scheduler.hold(2)  # the most recent: the victim when 1 needs a block
    preempted: list[int] = []
    while scheduler.get_request(1) is not None:
        result, events = step(scheduler, runner)
        preempted.extend(result.preempted_request_ids)
        for event in events:
            outputs[event.request_id].extend(event.new_token_ids)
    assert preempted == [2]
    assert outputs[1] == reference_output([1, 2], 6)
    scheduler.hold(2, held=False)
    more, _, _ = run_to_end(scheduler, runner)
    assert outputs[2] + more[2] == reference_output([3, 4], 6)
    assert_all_blocks_free(scheduler)


# -- preemption -----------------------------------------------------------------------------


def test_preempts_lower_class_then_most_recent_and_outputs_are_unchanged() -> None:
    scheduler, runner = make_scheduler(num_blocks=4, block_size=2)
    max_tokens = SamplingParams(max_tokens=6)
    scheduler.add_request(1, [1, 2], max_tokens, class_name="background")
    step(scheduler, runner)  # 1 is admitted first: the oldest running request
    scheduler.add_request(2, [3, 4], max_tokens)
    scheduler.add_request(3, [5, 6], max_tokens)
    outputs, finals, results = run_to_end(scheduler, runner)
    preempted = [i for r in results for i in r.preempted_request_ids]
    assert preempted[:2] == [1, 3]  # the background one, then the more recent of 2 and 3
    assert scheduler.num_preemptions == len(preempted)
    assert outputs[1] == reference_output([1, 2], 6)[1:]  # its first token came before
    for request_id, prompt in ((2, [3, 4]), (3, [5, 6])):
        assert outputs[request_id] == reference_output(prompt, 6)
    for request_id in (1, 2, 3):
        assert finals[request_id].finish_reason is FinishReason.LENGTH
    assert scheduler.kv_cache.pool.num_free == 4


def test_a_preempted_request_admitted_again_counts_no_prefix_cache_lookup() -> None:
    """Its own evicted blocks found again are no prompt found cached. Was: two prompts that
    share nothing read as hits after a preemption, and its outputs as queries (vLLM keeps
    a preempted request's lookups apart)."""
    scheduler, runner = make_scheduler(num_blocks=4, block_size=2)
    max_tokens = SamplingParams(max_tokens=6)
    scheduler.add_request(1, [1, 2], max_tokens, class_name="background")
    step(scheduler, runner)
    scheduler.add_request(2, [3, 4], max_tokens)
    scheduler.add_request(3, [5, 6], max_tokens)
    _, _, results = run_to_end(scheduler, runner)
    assert any(r.preempted_request_ids for r in results)
    stats = scheduler.stats()
    assert (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (6, 0)


def test_preempted_request_goes_to_the_front_of_its_class() -> None:
    scheduler, runner = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2)
    max_tokens = SamplingParams(max_tokens=6)
    scheduler.add_request(1, [1, 2], max_tokens)
    scheduler.add_request(2, [3, 4], max_tokens)
    scheduler.add_request(3, [5, 6], max_tokens)  # waits: seq cap
    preempted_at = None
    for n in range(10):
        result, _ = step(scheduler, runner)
        if result.preempted_request_ids:
            preempted_at = n
            break
    assert preempted_at is not None
    assert result.preempted_request_ids == (2,)
    victim = scheduler.get_request(2)
    assert victim is not None
    assert (victim.status, victim.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    # Request 1 finishes first; then 2 is readmitted ahead of 3, which arrived earlier.
    while scheduler.get_request(1) is not None:
        step(scheduler, runner)
    result, _ = step(scheduler, runner)
    assert result.step_input.chunks[0].seq_id == 2


# -- prefix cache ---------------------------------------------------------------------------


def test_prefix_cache_hit_skips_cached_tokens() -> None:
    scheduler, runner = make_scheduler(block_size=4)
    prompt = list(range(1, 11))
    scheduler.add_request(1, prompt, SamplingParams(max_tokens=2))
    run_to_end(scheduler, runner)
    scheduler.add_request(2, [*prompt, 50], SamplingParams(max_tokens=2))
    result, _ = step(scheduler, runner)
    [chunk] = result.step_input.chunks
    assert (chunk.start_pos, len(chunk.token_ids)) == (8, 3)
    request = scheduler.get_request(2)
    assert request is not None and request.num_cached_tokens == 8
    stats = scheduler.stats()
    assert (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (21, 8)
    outputs, _, _ = run_to_end(scheduler, runner)
    assert [*request.output_token_ids] == reference_output([*prompt, 50], 2)
    assert outputs[2] == reference_output([*prompt, 50], 2)[1:]


def test_a_request_asking_for_prompt_logprobs_computes_its_whole_prompt() -> None:
    # Prompt log-probabilities come from the logits of every prompt position: none may be
    # skipped as a cached prefix.
    scheduler, runner = make_scheduler(block_size=4)
    prompt = list(range(1, 11))
    scheduler.add_request(1, prompt, SamplingParams(max_tokens=2))
    run_to_end(scheduler, runner)
    scheduler.add_request(2, [*prompt, 50], SamplingParams(max_tokens=2, prompt_logprobs=0))
    result, _ = step(scheduler, runner)
    [chunk] = result.step_input.chunks
    assert (chunk.start_pos, len(chunk.token_ids)) == (0, 11)


# -- finishing from outside: abort, stop ------------------------------------------------------


def abort(scheduler: Scheduler, request_id: int) -> RequestEvent | None:
    return scheduler.finish_request(request_id, FinishReason.ABORT)


def test_abort_frees_a_running_request_blocks_at_once() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(1, list(range(9)))
    step(scheduler, runner)
    assert scheduler.kv_cache.pool.num_used == 3
    event = abort(scheduler, 1)
    assert event == RequestEvent(1, (), FinishReason.ABORT)
    assert scheduler.kv_cache.pool.num_used == 0
    assert not scheduler.has_unfinished()
    assert abort(scheduler, 1) is None


def test_a_stop_found_by_the_output_processor_finishes_the_request_as_stopped() -> None:
    scheduler, runner = make_scheduler()
    request = scheduler.add_request(1, [1, 2], SamplingParams(max_tokens=10))
    step(scheduler, runner)
    event = scheduler.finish_request(1, FinishReason.STOP)
    assert event == RequestEvent(1, (), FinishReason.STOP)
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert scheduler.kv_cache.pool.num_used == 0 and not scheduler.has_unfinished()
    assert scheduler.stats().num_finished == 1


def test_abort_removes_a_waiting_request() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=1)
    scheduler.add_request(1, [1, 2])
    scheduler.add_request(2, [3, 4])
    step(scheduler, runner)
    assert abort(scheduler, 2) is not None
    assert scheduler.num_waiting == 0
    scheduler.kv_cache.check_invariants()


def test_abort_while_a_step_is_in_flight_skips_its_output() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(1, [1, 2])
    scheduler.add_request(2, [3, 4])
    result = scheduler.schedule()
    output = runner.execute(result.step_input)
    abort(scheduler, 1)
    events = scheduler.update_from_output(result, output)
    assert [e.request_id for e in events] == [2]
    next_step = scheduler.schedule()
    assert next_step.step_input.finished_seq_ids == (1,)
    assert [c.seq_id for c in next_step.step_input.chunks] == [2]


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
    assert_all_blocks_free(scheduler)


# -- stopping: max_tokens (stop tokens and strings: test_output.py) ---------------------------


def scripted(tokens: Sequence[int], prompt_len: int) -> NextToken:
    return lambda sequence: tokens[len(sequence) - prompt_len]


def test_max_tokens_finishes_with_length_in_the_step_that_reached_it() -> None:
    scheduler, runner = make_scheduler()
    scheduler.add_request(1, [1, 1], SamplingParams(max_tokens=1))
    scheduler.add_request(2, [1, 1], SamplingParams(max_tokens=3))
    outputs, finals, results = run_to_end(scheduler, runner)
    assert {r: len(tokens) for r, tokens in outputs.items()} == {1: 1, 2: 3}
    assert finals[1].finish_reason is finals[2].finish_reason is FinishReason.LENGTH
    assert len(results) == 3  # no step past the last token
    assert scheduler.stats().num_generation_tokens == 1 + 3
    assert scheduler.kv_cache.pool.num_free == scheduler.kv_cache.pool.num_blocks


def test_tokens_that_would_stop_a_request_do_not_stop_it_here() -> None:
    """EOS and stop token ids are the output processor's (one place, every EOS id):
    the scheduler appends them like any token."""
    script = [20, 21, 2, 22]
    scheduler, runner = make_scheduler(next_token=scripted(script, 2))
    scheduler.add_request(1, [1, 1], SamplingParams(max_tokens=4, stop_token_ids=(21, 2)))
    outputs, finals, _ = run_to_end(scheduler, runner)
    assert outputs[1] == script
    assert finals[1].finish_reason is FinishReason.LENGTH


# -- boundaries -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "sampling", "class_name", "match"),
    [
        ([], SamplingParams(), None, "no tokens"),
        ([1], SamplingParams(max_tokens=0), None, "max_tokens"),
        ([1], SamplingParams(), "urgent", "unknown priority class"),
        (list(range(60)), SamplingParams(max_tokens=10), None, "exceeds the KV cache"),
    ],
)
def test_add_request_rejects_what_can_never_run(
    prompt: list[int], sampling: SamplingParams, class_name: str | None, match: str
) -> None:
    scheduler, _ = make_scheduler(num_blocks=16, block_size=4)
    with pytest.raises(InvalidInput, match=match):
        scheduler.add_request(1, prompt, sampling, class_name=class_name)


def test_duplicate_request_id_is_rejected() -> None:
    scheduler, _ = make_scheduler()
    scheduler.add_request(1, [1])
    with pytest.raises(InvalidInput, match="already in use"):
        scheduler.add_request(1, [1])


def test_output_that_does_not_match_the_step_is_a_model_error() -> None:
    scheduler, _ = make_scheduler()
    scheduler.add_request(1, [1, 2])
    result = scheduler.schedule()
    with pytest.raises(ModelError):
        scheduler.update_from_output(result, StepOutput((None,)))
    with pytest.raises(ModelError):
        scheduler.update_from_output(result, StepOutput(()))
    request = scheduler.get_request(1)
    assert request is not None and request.num_computed_tokens == 0


def test_sequence_exactly_the_size_of_the_cache_completes() -> None:
    scheduler, runner = make_scheduler(num_blocks=2, block_size=4)
    scheduler.add_request(1, [1, 2, 3], SamplingParams(max_tokens=6))  # 8 positions
    outputs, _, _ = run_to_end(scheduler, runner)
    assert outputs[1] == reference_output([1, 2, 3], 6)


# -- property -------------------------------------------------------------------------------

CLASSES = ("interactive", "normal", "background")


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt: list[int]
    max_tokens: int
    class_name: str
    abort_step: int | None


@dataclass(frozen=True)
class Workload:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    arrivals: list[Arrival]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(2, 16))
    max_num_seqs = draw(st.integers(1, 6))
    capacity = num_blocks * block_size
    shared = draw(st.lists(st.integers(0, 3), max_size=8))
    arrivals = []
    for _ in range(draw(st.integers(1, 8))):
        prompt_len = draw(st.integers(1, min(12, capacity)))
        own = draw(st.lists(st.integers(0, 3), min_size=prompt_len, max_size=prompt_len))
        prompt = (shared + own)[:prompt_len] if draw(st.booleans()) else own  # prefix hits
        arrivals.append(
            Arrival(
                step=draw(st.integers(0, 6)),
                prompt=prompt,
                max_tokens=draw(st.integers(1, min(10, capacity - prompt_len + 1))),
                class_name=draw(st.sampled_from(CLASSES)),
                abort_step=draw(st.none() | st.integers(0, 15)),
            )
        )
    return Workload(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 24)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3])),
        arrivals=arrivals,
    )


@settings(max_examples=120, deadline=None)
@given(workloads())
def test_every_request_finishes_once_with_its_reference_output(workload: Workload) -> None:
    budget = workload.max_num_batched_tokens
    scheduler, runner = make_scheduler(
        num_blocks=workload.num_blocks,
        block_size=workload.block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=workload.max_num_seqs,
        long_prefill_token_threshold=workload.long_prefill_token_threshold,
    )
    outputs: dict[int, list[int]] = {}
    finals: dict[int, RequestEvent] = {}
    for step_n in range(2000):
        for request_id, arrival in enumerate(workload.arrivals):
            if arrival.step == step_n:
                sampling = SamplingParams(max_tokens=arrival.max_tokens)
                scheduler.add_request(
                    request_id, arrival.prompt, sampling, class_name=arrival.class_name
                )
            if arrival.abort_step == step_n and (event := abort(scheduler, request_id)) is not None:
                assert request_id not in finals
                finals[request_id] = event
        if step_n > 6 and not scheduler.has_unfinished():
            break
        has_work = scheduler.has_unfinished()
        result, events = step(scheduler, runner)
        chunks = result.step_input.chunks
        assert bool(chunks) == has_work  # empty only when nothing is left to run
        assert result.step_input.num_tokens <= budget
        assert len(chunks) <= workload.max_num_seqs
        assert len({c.seq_id for c in chunks}) == len(chunks)
        for event in events:
            outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.is_finished:
                assert event.request_id not in finals
                finals[event.request_id] = event
    else:
        raise AssertionError("requests still unfinished after 2000 steps")
    assert set(finals) == set(range(len(workload.arrivals)))
    for request_id, arrival in enumerate(workload.arrivals):
        expected = reference_output(arrival.prompt, arrival.max_tokens)
        got = outputs.get(request_id, [])
        if finals[request_id].finish_reason is FinishReason.ABORT:
            assert got == expected[: len(got)]
        else:
            assert finals[request_id].finish_reason is FinishReason.LENGTH
            assert got == expected
    pool = scheduler.kv_cache.pool
    assert pool.num_free == pool.num_blocks
    assert scheduler.kv_cache.request_ids() == ()
    stats = scheduler.stats()
    note_event(f"preempted: {stats.num_preemptions > 0}")
    note_event(f"prefix hit: {stats.num_prefix_cache_hits > 0}")
    note_event(f"aborted: {any(e.finish_reason is FinishReason.ABORT for e in finals.values())}")
