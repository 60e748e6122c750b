"""Answering a batch's requests from one model call, and surviving a call that fails.

A call that raises is bisected: each half runs again, down to single requests, so only the
requests that make the model fail get a :class:`ModelError` and the rest get results. Out
of memory is bisected the same way and also noted on the :class:`OomCap`, which lowers the
batch size for a while; a request that runs out of memory alone gets a
:class:`CapacityError`. Only evidence about the batch size lowers the cap: the batch the
scheduler formed (when it has more than one item), and a split whose two halves both ran
out of memory. One request too large for memory fails alone without dragging the cap of
everyone else down to 1. A model that returns the wrong number of outputs, or any other
:class:`MalformedOutput`, fails the whole call (every request gets a :class:`ModelError`
saying what came and what was expected). A call whose turn
comes after a request's deadline (it waited behind the replica's previous batch) does not
run: the expired requests get :class:`DeadlineExceeded`, the others run without them; so
does a call that reaches its turn holding requests their callers cancelled meanwhile (the
cancelled ones are counted as such, never computed). A call that ran past
``batch_timeout_s`` (:class:`~carpool.errors.Hung`) fails every one of its requests
with :class:`BatchTimeout`, without bisecting: halves would hang the same way. A call that
waited behind it on the thread that was given up (``Displaced``) runs again. A call whose
replica process died under it (:class:`~carpool.errors.ReplicaDied`, after it was tried on
another replica) fails every one of its requests with a :class:`ModelError` naming the exit.
"""

from __future__ import annotations

import asyncio
import math
import traceback
from collections.abc import Awaitable, Callable, Hashable

from carpool.core.admission import OomCap
from carpool.core.clock import Clock
from carpool.core.collate import MalformedOutput
from carpool.core.model_call import ModelCall, RunOutput
from carpool.core.replicas import is_out_of_memory
from carpool.core.request import Outcome, Request, RequestState
from carpool.core.telemetry import Telemetry
from carpool.errors import (
    BatchTimeout,
    CallNotRun,
    CapacityError,
    CarpoolError,
    DeadlineExceeded,
    Hung,
    ModelError,
    ReplicaDied,
    StartedLate,
)

# How a call is run again, for a part of its requests: the replica's start.
Start = Callable[[ModelCall], Awaitable[RunOutput]]


