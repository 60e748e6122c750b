"""The engine against a fake scheduler (whole-prompt prefill, one block per 4 tokens) and
a fake runner that plays a script of tokens per sequence; time is a counter the runner
moves one step at a time."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from carpool.errors import Closed, InvalidInput, ModelError
from carpool.generation.engine import (
    FinishReason,
    GenerationEngine,
    GenerationEvent,
    SchedulerStats,
    SeqUpdate,
)
from carpool.generation.tokenizer import ByteTokenizer
from carpool.generation.types import SamplingParams, SeqChunk, StepInput, StepOutput

BLOCK_SIZE = 4
EOS = ByteTokenizer.EOS_ID


class StepClock:
    """Seconds that move only when the fake runner finishes a step."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def now(self) -> float:
        return self.now_s

    def call_at(self, when_s: float, callback: Callable[[], None]) -> None:
        raise AssertionError("the engine sets no timers")


@dataclass
class _Seq:
    prompt: tuple[int, ...]
    sampling: SamplingParams
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)


class FakeScheduler:
    """Admits waiting sequences while blocks last; decodes every running one."""

    def __init__(self, num_blocks: int = 64) -> None:
        self.free_blocks = list(range(num_blocks))
        self.num_blocks = num_blocks
        self.waiting: list[int] = []
        self.running: dict[int, _Seq] = {}
        self.seqs: dict[int, _Seq] = {}
        self.aborted: list[int] = []
        self.priorities: dict[int, str | None] = {}

    def add(
        self,
        seq_id: int,
        prompt_ids: tuple[int, ...],
        sampling: SamplingParams,
        priority: str | None,
    ) -> None:
        if priority not in (None, "interactive"):
            raise InvalidInput(f"priority={priority!r}: expected 'interactive'")
        self.seqs[seq_id] = _Seq(prompt_ids, sampling)
        self.priorities[seq_id] = priority
        self.waiting.append(seq_id)

    def _grow(self, seq: _Seq, num_tokens: int) -> None:
        while len(seq.blocks) * BLOCK_SIZE < num_tokens:
            seq.blocks.append(self.free_blocks.pop())

    def schedule(self) -> StepInput:
        chunks = []
        for seq_id, seq in self.running.items():
            self._grow(seq, seq.num_computed + 1)
            token = seq.output[-1]
            chunks.append(
                SeqChunk(seq_id, (token,), seq.num_computed, tuple(seq.blocks), True, seq.sampling)
            )
        while self.waiting:
            seq = self.seqs[self.waiting[0]]
            if -(-len(seq.prompt) // BLOCK_SIZE) > len(self.free_blocks):
                break
            seq_id = self.waiting.pop(0)
            self._grow(seq, len(seq.prompt))
            self.running[seq_id] = seq
            chunks.append(SeqChunk(seq_id, seq.prompt, 0, tuple(seq.blocks), True, seq.sampling))
        return StepInput(tuple(chunks))

    def update(self, step: StepInput, output: StepOutput) -> list[SeqUpdate]:
        updates = []
        for chunk, token in zip(step.chunks, output.sampled, strict=True):
            seq = self.seqs.get(chunk.seq_id)
            if seq is None or token is None:
                continue
            seq.num_computed = chunk.start_pos + len(chunk.token_ids)
            seq.output.append(token)
            reason = None
            if len(seq.output) >= seq.sampling.max_tokens:
                reason = FinishReason.LENGTH
                self._release(chunk.seq_id)
            updates.append(SeqUpdate(chunk.seq_id, (token,), reason))
        return updates

    def _release(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        self.running.pop(seq_id, None)
        if seq_id in self.waiting:
            self.waiting.remove(seq_id)
        if seq is not None:
            self.free_blocks.extend(seq.blocks)

    def abort(self, seq_id: int) -> None:
        if seq_id in self.seqs:
            self.aborted.append(seq_id)
        self._release(seq_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        used = self.num_blocks - len(self.free_blocks)
        return SchedulerStats(len(self.running), len(self.waiting), used / self.num_blocks)


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
def scheduler() -> FakeScheduler:
    return FakeScheduler()


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
    assert len(scheduler.free_blocks) < scheduler.num_blocks
    await events.aclose()  # the client went away
    await eventually(lambda: scheduler.aborted == [0])
    assert len(scheduler.free_blocks) == scheduler.num_blocks
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
    await eventually(lambda: scheduler.aborted == [0] and not scheduler.has_work())


async def test_eos_stops_counts_the_token_but_shows_no_text(engine, runner):
    runner.scripts[0] = [*b"ok", EOS, *b"never"]
    events = await _collect(engine, _prompt("q"))
    assert "".join(e.text for e in events) == "ok"
    assert events[-1].finish_reason is FinishReason.STOP
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 3


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


async def test_engine_enforces_max_tokens_when_the_scheduler_does_not(engine, scheduler, runner):
    runner.scripts[0] = list(b"abcdef")
    params = SamplingParams(max_tokens=3)
    scheduler.add = _without_limit(scheduler.add)  # type: ignore[method-assign]
    events = [e async for e in engine.generate(_prompt("q"), params)]
    assert "".join(e.text for e in events) == "abc"
    assert events[-1].finish_reason is FinishReason.LENGTH
    await eventually(lambda: not scheduler.has_work())


def _without_limit(add):
    def add_unlimited(seq_id, prompt_ids, sampling, priority):
        add(seq_id, prompt_ids, SamplingParams(max_tokens=1000), priority)

    return add_unlimited


async def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(engine, runner):
    runner.fail_next = True
    with pytest.raises(ModelError, match="device lost"):
        await _collect(engine, _prompt("q"))
    events = await _collect(engine, _prompt("q"), max_tokens=2)
    assert events[-1].finish_reason is FinishReason.LENGTH


async def test_the_scheduler_refusing_a_request_raises_to_its_caller(engine):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidInput, match="priority='bulk'"):
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
