"""The engine over the real scheduler (64 blocks of 4 tokens) and a fake runner that plays
a script of tokens per sequence; time is a counter the runner moves one step at a time.
Then the engine over a real runner: a tiny random-weight Llama, judged against vLLM."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Sequence

import pytest

from carpool.errors import Closed, ConfigError, InvalidInput, ModelError
from carpool.generation.block_pool import BlockPool
from carpool.generation.engine import GenerationEngine, GenerationEvent
from carpool.generation.kv_cache import KVCacheManager
from carpool.generation.request import FinishReason, RequestEvent
from carpool.generation.runner import ModelRunner
from carpool.generation.scheduler import Scheduler, SchedulerConfig
from carpool.generation.telemetry import GenerationTrace
from carpool.generation.tokenizer import ByteTokenizer, Tokenizer
from carpool.generation.types import SamplingParams, SeqChunk, StepInput, StepOutput
from carpool.generation.weights import random_llama

from .test_scheduler import assert_all_blocks_free

BLOCK_SIZE = 4
NUM_BLOCKS = 64
EOS = ByteTokenizer.EOS_ID


class StepClock:
    """Seconds that move only when the fake runner finishes a step."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def now(self) -> float:
        return self.now_s

    def call_at(self, when_s: float, callback: Callable[[], None]) -> None:
        raise AssertionError("the engine sets no timers")


class RecordingScheduler(Scheduler):
    """The real scheduler, noting each request the engine finishes and why."""

    def __init__(self) -> None:
        config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)
        super().__init__(config, KVCacheManager(BlockPool(NUM_BLOCKS, BLOCK_SIZE)))
        self.finished: list[tuple[int, FinishReason]] = []

    def finish_request(self, request_id: int, reason: FinishReason) -> RequestEvent | None:
        event = super().finish_request(request_id, reason)
        if event is not None:
            self.finished.append((request_id, reason))
        return event

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.pool.num_free


class ScriptRunner:
    """Sequence ``i`` emits ``scripts[i]`` token by token (then ``filler`` forever)."""

    def __init__(self, clock: StepClock, scripts: dict[int, Sequence[int]] | None = None) -> None:
        self.clock = clock
        self.scripts = scripts or {}
        self.steps: list[StepInput] = []
        self.counts: dict[int, int] = {}
        self.fail_next = False
        self.gate: threading.Semaphore | None = None

    def execute(self, step: StepInput) -> StepOutput:
        if self.gate is not None:
            assert self.gate.acquire(timeout=10), "the test never opened the gate"
        self.steps.append(step)
        self.clock.now_s += 0.01
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device lost")
        sampled = []
        for chunk in step.chunks:
            i = self.counts.get(chunk.seq_id, 0)
            self.counts[chunk.seq_id] = i + 1
            script = self.scripts.get(chunk.seq_id, ())
            sampled.append(script[i] if i < len(script) else ord("x"))
        return StepOutput(tuple(sampled))


@pytest.fixture
def clock() -> StepClock:
    return StepClock()


@pytest.fixture
def scheduler() -> RecordingScheduler:
    return RecordingScheduler()


@pytest.fixture
def runner(clock: StepClock) -> ScriptRunner:
    return ScriptRunner(clock)


@pytest.fixture
async def engine(scheduler, runner, clock):
    engine = GenerationEngine(
        scheduler, runner, ByteTokenizer(), name="fake", max_model_len=64, clock=clock
    )
    await engine.start()
    yield engine
    await engine.stop(drain=False)


