"""One model call and its results: what a replica (:mod:`carpool.core.replicas`, a
process or Ray replica) is handed and gives back.

A :class:`ModelCall` is the requests of one batch whose payloads go through the model
together, the collator that joins them (into pooled buffers, when the batcher has a
pool) and the batch's :class:`Cancels`; a :class:`RunOutput` is one result per request
and when the call ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from carpool.core.collate import Collator
from carpool.core.collate_pool import PooledCollator
from carpool.core.request import Request
from carpool.errors import StartedLate, Withdrawn

__all__ = ["Cancels", "ModelCall", "RunOutput"]


@dataclass(frozen=True, slots=True)
class RunOutput:
    """One model call's results (one per payload) and when it really ran."""

    results: list[Any]
    started_s: float
    ended_s: float
    # A model in steps on the event loop (carpool.core.stepwise): the seconds its steps
    # took, without the loop's other work between them; None: it ran in one go.
    model_s: float | None = None


class Cancels:
    """Whether a caller cancelled a request of a launched batch. Set on the loop, read by
    the replica's thread when one of the batch's model calls reaches its turn: only then
    are the call's requests looked at, so a batch nobody cancels pays one attribute read
    per call."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen = False


@dataclass(slots=True, eq=False)
class ModelCall:
    """What a replica runs in one model call: requests of one
    :class:`~carpool.core.request.Batch` that collate together (a signature group of it,
    or a bisection half of one), the collator that joins their payloads, and the batch's
    :class:`Cancels`. ``deadline_s`` is the earliest deadline of its requests.

    The collated input is not kept here but made as the call starts and held only while
    it runs: a call that ran out of memory must free it before its halves run."""

    requests: list[Request]
    collator: Collator
    cancels: Cancels
    payloads: list[Any] = field(init=False)
    is_many: list[bool] = field(init=False)
    counts: list[int] = field(init=False)
    deadline_s: float | None = field(init=False)
    rank: int = field(init=False)  # its most urgent class's (0: the highest)
    lease: list[Any] = field(init=False, default_factory=list)  # pooled buffers held

    def __post_init__(self) -> None:
        requests = self.requests
        self.payloads = [r.payload for r in requests]
        self.is_many = [r.is_many for r in requests]
        self.counts = [r.num_items for r in requests]
        deadlines = [r.deadline_s for r in requests if r.deadline_s is not None]
        self.deadline_s = min(deadlines) if deadlines else None
        self.rank = min((r.rank for r in requests), default=0)

    def part(self, requests: list[Request]) -> ModelCall:
        """The same call for some of its requests (a half, or those left to run)."""
        return ModelCall(requests, self.collator, self.cancels)

    def collate(self) -> Any:
        collator = self.collator
        if type(collator) is PooledCollator:
            batch, self.lease = collator.collate_leased(self.payloads, self.is_many)
            return batch
        return collator.collate(self.payloads, self.is_many)

    def release(self) -> None:
        """Give pooled buffers back when the model did not run on them (late, withdrawn)."""
        lease, self.lease = self.lease, []
        collator = self.collator
        if lease and type(collator) is PooledCollator:
            for buffer in lease:
                collator.pool.release(buffer)

    def is_withdrawn(self) -> bool:
        """Whether a caller cancelled one of this call's requests."""
        return self.cancels.seen and any(r.future.cancelled() for r in self.requests)

    def check_turn(self, started_s: float) -> None:
        """Raise StartedLate or Withdrawn when the call must not run now."""
        if self.deadline_s is not None and started_s >= self.deadline_s:
            raise StartedLate(started_s)
        if self.is_withdrawn():
            raise Withdrawn(started_s)

    def output(
        self, outputs: Any, started_s: float, ended_s: float, model_s: float | None = None
    ) -> RunOutput:
        lease = self.lease
        if lease:  # outputs aliasing the pooled input are copied before it goes back
            self.lease = []
            collator = self.collator
            assert type(collator) is PooledCollator
            results = collator.split_leased(outputs, self.counts, self.is_many, lease)
            return RunOutput(results, started_s, ended_s, model_s)
        return RunOutput(
            self.collator.split(outputs, self.counts, self.is_many), started_s, ended_s, model_s
        )
