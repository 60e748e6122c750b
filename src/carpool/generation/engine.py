"""The engine: steps scheduler and runner, streams each request's tokens as they come.

One step, on the event loop except the forward pass::

    join/leave ─▶ scheduler.schedule() ─▶ runner.execute(step) ─▶ scheduler.update(...)
    (new and            (loop)               (step thread)               (loop)
    cancelled)                                                             │
         ▲                                         text deltas ─▶ each request's queue
         └──────────────────────────── next step ◀────────────────────────┘

Requests join and leave only between steps: a new request is handed to the scheduler, and
a cancelled one aborted (its KV blocks freed), right before the next ``schedule()``, so
the scheduler is never touched while the runner works on a step. The forward pass runs
on one dedicated thread, so the event loop keeps serving HTTP while the model computes.

The engine enforces ``max_tokens``, stop token ids (EOS unless ``ignore_eos``) and stop
strings itself, on top of whatever the scheduler reports: a scheduler that finishes a
request late costs a step, never a wrong answer. Stop strings are matched on the text,
and text that could be the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from carpool.core.clock import Clock, MonotonicClock
from carpool.core.telemetry import LATENCY_BUCKETS_S, Histogram, LatencyStats
from carpool.errors import Closed, InvalidInput, ModelError
from carpool.generation.request import FinishReason
from carpool.generation.tokenizer import IncrementalDetokenizer, Tokenizer, check_token_ids
from carpool.generation.types import SamplingParams, SeqChunk, StepInput, StepOutput

log = logging.getLogger("carpool.generation")

# A request's own latencies (first token, end to end, queue): generations may run for
# minutes, so the buckets go on past the core's 60 s, as vLLM's do.
REQUEST_LATENCY_BUCKETS_S = (*LATENCY_BUCKETS_S, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Inter-token latencies are short: finer buckets at the low end than request latency.
TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SeqUpdate:
    """The scheduler's news about one sequence after a step."""

    seq_id: int
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counters the scheduler and KV-cache manager keep (vLLM's names in parentheses)."""

    num_running: int = 0  # (num_requests_running)
    num_waiting: int = 0  # (num_requests_waiting)
    kv_cache_usage: float = 0.0  # blocks in use / all blocks (kv_cache_usage_perc)
    num_prefix_cache_queries: int = 0  # prompt tokens looked up (prefix_cache_queries)
    num_prefix_cache_hits: int = 0  # of those, found cached (prefix_cache_hits)
    num_preemptions: int = 0  # (num_preemptions)


class StepScheduler(Protocol):
    """What the engine needs from a scheduler (``server/generation.py`` adapts the real one)."""

    def add(
        self,
        seq_id: int,
        prompt_ids: tuple[int, ...],
        sampling: SamplingParams,
        priority: str | None,
    ) -> None:
        """Queue a sequence; raises InvalidInput when it can never run (too long, bad class)."""
        ...

    def schedule(self) -> StepInput:
        """The next step; empty only when nothing can run until a sequence joins or leaves."""
        ...

    def update(self, step: StepInput, output: StepOutput) -> Sequence[SeqUpdate]: ...

    def abort(self, seq_id: int) -> None:
        """Forget ``seq_id`` and free its blocks; a no-op for an unknown or finished one."""
        ...

    def has_work(self) -> bool: ...

    def stats(self) -> SchedulerStats: ...


class StepRunner(Protocol):
    def execute(self, step: StepInput) -> StepOutput: ...


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    """What one step produced for one request; the last event has ``finish_reason`` and
    ``usage``. ``text`` may be empty while a character or a possible stop string is held."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class RequestTotals:
    """Requests that ended one way, and their seconds summed: ``e2e_s`` from arrival to
    the end, ``queue_s`` from arrival to the first step that scheduled them (0 for one
    never scheduled)."""

    count: int = 0
    e2e_s: float = 0.0
    queue_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StepTotals:
    """Forward passes of one size (sequences in the step) that ran, and their seconds."""

    count: int = 0
    compute_s: float = 0.0


@dataclass(frozen=True, slots=True)
class GenerationSnapshot:
    """Everything measured so far; :mod:`carpool.server.metrics` and
    :mod:`carpool.server.stats` export it."""

    model: str
    scheduler: SchedulerStats
    num_prompt_tokens: int
    num_generation_tokens: int
    finished: dict[str, int]  # by finish reason (and "error")
    time_to_first_token: LatencyStats
    inter_token_latency: LatencyStats
    e2e_latency: LatencyStats
    queue_time: LatencyStats
    succeeded: RequestTotals  # finished by stop or length
    failed: RequestTotals  # finished by abort (left early, stopped) or error
    last_succeeded_unix_s: float | None  # wall time the last one succeeded
    num_steps: int  # forward passes that ran (their tokens were delivered)
    steps_by_size: dict[int, StepTotals]  # the same, by sequences in the step


class _Stream:
    """One request in flight: its queue of events, text state and timestamps."""

    __slots__ = (
        "arrival_s",
        "detokenizer",
        "events",
        "first_token_s",
        "is_done",
        "last_token_s",
        "num_generated",
        "pending_text",
        "prompt_ids",
        "sampling",
        "scheduled_s",
        "stop_ids",
    )

    def __init__(
        self,
        prompt_ids: tuple[int, ...],
        sampling: SamplingParams,
        stop_ids: frozenset[int],
        detokenizer: IncrementalDetokenizer,
        now: float,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.detokenizer = detokenizer
        self.events: asyncio.Queue[GenerationEvent | BaseException] = asyncio.Queue()
        self.arrival_s = now
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s = now
        self.num_generated = 0
        self.pending_text = ""  # decoded, not yet sent: may begin a stop string
        self.is_done = False


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class GenerationEngine:
    """Continuous batching for one model: :meth:`generate` streams, :meth:`start` and
    :meth:`stop` bracket the step loop (as :class:`~carpool.core.batcher.Batcher` does).

    Args:
        scheduler: decides each step (see :class:`StepScheduler`).
        runner: runs each step's forward pass and samples.
        tokenizer: decodes tokens to text; its EOS ids stop requests.
        name: the model's name in telemetry and thread names.
        max_model_len: the most tokens (prompt + output) one sequence may hold.
        clock: time source; tests pass a FakeClock.
    """

    def __init__(
        self,
        scheduler: StepScheduler,
        runner: StepRunner,
        tokenizer: Tokenizer,
        *,
        name: str = "model",
        max_model_len: int,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._scheduler = scheduler
        self._runner = runner
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._streams: dict[int, _Stream] = {}
        self._joining: list[tuple[int, str | None]] = []
        self._leaving: list[int] = []
        self._seq_ids = itertools.count()
        self._wake = asyncio.Event()
        self._state = _State.NEW
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._telemetry = _Telemetry()

    @property
    def is_running(self) -> bool:
        return self._state is _State.RUNNING

    @property
    def num_active(self) -> int:
        """Requests joined and not yet finished."""
        return len(self._streams)

    async def start(self) -> None:
        """Start the step loop. Idempotent."""
        if self._state is _State.RUNNING:
            return
        if self._state is not _State.NEW:
            raise Closed(self.name)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"carpool-{self.name}-step")
        self._state = _State.RUNNING
        self._task = asyncio.get_running_loop().create_task(
            self._loop(), name=f"carpool-{self.name}-engine"
        )

    async def stop(self, drain: bool = True) -> None:
        """Stop accepting requests. With ``drain`` every request in flight runs to its end;
        without it each ends now with ``finish_reason`` abort. Returns when the loop ended."""
        if self._state is not _State.RUNNING:
            return
        self._state = _State.DRAINING
        if not drain:
            for seq_id in list(self._streams):
                self._finish(seq_id, FinishReason.ABORT, self._clock.now())
        self._wake.set()
        assert self._task is not None
        try:
            await self._task
        finally:
            assert self._executor is not None
            self._executor.shutdown(wait=True)
            self._state = _State.STOPPED

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, priority: str | None = None
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Stream what the model generates after ``prompt_ids``.

        Yields events as steps produce them; the last has ``finish_reason`` and ``usage``.
        Closing the iterator early, or cancelling its consumer, aborts the request and
        frees its KV blocks at the next step.

        Raises:
            Closed: when the engine is not running.
            InvalidInput: when the prompt is empty, holds an id outside the tokenizer's
                vocabulary, or does not leave room for one token.
            ModelError: when a step with this request failed.
        """
        if self._state is not _State.RUNNING:
            raise Closed(self.name)
        prompt = tuple(prompt_ids)
        self._check(prompt, sampling)
        stop_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        )
        seq_id = next(self._seq_ids)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt)
        stream = _Stream(prompt, sampling, stop_ids, detokenizer, self._clock.now())
        self._streams[seq_id] = stream
        self._joining.append((seq_id, priority))
        self._wake.set()
        try:
            while True:
                event = await stream.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not stream.is_done:  # the consumer left early: leave at the next step
                self._finish(seq_id, FinishReason.ABORT, self._clock.now())

    def snapshot(self, *, quantiles: bool = True) -> GenerationSnapshot:
        """What the engine measured so far; ``quantiles=False`` leaves the percentiles
        NaN and skips their sort (``/metrics`` reads counts, sums and buckets only)."""
        return self._telemetry.snapshot(self.name, self._scheduler.stats(), quantiles)

    def _check(self, prompt: tuple[int, ...], sampling: SamplingParams) -> None:
        if not prompt:
            raise InvalidInput("the prompt is empty; expected at least one token")
        # An id past the embedding would fail the whole step, and every request batched in it.
        check_token_ids(prompt, self.tokenizer.vocab_size)
        if len(prompt) >= self.max_model_len:
            raise InvalidInput(
                f"the prompt has {len(prompt)} tokens; this model holds at most "
                f"{self.max_model_len} tokens per sequence, prompt and output together"
            )
        if len(prompt) + sampling.max_tokens > self.max_model_len:
            raise InvalidInput(
                f"the prompt ({len(prompt)} tokens) and max_tokens ({sampling.max_tokens}) add "
                f"up to more than this model's {self.max_model_len} tokens per sequence; "
                f"lower max_tokens to {self.max_model_len - len(prompt)} or less"
            )

    # -- the step loop ----------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._join_and_leave()
            if not self._scheduler.has_work():
                if self._state is _State.DRAINING and not self._streams:
                    return
                await self._idle()
                continue
            try:
                step = self._scheduler.schedule()
            except Exception as error:  # a scheduler bug: fail everyone rather than hang
                self._fail_all(error)
                continue
            if not step.chunks:
                await self._idle()  # nothing can run until a request joins or leaves
                continue
            self._mark_scheduled(step)
            started_s = self._clock.now()
            try:
                output = await loop.run_in_executor(self._executor, self._runner.execute, step)
                compute_s = self._clock.now() - started_s
                updates = self._scheduler.update(step, output)
            except Exception as error:
                self._fail(step.chunks, error)
                continue
            self._telemetry.step(len(step.chunks), compute_s)
            now = self._clock.now()
            for update in updates:
                try:
                    self._deliver(update, now)
                except Exception as error:  # its text could not be made: it alone fails
                    log.exception(
                        "model %r: delivering sequence %d failed", self.name, update.seq_id
                    )
                    self._fail_seqs([update.seq_id], error)

    async def _idle(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    def _join_and_leave(self) -> None:
        joining, self._joining = self._joining, []
        for seq_id, priority in joining:
            stream = self._streams.get(seq_id)
            if stream is None:
                continue  # left before it joined
            try:
                self._scheduler.add(seq_id, stream.prompt_ids, stream.sampling, priority)
            except Exception as error:
                del self._streams[seq_id]
                stream.is_done = True
                stream.events.put_nowait(error)
        leaving, self._leaving = self._leaving, []
        for seq_id in leaving:
            try:
                self._scheduler.abort(seq_id)
            except Exception:  # a scheduler bug: the loop must go on serving the others
                log.exception("model %r: aborting sequence %d failed", self.name, seq_id)

    def _mark_scheduled(self, step: StepInput) -> None:
        now = self._clock.now()
        for chunk in step.chunks:
            stream = self._streams.get(chunk.seq_id)
            if stream is not None and stream.scheduled_s is None:
                stream.scheduled_s = now
                self._telemetry.queue_time.observe(now - stream.arrival_s)

    def _deliver(self, update: SeqUpdate, now: float) -> None:
        stream = self._streams.get(update.seq_id)
        if stream is None:
            return  # aborted while its step ran
        limit = stream.sampling.max_tokens - stream.num_generated
        token_ids = update.new_token_ids[:limit]
        reason = update.finish_reason
        text_ids = token_ids
        for i, token in enumerate(token_ids):
            if token in stream.stop_ids:  # the stop token counts, its text is not shown
                token_ids, text_ids, reason = token_ids[: i + 1], token_ids[:i], FinishReason.STOP
                break
        if token_ids:
            self._telemetry.tokens(stream, len(token_ids), now)
        if reason is None and stream.num_generated >= stream.sampling.max_tokens:
            reason = FinishReason.LENGTH
        text = stream.pending_text + stream.detokenizer.push(text_ids)
        stop_at = _find_stop(text, stream.sampling.stop)
        if stop_at is not None:
            text, reason = text[:stop_at], FinishReason.STOP
        if reason is None:
            held = _held_back(text, stream.sampling.stop)
            sent, stream.pending_text = text[: len(text) - held], text[len(text) - held :]
            if token_ids:
                stream.events.put_nowait(GenerationEvent(sent, token_ids))
            return
        if stop_at is None:
            text += stream.detokenizer.flush()
        stream.pending_text = text
        self._finish(update.seq_id, reason, now, token_ids)

    def _finish(
        self, seq_id: int, reason: FinishReason, now: float, token_ids: tuple[int, ...] = ()
    ) -> None:
        stream = self._streams.pop(seq_id, None)
        if stream is None:
            return
        stream.is_done = True
        self._leaving.append(seq_id)  # the scheduler forgets it (a no-op if it finished it)
        self._wake.set()
        usage = Usage(len(stream.prompt_ids), stream.num_generated)
        stream.events.put_nowait(GenerationEvent(stream.pending_text, token_ids, reason, usage))
        self._telemetry.finished(stream, reason.value, now)

    def _fail_all(self, error: Exception) -> None:
        log.exception("model %r: the scheduler failed", self.name)
        self._fail_seqs(list(self._streams), error)

    def _fail(self, chunks: Sequence[SeqChunk], error: Exception) -> None:
        log.exception("model %r: a step of %d sequences failed", self.name, len(chunks))
        self._fail_seqs([c.seq_id for c in chunks], error)

    def _fail_seqs(self, seq_ids: list[int], error: Exception) -> None:
        now = self._clock.now()
        for seq_id in seq_ids:
            stream = self._streams.pop(seq_id, None)
            if stream is None:
                continue
            stream.is_done = True
            self._leaving.append(seq_id)
            failure = ModelError(f"generation step failed: {type(error).__name__}: {error}")
            failure.__cause__ = error
            stream.events.put_nowait(failure)
            self._telemetry.finished(stream, "error", now)


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin a stop string."""
    longest = max((len(s) for s in stops), default=0)
    for size in range(min(len(text), longest - 1), 0, -1):
        tail = text[-size:]
        if any(s.startswith(tail) for s in stops):
            return size
    return 0


class _Telemetry:
    """Token counters and latency histograms (the scheduler keeps the rest)."""

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.finished_by_reason: dict[str, int] = {}
        self.time_to_first_token = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.inter_token_latency = Histogram(TOKEN_LATENCY_BUCKETS_S)
        self.e2e_latency = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.succeeded = RequestTotals()
        self.failed = RequestTotals()
        self.last_succeeded_unix_s: float | None = None
        self.num_steps = 0
        self.steps_by_size: dict[int, StepTotals] = {}

    def step(self, num_seqs: int, compute_s: float) -> None:
        self.num_steps += 1
        totals = self.steps_by_size.get(num_seqs, StepTotals())
        self.steps_by_size[num_seqs] = StepTotals(totals.count + 1, totals.compute_s + compute_s)

    def tokens(self, stream: _Stream, count: int, now: float) -> None:
        if stream.first_token_s is None:
            stream.first_token_s = now
            self.time_to_first_token.observe(now - stream.arrival_s)
            self.num_prompt_tokens += len(stream.prompt_ids)
        else:
            self.inter_token_latency.observe((now - stream.last_token_s) / count)
        stream.last_token_s = now
        stream.num_generated += count
        self.num_generation_tokens += count

    def finished(self, stream: _Stream, reason: str, now: float) -> None:
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        e2e_s = now - stream.arrival_s
        self.e2e_latency.observe(e2e_s)
        queue_s = 0.0 if stream.scheduled_s is None else stream.scheduled_s - stream.arrival_s
        if reason in (FinishReason.STOP.value, FinishReason.LENGTH.value):
            self.succeeded = _add(self.succeeded, e2e_s, queue_s)
            self.last_succeeded_unix_s = time.time()  # once per request: wall time for stats
        else:
            self.failed = _add(self.failed, e2e_s, queue_s)

    def snapshot(
        self, model: str, scheduler: SchedulerStats, quantiles: bool = True
    ) -> GenerationSnapshot:
        return GenerationSnapshot(
            model=model,
            scheduler=scheduler,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            finished=dict(self.finished_by_reason),
            time_to_first_token=self.time_to_first_token.stats(quantiles=quantiles),
            inter_token_latency=self.inter_token_latency.stats(quantiles=quantiles),
            e2e_latency=self.e2e_latency.stats(quantiles=quantiles),
            queue_time=self.queue_time.stats(quantiles=quantiles),
            succeeded=self.succeeded,
            failed=self.failed,
            last_succeeded_unix_s=self.last_succeeded_unix_s,
            num_steps=self.num_steps,
            steps_by_size=dict(self.steps_by_size),
        )


def _add(totals: RequestTotals, e2e_s: float, queue_s: float) -> RequestTotals:
    return RequestTotals(totals.count + 1, totals.e2e_s + e2e_s, totals.queue_s + queue_s)