def _prompt(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


async def _collect(
    engine: GenerationEngine, prompt: list[int], **sampling
) -> list[GenerationEvent]:
    params = SamplingParams(**{"max_tokens": 8, **sampling})
    return [event async for event in engine.generate(prompt, params)]


async def eventually(condition: Callable[[], bool]) -> None:
    for _ in range(5000):  # polls a condition; no assertion depends on how long it took
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


async def test_streams_each_token_as_produced_then_finishes_with_usage(engine, runner):
    runner.scripts[0] = list(b"hello")
    events = await _collect(engine, _prompt("say"), max_tokens=5)
    assert [e.text for e in events] == ["h", "e", "l", "l", "o"]
    assert [e.finish_reason for e in events] == [None] * 4 + [FinishReason.LENGTH]
    assert events[-1].usage is not None
    assert (events[-1].usage.prompt_tokens, events[-1].usage.completion_tokens) == (4, 5)


async def test_multibyte_characters_split_over_tokens_stream_whole(engine, runner):
    text = "né 🚗!"
    runner.scripts[0] = list(text.encode())
    events = await _collect(engine, _prompt("a"), max_tokens=len(text.encode()))
    assert "".join(e.text for e in events) == text
    assert all("\ufffd" not in e.text for e in events)
    assert "🚗" in [e.text for e in events]  # four byte tokens, one delta


async def test_requests_join_and_leave_at_every_step(engine, scheduler, runner):
    runner.gate = threading.Semaphore(0)
    first = asyncio.ensure_future(_collect(engine, _prompt("aa"), max_tokens=5))
    runner.gate.release(2)  # prefill of the first request, one decode step
    await eventually(lambda: len(runner.steps) == 2)
    # The third step is already scheduled (held at the gate): the second joins the fourth.
    second = asyncio.ensure_future(_collect(engine, _prompt("bbbbbb"), max_tokens=3))
    await eventually(lambda: engine.num_active == 2)
    runner.gate.release(10)
    await asyncio.gather(first, second)
    shapes = [[(c.seq_id, len(c.token_ids)) for c in step.chunks] for step in runner.steps]
    assert shapes == [
        [(0, 3)],
        [(0, 1)],
        [(0, 1)],
        [(0, 1), (1, 7)],  # a decode and a prefill share the step
        [(0, 1), (1, 1)],
        [(1, 1)],  # the first left after its fifth token
    ]


async def test_cancelled_consumer_aborts_and_frees_its_blocks(engine, scheduler, runner):
    events = engine.generate(_prompt("x" * 20), SamplingParams(max_tokens=40))
    first = await anext(events)
    assert first.finish_reason is None
    assert scheduler.num_free_blocks < NUM_BLOCKS
    await events.aclose()  # the client went away
    await eventually(lambda: scheduler.finished == [(0, FinishReason.ABORT)])
    assert scheduler.num_free_blocks == NUM_BLOCKS
    assert engine.snapshot().finished == {"abort": 1}


async def test_cancelling_the_consumer_task_aborts_the_request(engine, scheduler, runner):
    runner.gate = threading.Semaphore(0)
    task = asyncio.ensure_future(_collect(engine, _prompt("abc"), max_tokens=30))
    runner.gate.release(1)
    await eventually(lambda: len(runner.steps) == 1)
    task.cancel()
    runner.gate.release(100)
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: scheduler.finished == [(0, FinishReason.ABORT)])
    assert not scheduler.has_unfinished()


async def test_eos_stops_counts_the_token_but_shows_no_text(engine, scheduler, runner):
    runner.scripts[0] = [*b"ok", EOS, *b"never"]
    events = await _collect(engine, _prompt("q"))
    assert "".join(e.text for e in events) == "ok"
    assert events[-1].finish_reason is FinishReason.STOP
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 3
    # The scheduler is told before its next step: it frees the blocks, runs no more.
    await eventually(lambda: scheduler.finished == [(0, FinishReason.STOP)])
    assert scheduler.num_free_blocks == NUM_BLOCKS
    assert len(runner.steps) == 3


async def test_ignore_eos_keeps_generating(engine, runner):
    runner.scripts[0] = [*b"ok", EOS, *b"go"]
    events = await _collect(engine, _prompt("q"), max_tokens=5, ignore_eos=True)
    assert "".join(e.text for e in events) == "okgo"
    assert events[-1].finish_reason is FinishReason.LENGTH


async def test_stop_string_ends_the_text_before_it_and_is_never_streamed(engine, runner):
    runner.scripts[0] = list(b"one. two. three")
    events = await _collect(engine, _prompt("q"), max_tokens=15, stop=(". t",))
    assert [e.text for e in events if e.text] == ["o", "n", "e"]
    assert events[-1].finish_reason is FinishReason.STOP


async def test_text_held_for_a_possible_stop_string_is_released_when_it_is_not(engine, runner):
    runner.scripts[0] = list(b"a.b")
    events = await _collect(engine, _prompt("q"), max_tokens=3, stop=(".!",))
    assert [e.text for e in events] == ["a", "", ".b"]


async def test_stop_token_ids_stop_like_eos(engine, runner):
    runner.scripts[0] = list(b"abc")
    events = await _collect(engine, _prompt("q"), stop_token_ids=(ord("b"),))
    assert "".join(e.text for e in events) == "a"
    assert events[-1].finish_reason is FinishReason.STOP


