"""The generation scheduler: which requests run each step, and how many tokens each.

One step is a sequence of named phases under ``max_num_batched_tokens`` tokens and
``max_num_seqs`` sequences::

    schedule():            running ──▶ (preempt when blocks run out) ──▶ waiting
                           ──▶ ScheduleResult (the StepInput, and what was preempted)
    update_from_output():  append sampled tokens ──▶ cache full blocks ──▶ max_tokens
                           ──▶ one RequestEvent per request that sampled

*Running* goes first, by class rank then admission: a decode token each, or the next
chunk of a prefill in progress; a prefill chunk never takes the tokens of the decodes
after it. Out of blocks, the tail of that order (lowest class, most recently admitted) is
*preempted by recompute*: blocks freed, ``num_computed_tokens = 0``, back to the front of
its class's waiting queue. *Waiting* requests (class, then arrival) are admitted only in
a step that preempted nothing, sharing their longest cached prefix; a prompt longer than
the budget left is split over steps (chunked prefill); one that does not fit stops
admission, so shorter ones behind it cannot starve it. A *held* request (its client reads
slower than it generates: the engine's back-pressure, :meth:`Scheduler.hold`) is passed
over, running or waiting, until it is let back in. It takes no seat of ``max_num_seqs``,
and it is the first preempted when blocks run out, for a running request or for the head
of the waiting line: a stalled reader never keeps the others out.

A request ends here at ``max_tokens`` (its KV room was reserved for that many); a stop
token or stop string (the output processor, ``output.py``, finds them) or a client that
left ends it through :meth:`Scheduler.finish_request`.

Call ``schedule`` and ``update_from_output`` alternately, from one thread;
``add_request`` and ``finish_request`` may come in between. Blocks freed by
``finish_request`` are reused only by a later ``schedule``, so a step in flight keeps its
K/V.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

from carpool.core.policy import DEFAULT_CLASS, DEFAULT_CLASSES
from carpool.errors import ConfigError, InvalidInput, ModelError
from carpool.generation.kv_cache import CachedPrefix, KVCacheManager
from carpool.generation.request import FinishReason, GenRequest, RequestEvent, RequestStatus
from carpool.generation.types import SamplingParams, SeqChunk, StepInput, StepOutput


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one step, and the priority classes.

    Args:
        max_num_batched_tokens: tokens in one step, prefill and decode together.
        max_num_seqs: sequences running at once (each decodes one token a step).
        long_prefill_token_threshold: most tokens of one prefill chunk; 0: no cap beyond
            the budget.
        classes: priority class names, highest first (those of ``core.policy``).
        default_class: the class of a request that names none.

    Raises:
        ConfigError: naming the first invalid field.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 0
    classes: tuple[str, ...] = tuple(c.name for c in DEFAULT_CLASSES)
    default_class: str = DEFAULT_CLASS

    def __post_init__(self) -> None:
        for name, minimum in (
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", self.max_num_seqs),
            ("long_prefill_token_threshold", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(name, value, f"an integer >= {minimum}")
        if not self.classes or len(set(self.classes)) != len(self.classes):
            raise ConfigError("classes", self.classes, "one or more unique class names")
        if self.default_class not in self.classes:
            raise ConfigError("default_class", self.default_class, f"one of {self.classes}")


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    """One scheduled step: the runner's input, and what the scheduler did to form it."""

    step_input: StepInput
    preempted_request_ids: tuple[int, ...] = ()
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.step_input.chunks


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """What the scheduler and its KV-cache manager count, for metrics (vLLM's names in
    parentheses); every ``num_*`` but the first two only grows."""

    num_running: int  # (num_requests_running)
    num_waiting: int  # (num_requests_waiting)
    kv_cache_usage: float  # blocks in use / all blocks (kv_cache_usage_perc)
    num_prefix_cache_queries: int  # prompt tokens looked up (prefix_cache_queries)
    num_prefix_cache_hits: int  # of those, found cached (prefix_cache_hits)
    num_preemptions: int  # (num_preemptions)
    num_prompt_tokens: int  # of admitted requests, counted once each
    num_generation_tokens: int  # appended to requests
    num_finished: int  # by any reason, aborts included
    num_held: int = 0  # unfinished, out of the steps while their readers are behind


