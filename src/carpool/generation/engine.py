"""The engine: steps the scheduler and the runner, streams each request's text as it comes.

One step, on the event loop except the forward pass (as vLLM v1's ``EngineCore`` steps
its scheduler)::

    join/leave ─▶ schedule() ─▶ runner.execute() ─▶ update_from_output() ─▶ output processor
    (new, ended)   ScheduleResult  (step thread)       RequestEvents            text, stops
         ▲                                                                      │
         └──────────────────── next step ◀──── deltas ─▶ each request's queue ◀─┘

Requests join and leave only between steps: a new request is handed to the scheduler,
and one that ended here (a stop, or its client left) is finished in the scheduler (its
KV blocks freed), right before the next ``schedule()``, so the scheduler is never
touched while the runner works on a step. The forward pass runs on one dedicated thread,
so the event loop keeps serving HTTP while the model computes.

The scheduler ends a request at ``max_tokens``; the output processor ends it at a stop
token (EOS unless ``ignore_eos``, ``stop_token_ids``) or a stop string, and holds back
text that could be the start of one.

Back-pressure: a request whose consumer has ``max_unread_events`` events not yet taken (a
streaming client that stopped reading: its connection waits for the client, and so stops
taking) is *held* out of the steps (``Scheduler.hold``) until its consumer has taken half
of them; the others step on. What a stalled reader costs is then bounded by that queue,
not by its ``max_tokens`` and ``n``; its KV blocks stay until a preemption needs them.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol

from carpool.core.clock import Clock, MonotonicClock
from carpool.errors import Closed, ConfigError, InvalidInput, ModelError
from carpool.generation.output import OutputProcessor, OutputState
from carpool.generation.request import FinishReason, RequestEvent
from carpool.generation.scheduler import Scheduler, ScheduleResult
from carpool.generation.telemetry import (
    EngineTelemetry,
    GenerationSnapshot,
    GenerationTrace,
    RequestTimes,
)
from carpool.generation.tokenizer import Tokenizer, check_token_ids
from carpool.generation.types import (
    SamplingParams,
    SeqChunk,
    StepInput,
    StepOutput,
    TokenLogprobs,
)

log = logging.getLogger("carpool.generation")
# Events a request's consumer may leave untaken before the request is held out of the
# steps: a client this many tokens behind its stream (module docstring, back-pressure).
DEFAULT_MAX_UNREAD_EVENTS = 32
GenerationTraceHook = Callable[[GenerationTrace], None]


class StepRunner(Protocol):
    """Runs one step's forward pass and samples (``runner.ModelRunner``, or a test's fake)."""

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
    ``usage``. ``text`` may be empty while a character or a possible stop string is held.
    ``logprobs``: one per token of ``token_ids`` when the request asked for them;
    ``prompt_logprobs``: on the first event, the prompt's tokens after its first, when the
    request asked (``SamplingParams.prompt_logprobs``)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


class _Stream:
    """One request in flight: its queue of events, its output state and its times."""

    __slots__ = (
        "events", "is_done", "is_held", "output", "priority", "prompt_ids", "prompt_logprobs",
        "sampling", "steps", "times",
    )  # fmt: skip

    def __init__(
        self,
        prompt_ids: tuple[int, ...],
        sampling: SamplingParams,
        priority: str | None,
        output: OutputState,
        now: float,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.priority = priority
        self.output = output
        self.events: asyncio.Queue[GenerationEvent | BaseException] = asyncio.Queue()
        self.times = RequestTimes(now, len(prompt_ids))
        self.is_done = False
        self.is_held = False  # out of the steps until its consumer catches up
        self.steps: list[tuple[float, float]] = []  # kept only while a trace hook is on
        # Scored so far; None once sent with the first event (a recompute scores again).
        self.prompt_logprobs: list[TokenLogprobs] | None = []


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class GenerationEngine:
    """Continuous batching for one model: :meth:`generate` streams, :meth:`start` and
    :meth:`stop` bracket the step loop (as :class:`~carpool.core.batcher.Batcher` does).

    Args:
        scheduler: decides each step; the engine is its only caller once started.
        runner: runs each step's forward pass and samples.
        tokenizer: decodes tokens to text; its EOS ids stop requests.
        name: the model's name in telemetry and thread names.
        max_model_len: the most tokens (prompt + output) one sequence may hold.
        model_vocab_size: the rows of the model's embedding, where the tokenizer's
            vocabulary may be larger (a token added to a folder's tokenizer without
            resizing the model); token ids are checked against the smaller
            (:attr:`vocab_size`). None: the tokenizer's.
        clock: time source; tests pass a FakeClock.
        max_unread_events: events a request's consumer may leave untaken before the
            request is held out of the steps (see the module docstring).

    Raises:
        ConfigError: ``max_unread_events`` is not an integer >= 2.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: StepRunner,
        tokenizer: Tokenizer,
        *,
        name: str = "model",
        max_model_len: int,
        model_vocab_size: int | None = None,
        clock: Clock | None = None,
        max_unread_events: int = DEFAULT_MAX_UNREAD_EVENTS,
    ) -> None:
        if (
            isinstance(max_unread_events, bool)
            or not isinstance(max_unread_events, int)
            or max_unread_events < 2
        ):
            raise ConfigError("max_unread_events", max_unread_events, "an integer >= 2")
        self.name = name
        self._max_unread_events = max_unread_events
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # Token ids a request may name (prompt, stop_token_ids, logit_bias): one past the
        # model's embedding would fail the whole step, and every request batched in it.
        self.vocab_size = tokenizer.vocab_size
        if model_vocab_size is not None and model_vocab_size < tokenizer.vocab_size:
            log.warning(
                "model %r: its tokenizer has %d token ids, its embedding %d rows; "
                "requests naming ids from %d on are refused",
                name,
                tokenizer.vocab_size,
                model_vocab_size,
                model_vocab_size,
            )
            self.vocab_size = model_vocab_size
        self._scheduler = scheduler
        self._runner = runner
        self._outputs = OutputProcessor(tokenizer)
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._streams: dict[int, _Stream] = {}
        self._joining: list[int] = []
        self._leaving: list[tuple[int, FinishReason]] = []
        self._resuming: list[int] = []  # held, and their consumers caught up
        self._seq_ids = itertools.count()
        self._wake = asyncio.Event()
        self._state = _State.NEW
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._telemetry = EngineTelemetry()
        self._on_trace: GenerationTraceHook | None = None

    def kernels(self) -> dict[str, str]:
        """The kernels its forward pass runs, where its runner says: ``decode_attention``
        (``kernel`` or ``torch``), ``linear`` (``carpool-packed``, ``onednn-prepacked`` or
        ``aten-linear``), ``elementwise`` (norms, rotary, SiLU-and-multiply:
        ``carpool-fused`` or ``torch``) and ``huge_pages`` (the KV cache's and packed
        weights' pages: ``madvise``, ``always`` or ``off: <why>``)."""
        found: dict[str, str] = {}
        for key, attr in (
            ("decode_attention", "decode_attention_path"),
            ("linear", "linear_path"),
            ("elementwise", "elementwise_path"),
            ("huge_pages", "huge_pages"),
        ):
            value = getattr(self._runner, attr, None)
            if isinstance(value, str):
                found[key] = value
        return found

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
                vocabulary, or does not leave room for one token; when the scheduler
                refuses it (an unknown priority class, longer than the KV cache).
            ModelError: when a step with this request failed.
        """
        if self._state is not _State.RUNNING:
            raise Closed(self.name)
        prompt = tuple(prompt_ids)
        self._check(prompt, sampling)
        if sampling.min_tokens and not sampling.ignore_eos:  # the sampler holds EOS back too
            sampling = replace(sampling, eos_token_ids=self.tokenizer.eos_token_ids)
        seq_id = next(self._seq_ids)
        output = self._outputs.start(prompt, sampling)
        stream = _Stream(prompt, sampling, priority, output, self._clock.now())
        self._streams[seq_id] = stream
        self._joining.append(seq_id)
        self._wake.set()
        try:
            while True:
                event = await stream.events.get()
                if stream.is_held and stream.events.qsize() <= self._max_unread_events // 2:
                    stream.is_held = False
                    self._resuming.append(seq_id)
                    self._wake.set()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not stream.is_done:  # the consumer left early: leave at the next step
                self._finish(seq_id, FinishReason.ABORT, self._clock.now())

    def set_trace_hook(self, hook: GenerationTraceHook | None) -> None:
        """Call ``hook`` with each finished request's :class:`GenerationTrace` from now
        on (its steps: those run while the hook was on); None: no hook, nothing kept."""
        self._on_trace = hook

    def snapshot(self, *, quantiles: bool = True) -> GenerationSnapshot:
        """What the engine measured so far; ``quantiles=False`` leaves the percentiles
        NaN and skips their sort (``/metrics`` reads counts, sums and buckets only)."""
        return self._telemetry.snapshot(self.name, self._scheduler.stats(), quantiles)

    def _check(self, prompt: tuple[int, ...], sampling: SamplingParams) -> None:
        if not prompt:
            raise InvalidInput("the prompt is empty; expected at least one token")
        # An id past the embedding would fail the whole step, and every request batched in it.
        check_token_ids(prompt, self.vocab_size)
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
            if not self._scheduler.has_unfinished():
                if self._state is _State.DRAINING and not self._streams:
                    return
                await self._idle()
                continue
            try:
                result = self._scheduler.schedule()
            except Exception as error:  # a scheduler bug: fail everyone rather than hang
                self._fail_all(error)
                continue
            if result.is_empty:
                await self._idle()  # nothing can run until a request joins or leaves
                continue
            self._mark_scheduled(result)
            started_s = self._clock.now()
            chunks = result.step_input.chunks
            try:
                output = await loop.run_in_executor(
                    self._executor, self._runner.execute, result.step_input
                )
                compute_s = self._clock.now() - started_s
                events = self._scheduler.update_from_output(result, output)
            except Exception as error:
                self._fail(chunks, error)
                continue
            self._telemetry.step(len(chunks), compute_s)
            if self._on_trace is not None:
                self._record_step(chunks, started_s, started_s + compute_s)
            now = self._clock.now()
            if output.prompt_logprobs:
                self._gather_prompt_logprobs(chunks, output.prompt_logprobs)
            logprobs = {
                c.seq_id: found
                for c, found in zip(chunks, output.logprobs, strict=False)  # () when none asked
                if found is not None
            }
            for event in events:
                try:
                    self._deliver(event, now, logprobs.get(event.request_id))
                except Exception as error:  # its text could not be made: it alone fails
                    log.exception(
                        "model %r: delivering sequence %d failed", self.name, event.request_id
                    )
                    self._fail_seqs([event.request_id], error)

    def _gather_prompt_logprobs(
        self, chunks: Sequence[SeqChunk], found: Sequence[tuple[TokenLogprobs, ...]]
    ) -> None:
        for chunk, scored in zip(chunks, found, strict=True):
            stream = self._streams.get(chunk.seq_id)
            if stream is None or stream.prompt_logprobs is None:
                continue
            if chunk.start_pos == 0:
                # The prompt's first chunk: a recompute (after a preemption) starts
                # afresh, even from a chunk that scores nothing yet (one token: its
                # row's score waits for the next chunk's first token).
                stream.prompt_logprobs.clear()
            stream.prompt_logprobs.extend(scored)

    @staticmethod
    def _take_prompt_logprobs(stream: _Stream) -> tuple[TokenLogprobs, ...]:
        found = stream.prompt_logprobs
        stream.prompt_logprobs = None
        return tuple(found) if found is not None else ()

    def _record_step(self, chunks: Sequence[SeqChunk], started_s: float, ended_s: float) -> None:
        for chunk in chunks:
            stream = self._streams.get(chunk.seq_id)
            if stream is not None:
                stream.steps.append((started_s, ended_s))

    def _report(self, seq_id: int, stream: _Stream, outcome: str, now: float) -> None:
        hook, times = self._on_trace, stream.times
        if hook is None:
            return
        nan = math.nan
        trace = GenerationTrace(
            request_id=seq_id,
            class_name=stream.priority or "default",
            outcome=outcome,
            num_prompt_tokens=times.num_prompt_tokens,
            num_generated=times.num_generated,
            arrived_s=times.arrival_s,
            scheduled_s=nan if times.scheduled_s is None else times.scheduled_s,
            first_token_s=nan if times.first_token_s is None else times.first_token_s,
            answered_s=now,
            steps=tuple(stream.steps),
        )
        try:
            hook(trace)
        except Exception:  # a faulty hook must not strand the other requests
            log.exception("model %r: the trace hook raised", self.name)

    async def _idle(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    def _join_and_leave(self) -> None:
        joining, self._joining = self._joining, []
        for seq_id in joining:
            stream = self._streams.get(seq_id)
            if stream is None:
                continue  # left before it joined
            try:
                self._scheduler.add_request(
                    seq_id,
                    stream.prompt_ids,
                    stream.sampling,
                    class_name=stream.priority,
                    arrival_s=stream.times.arrival_s,
                )
            except Exception as error:
                del self._streams[seq_id]
                stream.is_done = True
                stream.events.put_nowait(error)
        resuming, self._resuming = self._resuming, []
        for seq_id in resuming:
            self._scheduler.hold(seq_id, held=False)  # a no-op for one finished since
        leaving, self._leaving = self._leaving, []
        for seq_id, reason in leaving:
            try:  # a no-op for one the scheduler finished itself (length)
                self._scheduler.finish_request(seq_id, reason)
            except Exception:  # a scheduler bug: the loop must go on serving the others
                log.exception("model %r: finishing sequence %d failed", self.name, seq_id)

    def _mark_scheduled(self, result: ScheduleResult) -> None:
        now = self._clock.now()
        for chunk in result.step_input.chunks:
            stream = self._streams.get(chunk.seq_id)
            if stream is not None:
                self._telemetry.scheduled(stream.times, now)

    def _deliver(self, event: RequestEvent, now: float, found: TokenLogprobs | None) -> None:
        stream = self._streams.get(event.request_id)
        if stream is None:
            return  # aborted while its step ran
        delta = stream.output.process(event.new_token_ids, event.finish_reason)
        logprobs = (found,) if found is not None and delta.token_ids else ()
        if delta.token_ids:
            self._telemetry.tokens(stream.times, len(delta.token_ids), now)
        if delta.finish_reason is None:
            if delta.token_ids:
                prompt = self._take_prompt_logprobs(stream)
                stream.events.put_nowait(
                    GenerationEvent(delta.text, delta.token_ids, None, None, logprobs, prompt)
                )
                if not stream.is_held and stream.events.qsize() >= self._max_unread_events:
                    stream.is_held = True  # its consumer is behind: let it catch up
                    self._scheduler.hold(event.request_id)
            return
        self._finish(event.request_id, delta.finish_reason, now, delta.token_ids, logprobs)

    def _finish(
        self,
        seq_id: int,
        reason: FinishReason,
        now: float,
        token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> None:
        """End ``seq_id`` for ``reason``: its last event carries the text still held."""
        stream = self._streams.pop(seq_id, None)
        if stream is None:
            return
        stream.is_done = True
        self._leaving.append((seq_id, reason))
        self._wake.set()
        usage = Usage(len(stream.prompt_ids), stream.times.num_generated)
        text = stream.output.pending_text
        prompt = self._take_prompt_logprobs(stream)
        stream.events.put_nowait(GenerationEvent(text, token_ids, reason, usage, logprobs, prompt))
        self._telemetry.finished(stream.times, reason.value, now)
        self._report(seq_id, stream, reason.value, now)

    def _fail_all(self, error: Exception) -> None:
        log.exception("model %r: the scheduler failed", self.name)
        self._fail_seqs(list(self._streams), error)

    def _fail(self, chunks: Sequence[SeqChunk], error: Exception) -> None:
        log.exception("model %r: a step of %d sequences failed", self.name, len(chunks))
        self._fail_seqs([c.seq_id for c in chunks], error)

    def cut_off(self) -> int:
        """Fail every request still in flight with :class:`Closed` (a drain cut off at its
        deadline): each is answered (503, or an error event on a stream already begun),
        not left for its connection to be closed unanswered. Returns how many."""
        if self._state is _State.NEW or self._state is _State.STOPPED:
            return 0
        seq_ids = list(self._streams)
        self._end_seqs(seq_ids, lambda: Closed(self.name), "abort")
        return len(seq_ids)

    def _fail_seqs(self, seq_ids: list[int], error: Exception) -> None:
        def failure() -> Exception:
            failed = ModelError(f"generation step failed: {type(error).__name__}: {error}")
            failed.__cause__ = error
            return failed

        self._end_seqs(seq_ids, failure, "error")

    def _end_seqs(self, seq_ids: list[int], error: Callable[[], Exception], outcome: str) -> None:
        """End ``seq_ids`` now, each stream given ``error()``; counted as ``outcome``."""
        now = self._clock.now()
        for seq_id in seq_ids:
            stream = self._streams.pop(seq_id, None)
            if stream is None:
                continue
            stream.is_done = True
            self._leaving.append((seq_id, FinishReason.ABORT))
            stream.events.put_nowait(error())
            self._telemetry.finished(stream.times, outcome, now)
            self._report(seq_id, stream, outcome, now)
        self._wake.set()