async def test_the_scheduler_ends_a_request_at_max_tokens_in_that_step(engine, scheduler, runner):
    runner.scripts[0] = list(b"abcdef")
    events = await _collect(engine, _prompt("q"), max_tokens=3)
    assert "".join(e.text for e in events) == "abc"
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert len(runner.steps) == 3  # no step past max_tokens
    assert not scheduler.has_unfinished() and scheduler.finished == []  # it needed no telling
    assert scheduler.num_free_blocks == NUM_BLOCKS


async def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(engine, runner):
    runner.fail_next = True
    with pytest.raises(ModelError, match="device lost"):
        await _collect(engine, _prompt("q"))
    events = await _collect(engine, _prompt("q"), max_tokens=2)
    assert events[-1].finish_reason is FinishReason.LENGTH


async def test_the_scheduler_refusing_a_request_raises_to_its_caller(engine):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidInput, match="unknown priority class 'bulk'"):
        _ = [e async for e in engine.generate(_prompt("q"), params, priority="bulk")]
    events = [e async for e in engine.generate(_prompt("q"), params, priority="interactive")]
    assert events[-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "match"),
    [([], 1, "empty"), ([1] * 64, 1, "at most 64"), ([1] * 60, 5, "lower max_tokens to 4")],
)
async def test_refuses_prompts_that_do_not_fit(engine, prompt, max_tokens, match):
    with pytest.raises(InvalidInput, match=match):
        await _collect(engine, prompt, max_tokens=max_tokens)


async def test_drain_finishes_requests_in_flight_then_refuses_new_ones(engine, runner):
    runner.gate = threading.Semaphore(0)
    task = asyncio.ensure_future(_collect(engine, _prompt("q"), max_tokens=3))
    await eventually(lambda: engine.num_active == 1)
    stopping = asyncio.ensure_future(engine.stop(drain=True))
    runner.gate.release(3)
    await stopping
    assert (await task)[-1].finish_reason is FinishReason.LENGTH
    with pytest.raises(Closed):
        await _collect(engine, _prompt("q"))


async def test_stop_without_drain_aborts_requests_in_flight(engine, runner):
    runner.gate = threading.Semaphore(0)
    events = engine.generate(_prompt("q"), SamplingParams(max_tokens=30))
    pending = asyncio.ensure_future(anext(events))
    await eventually(lambda: engine.num_active == 1)
    runner.gate.release(100)
    await engine.stop(drain=False)
    last = await pending
    while last.finish_reason is None:
        last = await anext(events)
    assert last.finish_reason is FinishReason.ABORT


async def test_a_drain_cut_off_fails_what_is_in_flight_with_closed(engine, runner):
    """--drain-timeout-s: what a generation engine still ran was not cut off (its count 0),
    and its clients' connections were closed with no answer when the grace ended."""
    runner.gate = threading.Semaphore(0)
    task = asyncio.ensure_future(_collect(engine, _prompt("q"), max_tokens=30))
    await eventually(lambda: engine.num_active == 1)
    stopping = asyncio.ensure_future(engine.stop(drain=True))
    await eventually(lambda: not engine.is_running)
    assert engine.cut_off() == 1
    with pytest.raises(Closed):
        await task
    runner.gate.release(100)
    await stopping
    assert engine.num_active == 0 and engine.cut_off() == 0