class Settler:
    """Resolves each request's future from a model call (see the module docstring)."""

    __slots__ = ("_clock", "_name", "_oom", "_telemetry")

    def __init__(self, telemetry: Telemetry, clock: Clock, oom: OomCap, name: str) -> None:
        self._telemetry = telemetry
        self._clock = clock
        self._oom = oom
        self._name = name  # the model's, for BatchTimeout

    async def settle(
        self, call: ModelCall, attempt: Awaitable[RunOutput], start: Start
    ) -> RunOutput | None:
        """Answer ``call``'s requests from ``attempt`` (``start(call)``, begun already); on
        failure run parts of it again with ``start``.

        Returns the call's output when it succeeded as a whole, else None."""
        output, _ = await self._settle(call, attempt, start, is_split=False)
        return output

    async def _settle(
        self, call: ModelCall, attempt: Awaitable[RunOutput], start: Start, is_split: bool
    ) -> tuple[RunOutput | None, bool]:
        """:meth:`settle`, plus whether this call ran out of memory as a whole."""
        requests = call.requests
        try:
            try:
                output = await attempt
            except (asyncio.CancelledError, GeneratorExit) as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this replica is being stopped: not the model's doing
                # The model raised it (or concurrent.futures.CancelledError, which asyncio
                # turns into CancelledError on the way back from the thread): a model
                # error like any other, not the end of this replica.
                raise _RaisedByModel(exc) from exc
        except Hung as hung:
            for request in requests:
                timeout = BatchTimeout(
                    self._name, hung.timeout_s, hung.replica_id, request_id=request.request_id
                )
                self.fail(request, timeout, hung)
            return None, False
        except ReplicaDied as died:  # not bisected: it ran again elsewhere if it could
            for request in requests:
                self.fail(request, ModelError(str(died), request_id=request.request_id), died)
            return None, False
        except CallNotRun as skipped:
            # The call did not run: its expired (or cancelled) requests leave it, the rest
            # run again without them (all of them, when its thread was given up).
            for request in requests:
                if isinstance(skipped, StartedLate):
                    if request.deadline_s is not None and request.deadline_s <= skipped.started_s:
                        self.expire(request)
                elif request.future.cancelled():
                    self.withdraw(request)
            rest = call.part([r for r in requests if r.state is RequestState.RUNNING])
            if not rest.requests:
                return None, False
            return await self._settle(rest, start(rest), start, is_split)
        except MalformedOutput as exc:
            for request in requests:
                self.fail(request, ModelError(str(exc), request_id=request.request_id), exc)
            return None, False
        except Exception as exc:
            oom = is_out_of_memory(exc)
            num_items = sum(r.num_items for r in requests)
            if oom and not is_split and num_items > 1:
                self._oom.note(num_items, self._clock.now())
            if len(requests) == 1:
                request = requests[0]
                error: CarpoolError
                if oom:
                    error = CapacityError(request.request_id, request.num_items)
                else:
                    raised = exc.raised if isinstance(exc, _RaisedByModel) else exc
                    error = ModelError(
                        f"the model raised {type(raised).__name__}: {raised}",
                        request_id=request.request_id,
                    )
                self.fail(request, error, exc)
                return None, oom
            # The traceback's frames hold what the failed call allocated (its inputs, its
            # activations): release them, and retry only once out of this block, or the
            # halves run out of the memory the failed call still holds. Its pooled input
            # buffers go too (to the collector, not the pool: the model may keep them).
            _clear_frames(exc)
            call.lease = []
        else:
            return self._answer(requests, output), False
        half = len(requests) // 2
        parts = (call.part(requests[:half]), call.part(requests[half:]))
        out_of_memory = [
            (await self._settle(part, start(part), start, is_split=True))[1] for part in parts
        ]
        # Both halves out of memory: the size is too large, not one request in it.
        smaller = min(sum(part.counts) for part in parts)
        if all(out_of_memory) and smaller > 1:
            self._oom.note(smaller, self._clock.now())
        return None, oom

    def _answer(self, requests: list[Request], output: RunOutput) -> RunOutput:
        now = self._clock.now()
        started_s, ended_s, done = output.started_s, output.ended_s, RequestState.DONE
        results = output.results
        try:
            for request, result in zip(requests, results, strict=True):
                request.compute_start_s = started_s
                request.compute_end_s = ended_s
                request.state = done
                future = request.future
                if not future.done():
                    future.set_result(result)
        finally:  # counted together: those answered, also when results ran short
            answered = requests if len(results) >= len(requests) else requests[: len(results)]
            self._telemetry.answered_ok(answered, now)
        return output

    def expire(self, request: Request) -> None:
        """Fail a request whose deadline passed before its model call's turn came."""
        now = self._clock.now()
        request.state = RequestState.EXPIRED
        request.compute_start_s = math.nan  # it never computed
        assert request.deadline_s is not None
        if not request.future.done():
            request.future.set_exception(
                DeadlineExceeded(
                    request.request_id,
                    request.deadline_s - request.arrival_s,
                    now - request.arrival_s,
                )
            )
        self._telemetry.answered(request, Outcome.EXPIRED, now)

    def withdraw(self, request: Request) -> None:
        """Count a request whose caller cancelled it before its model call's turn came:
        it never computed (its future is already cancelled)."""
        request.state = RequestState.CANCELLED
        request.compute_start_s = math.nan
        self._telemetry.answered(request, Outcome.CANCELLED, self._clock.now())

    def fail(self, request: Request, error: CarpoolError, cause: BaseException) -> None:
        now = self._clock.now()
        request.compute_end_s = now
        request.state = RequestState.DONE
        error.__cause__ = cause
        if not request.future.done():
            request.future.set_exception(error)
        outcome = Outcome.OUT_OF_MEMORY if isinstance(error, CapacityError) else Outcome.MODEL_ERROR
        self._telemetry.answered(request, outcome, now)


class _RaisedByModel(Exception):
    """A cancellation-shaped exception (CancelledError, GeneratorExit) that came out of
    the model rather than from stopping the replica."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__(repr(raised))
        self.raised = raised


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames in ``exc``'s traceback and its causes'."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def by_signature(requests: list[Request]) -> list[list[Request]]:
    """Split a batch into groups that can be collated together, keeping order."""
    first = requests[0].signature
    if all(r.signature == first for r in requests):
        return [requests]
    groups: dict[Hashable, list[Request]] = {}
    for request in requests:
        groups.setdefault(request.signature, []).append(request)
    return list(groups.values())