@dataclass(slots=True)
class _StepPlan:
    num_tokens_left: int
    # Seated running decodes not scheduled yet: their tokens are kept for them.
    pending_decodes: set[int] = field(default_factory=set)
    chunks: list[SeqChunk] = field(default_factory=list)
    preempted_request_ids: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


def _running_order(request: GenRequest) -> tuple[int, int]:
    return (request.rank, request.admit_seq)


class Scheduler:
    """Continuous batching over a paged KV cache (see the module docstring).

    Args:
        config: the step limits and priority classes.
        kv_cache: where the requests' K/V lives.
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self._ranks = {name: rank for rank, name in enumerate(config.classes)}
        self._waiting: list[deque[GenRequest]] = [deque() for _ in config.classes]
        self._running: list[GenRequest] = []  # sorted by _running_order
        self._requests: dict[int, GenRequest] = {}  # every unfinished request
        self._finished_seq_ids: list[int] = []
        self._admit_counter = itertools.count()
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # of admitted requests, counted once each
        self.num_generation_tokens = 0
        self.num_finished = 0
        self._num_held = 0

    # -- requests in and out --------------------------------------------------------------

    def add_request(
        self,
        request_id: int,
        prompt_token_ids: tuple[int, ...] | list[int],
        sampling: SamplingParams | None = None,
        *,
        class_name: str | None = None,
        arrival_s: float = 0.0,
    ) -> GenRequest:
        """Queue a request at the back of its class (call in arrival order).

        Raises:
            InvalidInput: a duplicate id, an empty prompt, ``max_tokens < 1``, an unknown
                class, or a sequence longer than the whole KV cache.
        """
        sampling = sampling if sampling is not None else SamplingParams()
        class_name = class_name if class_name is not None else self.config.default_class
        if request_id in self._requests:
            raise InvalidInput("request id already in use", request_id=request_id)
        if not prompt_token_ids:
            raise InvalidInput("the prompt has no tokens", request_id=request_id)
        if sampling.max_tokens < 1:
            raise InvalidInput(
                f"max_tokens={sampling.max_tokens}, expected >= 1", request_id=request_id
            )
        if class_name not in self._ranks:
            raise InvalidInput(
                f"unknown priority class {class_name!r}; expected one of {self.config.classes}",
                request_id=request_id,
            )
        max_positions = len(prompt_token_ids) + sampling.max_tokens - 1  # last token: no K/V
        pool = self.kv_cache.pool
        if self.kv_cache.num_blocks_for(max_positions) > pool.num_blocks:
            raise InvalidInput(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
                f"exceeds the KV cache ({pool.num_blocks * pool.block_size} tokens); "
                "shorten the prompt or lower max_tokens",
                request_id=request_id,
            )
        request = GenRequest(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling=sampling,
            class_name=class_name,
            rank=self._ranks[class_name],
            arrival_s=arrival_s,
        )
        self._requests[request_id] = request
        self._waiting[request.rank].append(request)
        return request

    def finish_request(self, request_id: int, reason: FinishReason) -> RequestEvent | None:
        """Finish a waiting or running request now and free its blocks: ``abort`` when
        its client went away, ``stop`` when its output processor found a stop.

        Returns:
            Its final event, or None when the request is unknown or already finished.
        """
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting[request.rank].remove(request)
        request.status = RequestStatus.finished_by(reason)
        self._release(request)
        return RequestEvent(request_id, (), reason)

    def hold(self, request_id: int, held: bool = True) -> None:
        """Take a request out of the steps (``held``), or let it back in: the engine holds
        one whose client has not read what it already generated. Held, a running request
        keeps its blocks until another request needs them (held ones are preempted
        first) and takes no seat of ``max_num_seqs``; a waiting one is passed over without
        stopping those behind it. An unknown id (a finished request) is ignored."""
        request = self._requests.get(request_id)
        if request is None or request.is_held == held:
            return
        request.is_held = held
        self._num_held += 1 if held else -1

    def get_request(self, request_id: int) -> GenRequest | None:
        """An unfinished request, or None."""
        return self._requests.get(request_id)

    # -- one step -------------------------------------------------------------------------

    def schedule(self) -> ScheduleResult:
        """Form the next step: running requests first, then waiting ones if nothing was
        preempted. Empty only when no request is unfinished (``has_unfinished()``) or every
        unfinished one is held."""
        plan = _StepPlan(num_tokens_left=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted_request_ids:
            self._schedule_waiting(plan)
        finished: tuple[int, ...] = ()
        if plan.chunks:  # otherwise keep them for a step the runner will see
            finished = tuple(self._finished_seq_ids)
            self._finished_seq_ids.clear()
        return ScheduleResult(
            StepInput(tuple(plan.chunks), finished),
            tuple(plan.preempted_request_ids),
            plan.num_prefill_tokens,
            plan.num_decode_tokens,
        )

    def _schedule_running(self, plan: _StepPlan) -> None:
        seated = self._running
        if self._num_held or len(seated) > self.config.max_num_seqs:
            # Held requests sit out; and past max_num_seqs (requests let back in from a
            # hold while others took their seats) the last in the running order wait.
            seated = [r for r in seated if not r.is_held][: self.config.max_num_seqs]
        plan.pending_decodes = {
            r.request_id for r in seated if r.num_tokens - r.num_computed_tokens == 1
        }
        for request in list(seated):  # a copy: preemptions take requests out of _running
            if request.status != RequestStatus.RUNNING:
                continue  # preempted for one before it
            num_new = request.num_tokens - request.num_computed_tokens
            plan.pending_decodes.discard(request.request_id)
            num_new = self._cap_chunk(num_new, plan.num_tokens_left - len(plan.pending_decodes))
            if num_new <= 0:
                continue
            if not self._allocate_or_preempt(request, num_new, plan):
                return  # the request itself was the victim: it was the tail
            self._add_chunk(request, num_new, plan)

    def _allocate_or_preempt(self, request: GenRequest, num_new: int, plan: _StepPlan) -> bool:
        num_total = request.num_computed_tokens + num_new
        while not self.kv_cache.allocate(request.request_id, num_total):
            victim = self._held_victim() or self._running[-1]  # else lowest class, latest
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _held_victim(self) -> GenRequest | None:
        """The running request to preempt first for blocks: a held one (it is not
        stepping), the lowest class and most recently admitted of them."""
        if self._num_held:
            for request in reversed(self._running):
                if request.is_held:
                    return request
        return None

    def _fits_without_held(self, num_total: int, prefix: CachedPrefix) -> bool:
        """Whether a request admitted with ``prefix`` for ``num_total`` tokens would fit
        once every held running request gave its blocks back: else preempting them would
        throw their K/V away for nothing."""
        pool = self.kv_cache.pool
        held_refs = Counter(
            block
            for r in self._running
            if r.is_held
            for block in self.kv_cache.block_table(r.request_id)
        )  # a block the held requests alone hold (a shared prompt's too) is freed
        freed = {block for block, num in held_refs.items() if pool.ref_count(block) == num}
        # A prefix block with no holder left is revived, which takes a free block.
        revived = sum(pool.ref_count(b) == 0 or b in freed for b in prefix.block_ids)
        num_new = max(0, self.kv_cache.num_blocks_for(num_total) - len(prefix.block_ids))
        return num_new + revived <= pool.num_free + len(freed)

    def _preempt(self, victim: GenRequest, plan: _StepPlan) -> None:
        if self._running[-1] is victim:
            self._running.pop()
        else:
            self._running.remove(victim)
        plan.pending_decodes.discard(victim.request_id)
        self.kv_cache.free(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self._waiting[victim.rank].appendleft(victim)
        self.num_preemptions += 1
        plan.preempted_request_ids.append(victim.request_id)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        # Held requests take no seat: a stalled reader must not keep others out.
        num_seated = len(self._running)
        if self._num_held:
            num_seated -= sum(r.is_held for r in self._running)
        while plan.num_tokens_left > 0 and num_seated < self.config.max_num_seqs:
            request = self._next_waiting()
            if request is None:
                return
            while True:
                prefix = CachedPrefix()  # prompt log-probabilities need every position
                if request.sampling.prompt_logprobs is None:
                    prefix = self.kv_cache.find_cached_prefix(request.all_token_ids)
                num_new = self._cap_chunk(
                    request.num_tokens - prefix.num_tokens, plan.num_tokens_left
                )
                first_time = request.num_preemptions == 0  # else its lookup counts no more
                num_total = prefix.num_tokens + num_new
                if self.kv_cache.allocate(request.request_id, num_total, prefix, counts=first_time):
                    break
                victim = self._held_victim()  # nor the blocks a request waits for
                if victim is None or not self._fits_without_held(num_total, prefix):
                    return  # head of line waits for blocks; nothing behind it jumps ahead
                self._preempt(victim, plan)
            queue = self._waiting[request.rank]
            if queue[0] is request:
                queue.popleft()
            else:
                queue.remove(request)  # held ones were passed over
            self._admit(request, prefix.num_tokens)
            self._add_chunk(request, num_new, plan)
            num_seated += 1

    def _next_waiting(self) -> GenRequest | None:
        """The first waiting request not held, by class then arrival."""
        for queue in self._waiting:
            if self._num_held:
                found = next((r for r in queue if not r.is_held), None)
                if found is not None:
                    return found
            elif queue:
                return queue[0]
        return None

    def _admit(self, request: GenRequest, num_cached_tokens: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached_tokens
        if request.num_cached_tokens < 0:  # first admission
            request.num_cached_tokens = num_cached_tokens
            self.num_prompt_tokens += request.num_prompt_tokens
        request.admit_seq = next(self._admit_counter)
        bisect.insort(self._running, request, key=_running_order)

    def _cap_chunk(self, num_new: int, num_room: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            num_new = min(num_new, threshold)
        return min(num_new, num_room)

    def _add_chunk(self, request: GenRequest, num_new: int, plan: _StepPlan) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        needs_logits = end == request.num_tokens
        plan.chunks.append(
            SeqChunk(
                seq_id=request.request_id,
                token_ids=tuple(request.all_token_ids[start:end]),
                start_pos=start,
                block_table=self.kv_cache.block_table(request.request_id),
                needs_logits=needs_logits,
                sampling=request.sampling,
                num_prompt_tokens=request.num_prompt_tokens,
                history=(
                    tuple(request.all_token_ids)
                    if needs_logits and request.sampling.has_penalties
                    else ()
                ),
            )
        )
        plan.num_tokens_left -= num_new
        if num_new == 1 and start >= request.num_prompt_tokens:
            plan.num_decode_tokens += 1
        else:
            plan.num_prefill_tokens += num_new

    # -- after the step ran ---------------------------------------------------------------

    def update_from_output(self, result: ScheduleResult, output: StepOutput) -> list[RequestEvent]:
        """Apply the runner's output for the step ``result`` scheduled: one event per
        request that sampled, finished (``length``) when it reached ``max_tokens``.

        Chunks of requests finished since ``schedule`` are skipped.

        Raises:
            ModelError: when ``output`` does not match the step (no state has changed).
        """
        step = result.step_input
        if len(output.sampled) != len(step.chunks):
            raise ModelError(
                f"runner returned {len(output.sampled)} samples for {len(step.chunks)} chunks"
            )
        for chunk, token_id in zip(step.chunks, output.sampled, strict=True):
            if chunk.needs_logits and token_id is None:
                raise ModelError(
                    "runner sampled no token for a chunk that needs one", request_id=chunk.seq_id
                )
        events: list[RequestEvent] = []
        for chunk, token_id in zip(step.chunks, output.sampled, strict=True):
            request = self._requests.get(chunk.seq_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = chunk.start_pos + len(chunk.token_ids)
            self.kv_cache.cache_full_blocks(
                request.request_id, request.all_token_ids, request.num_computed_tokens
            )
            if chunk.needs_logits and token_id is not None:
                events.append(self._append_token(request, token_id))
        return events

    def _append_token(self, request: GenRequest, token_id: int) -> RequestEvent:
        request.append_output_token(token_id)
        self.num_generation_tokens += 1
        if request.num_output_tokens >= request.sampling.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            self._running.remove(request)
            self._release(request)
        return RequestEvent(request.request_id, (token_id,), request.finish_reason)

    def _release(self, request: GenRequest) -> None:
        if request.is_held:
            request.is_held = False
            self._num_held -= 1
        self.kv_cache.free(request.request_id)
        del self._requests[request.request_id]
        self._finished_seq_ids.append(request.request_id)
        self.num_finished += 1

    # -- metrics --------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._waiting)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            num_prefix_cache_queries=self.kv_cache.num_queried_tokens,
            num_prefix_cache_hits=self.kv_cache.num_hit_tokens,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_finished=self.num_finished,
            num_held=self._num_held,
        )