async def test_a_request_whose_consumer_stops_reading_is_held_and_the_others_step_on(
    scheduler, runner, clock
):
    """Back-pressure. Was: a streaming client that stopped reading left its request
    generating into an unbounded queue (a stalled reader of n=128 with 20 log-probabilities
    held some 310 MB in the server, outside every limit)."""
    engine = GenerationEngine(
        scheduler, runner, ByteTokenizer(), name="fake", max_model_len=64, clock=clock,
        max_unread_events=4,
    )  # fmt: skip
    await engine.start()
    try:
        runner.scripts[0] = list(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN")  # 40 tokens
        stalled = engine.generate(_prompt("s"), SamplingParams(max_tokens=40))
        first = await anext(stalled)  # then it reads nothing
        other = await _collect(engine, _prompt("o"), max_tokens=30)
        assert other[-1].finish_reason is FinishReason.LENGTH
        assert runner.counts[0] == 1 + 4  # the token read, then four unread: held
        assert engine.snapshot().scheduler.num_held == 1
        rest = [event async for event in stalled]
        assert first.text + "".join(e.text for e in rest) == "".join(map(chr, runner.scripts[0]))
        assert rest[-1].finish_reason is FinishReason.LENGTH
        assert engine.snapshot().scheduler.num_held == 0
    finally:
        await engine.stop(drain=False)
    assert_all_blocks_free(scheduler)


@pytest.mark.parametrize("value", [0, 1, 2.5, True])
def test_max_unread_events_must_be_an_integer_of_at_least_two(scheduler, runner, value):
    with pytest.raises(ConfigError, match="max_unread_events"):
        GenerationEngine(
            scheduler, runner, ByteTokenizer(), max_model_len=64, max_unread_events=value
        )


async def test_telemetry_counts_tokens_and_times_steps(engine, runner):
    runner.scripts[0] = list(b"abc")
    await _collect(engine, _prompt("hi"), max_tokens=3)
    snap = engine.snapshot()
    assert (snap.num_prompt_tokens, snap.num_generation_tokens) == (3, 3)
    assert snap.finished == {"length": 1}
    assert snap.queue_time.count == snap.time_to_first_token.count == snap.e2e_latency.count == 1
    assert snap.time_to_first_token.max_s == pytest.approx(0.01)
    assert snap.inter_token_latency.count == 2
    assert snap.inter_token_latency.max_s == pytest.approx(0.01)
    assert snap.e2e_latency.max_s == pytest.approx(0.03)
    assert snap.scheduler.num_running == 0


async def test_telemetry_totals_requests_by_outcome_and_steps_by_size(engine, runner):
    """What ``/v2/models/{m}/stats`` reports for a generation model (server/stats.py)."""
    runner.fail_next = True
    with pytest.raises(ModelError):
        await _collect(engine, _prompt("q"))  # its one step failed: not counted as a step
    runner.scripts[1] = list(b"abc")
    await _collect(engine, _prompt("hi"), max_tokens=3)
    snap = engine.snapshot(quantiles=False)
    assert (snap.failed.count, snap.failed.e2e_s) == (1, pytest.approx(0.01))
    assert snap.succeeded.count == 1
    assert (snap.succeeded.e2e_s, snap.succeeded.queue_s) == (pytest.approx(0.03), 0.0)
    assert snap.last_succeeded_unix_s is not None
    assert snap.num_steps == 3
    assert list(snap.steps_by_size) == [1]
    assert snap.steps_by_size[1].count == 3
    assert snap.steps_by_size[1].compute_s == pytest.approx(0.03)


async def test_request_latency_buckets_reach_past_a_minute_and_scrapes_skip_quantiles(
    engine, runner
):
    # Generations may run for minutes: their latencies need buckets past 60 s (vLLM's
    # e2e buckets go to 7680 s), or every long one lands in +Inf.
    runner.scripts[0] = list(b"ab")
    await _collect(engine, _prompt("hi"), max_tokens=2)
    snap, cheap = engine.snapshot(), engine.snapshot(quantiles=False)
    bounds = [bound for bound, _ in snap.e2e_latency.buckets]
    assert {120.0, 960.0, 7680.0} <= set(bounds)
    assert [b for b, _ in snap.time_to_first_token.buckets] == bounds
    assert cheap.e2e_latency.buckets == snap.e2e_latency.buckets
    assert cheap.e2e_latency.sum_s == snap.e2e_latency.sum_s
    assert math.isnan(cheap.e2e_latency.p99_s) and not math.isnan(snap.e2e_latency.p99_s)


# -- over a real model -------------------------------------------------------------------------
# The engine over the real scheduler, KV-cache manager, block pool and a tiny random-weight
# Llama (byte tokenizer): a seeded request must not notice preemption, a failing step returns
# every block, a bad prompt or a text that cannot be made fails alone.

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
    model_vocab_size: int | None = None,
) -> tuple[GenerationEngine, Scheduler, FlakyRunner]:
    model = random_llama({**TINY, "vocab_size": model_vocab_size or TINY["vocab_size"]}, seed=0)
    runner = FlakyRunner(ModelRunner(model, num_blocks, block_size, prepack=False, seed=0), fail_at)
    config = SchedulerConfig(max_num_batched_tokens=max_tokens_per_step, max_num_seqs=8)
    scheduler = Scheduler(config, KVCacheManager(BlockPool(num_blocks, block_size)))
    engine = GenerationEngine(
        scheduler,
        runner,
        tokenizer,
        max_model_len=num_blocks * block_size,
        model_vocab_size=model.vocab_size,
    )
    return engine, scheduler, runner


async def _run(engine: GenerationEngine, prompt: Sequence[int], **sampling: object) -> list[int]:
    params = SamplingParams(**{"ignore_eos": True, **sampling})  # type: ignore[arg-type]
    events: list[GenerationEvent] = [e async for e in engine.generate(prompt, params)]
    assert events[-1].finish_reason is FinishReason.LENGTH
    return [t for e in events for t in e.token_ids]


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
    assert_all_blocks_free(scheduler)


async def test_an_id_the_tokenizer_has_but_the_model_lacks_is_refused_and_spares_the_batch() -> (
    None
):
    """A tokenizer with one more id than the model's embedding has rows (a token added to
    a folder's tokenizer without resizing the model): that id is refused like one past
    the vocabulary, and the request batched beside it is answered."""
    rows = TOKENIZER.vocab_size - 1
    engine, scheduler, _ = _engine(num_blocks=32, model_vocab_size=rows)
    assert engine.vocab_size == rows
    await engine.start()
    try:
        bad = _run(engine, [*b"hi", rows], max_tokens=3, temperature=0)
        good = _run(engine, list(b"hello"), max_tokens=3, temperature=0)
        results = await asyncio.gather(bad, good, return_exceptions=True)
        assert isinstance(results[0], InvalidInput)
        assert f"prompt[2]={rows}" in str(results[0])
        assert isinstance(results[1], list) and len(results[1]) == 3
    finally:
        await engine.stop()
    assert_all_blocks_free(scheduler)


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
    assert_all_blocks_free(scheduler)


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
    assert_all_blocks_free(scheduler)


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
    assert_all_blocks_free(scheduler)


async def test_a_trace_hook_gets_each_request_with_its_steps(engine, runner):
    traces: list[GenerationTrace] = []
    engine.set_trace_hook(traces.append)
    await _collect(engine, _prompt("hi"), max_tokens=3)
    [trace] = traces
    assert (trace.outcome, trace.num_prompt_tokens, trace.num_generated) == ("length", 3, 3)
    assert (trace.arrived_s, trace.scheduled_s) == (100.0, 100.0)
    assert trace.first_token_s == pytest.approx(100.01)
    assert trace.answered_s == pytest.approx(100.03)
    expected = [(100.0, 100.01), (100.01, 100.02), (100.02, 100.03)]
    assert [pytest.approx(step) for step in expected] == list(trace.steps)


async def test_a_failed_step_is_traced_as_an_error(engine, runner):
    traces: list[GenerationTrace] = []
    engine.set_trace_hook(traces.append)
    runner.fail_next = True
    with pytest.raises(ModelError):
        await _collect(engine, _prompt("q"))
    [trace] = traces
    assert trace.outcome == "error"
    assert trace.steps == ()  # the step that failed never ran to its end


async def test_no_trace_once_the_hook_is_taken_off(engine, runner):
    traces: list[GenerationTrace] = []
    engine.set_trace_hook(traces.append)
    engine.set_trace_hook(None)
    await _collect(engine, _prompt("hi"), max_tokens=2)
    assert traces == []


async def test_prompt_logprobs_prefilled_over_several_steps_come_with_the_first_event() -> None:
    engine, _, runner = _engine(16, max_tokens_per_step=8)
    prompt = list(range(40, 70))  # 30 tokens: chunks over four steps
    await engine.start()
    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=1)
        events = [e async for e in engine.generate(prompt, params)]
        plain = [e async for e in engine.generate(prompt, SamplingParams(max_tokens=3))]
    finally:
        await engine.stop()
    assert runner.num_steps > 4
    found = events[0].prompt_logprobs
    assert [f.token_id for f in found] == prompt[1:]
    assert all(len(f.top) == 1 and f.logprob <= 0.0 for f in found)
    assert all(e.prompt_logprobs == () for e in events[1:])
    assert all(e.prompt_logprobs == () for e in plain)
    # The prompt's logits from one whole step agree with the chunked ones.
    whole = ModelRunner(random_llama(TINY, seed=0), 16, 4, prepack=False)
    chunk = SeqChunk(0, tuple(prompt), 0, tuple(range(8)), True, params, len(prompt))
    (expected,) = whole.execute(StepInput((chunk,))).prompt_logprobs
    assert [f.logprob for f in found] == pytest.approx([f.logprob for f in expected], abs=1e-5)
