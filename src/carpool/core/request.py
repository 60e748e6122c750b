"""One request, one batch, and the trace of a request's life.

A request moves through its states in one direction::

    QUEUED ──▶ RUNNING ──▶ DONE
       │          └──▶ EXPIRED  (deadline passed before its model call's turn came)
       ├──▶ EXPIRED     (deadline passed while queued; it never runs)
       └──▶ CANCELLED   (the caller gave up while it was queued)

Queues delete lazily: an EXPIRED or CANCELLED request stays in its deque until a
scan meets it, so dropping one is O(1) on the hot path.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from carpool.core.clock import TimerHandle


class RequestState(enum.IntEnum):
    QUEUED = 0
    RUNNING = 1
    DONE = 2
    EXPIRED = 3
    CANCELLED = 4


@dataclass(slots=True, eq=False)
class Request:
    """A caller's payload waiting for, or riding in, a batch."""

    request_id: int
    payload: Any
    num_items: int
    is_many: bool
    cost: float
    class_name: str
    rank: int
    arrival_s: float
    deadline_s: float | None
    future: asyncio.Future[Any]
    signature: Hashable = None
    num_tokens: int = 0  # variable-length items: the sum of their lengths
    length: int = 0  # variable-length items: the longest
    bucket: int = 0  # the length bucket (policy.length_buckets)
    state: RequestState = RequestState.QUEUED
    timer: TimerHandle | None = None
    batch_closed_s: float = math.nan
    fill_wait_s: float = 0.0
    compute_start_s: float = math.nan
    compute_end_s: float = math.nan
    batch_size: int = 0
    replica_id: int = -1
    batch_id: int = -1


@dataclass(slots=True, eq=False)
class Batch:
    """Requests closed together for one replica; ``num_items`` counts along axis 0."""

    batch_id: int
    requests: list[Request]
    num_items: int
    cost: float
    lead_class: str
    max_batch_size: int
    closed_s: float
    replica_id: int = -1
    # Its size in the policy's budget unit (items, tokens or cost): what its compute time
    # is learned against (carpool.core.batch_times); the scheduler sets both.
    units: float = 0.0
    unit: str = "items"

    def start(self, replica_id: int, now: float, idle_since_s: float | None) -> None:
        """Mark every request running on ``replica_id`` from ``now`` (deadline timers off).
        ``idle_since_s``: when the replica went idle, to tell each request's fill wait."""
        self.replica_id = replica_id
        for request in self.requests:
            request.state = RequestState.RUNNING
            request.batch_id = self.batch_id
            if request.timer is not None:
                request.timer.cancel()
                request.timer = None
            request.batch_closed_s = now
            request.compute_start_s = now
            request.batch_size = self.num_items
            request.replica_id = replica_id
            if idle_since_s is not None:
                request.fill_wait_s = max(0.0, now - max(idle_since_s, request.arrival_s))


class Outcome(enum.Enum):
    OK = "ok"
    MODEL_ERROR = "model_error"
    INVALID = "invalid"
    OUT_OF_MEMORY = "out_of_memory"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """Where one request's time went; monotonic seconds, NaN for stages it never reached.

    ``fill_wait_s`` is the part of its wait during which a replica sat idle holding the
    batch open for more requests; the rest of the wait (``queue_s``) was spent behind
    busy replicas.
    """

    request_id: int
    class_name: str
    num_items: int
    outcome: Outcome
    arrived_s: float
    batch_closed_s: float
    compute_started_s: float
    compute_ended_s: float
    answered_s: float
    fill_wait_s: float
    batch_size: int
    replica_id: int

    @property
    def total_s(self) -> float:
        return self.answered_s - self.arrived_s

    @property
    def wait_s(self) -> float:
        return self.batch_closed_s - self.arrived_s

    @property
    def queue_s(self) -> float:
        return max(0.0, self.wait_s - self.fill_wait_s)

    @property
    def replica_wait_s(self) -> float:
        """Closed but not yet computing: queued on its replica behind the batch before."""
        return max(0.0, self.compute_started_s - self.batch_closed_s)

    @property
    def compute_s(self) -> float:
        return self.compute_ended_s - self.compute_started_s

    @property
    def answer_s(self) -> float:
        """From the end of its batch's compute to its answer: its outputs split off and
        its future settled (longer when the loop that settles it is busy)."""
        return max(0.0, self.answered_s - self.compute_ended_s)

    def describe(self) -> str:
        """One line for a person: where the time went."""
        if math.isnan(self.batch_closed_s):
            return (
                f"request {self.request_id} [{self.class_name}] {self.outcome.value} after "
                f"{self.total_s * 1e3:.2f} ms without running"
            )
        return (
            f"request {self.request_id} [{self.class_name}] {self.outcome.value} in "
            f"{self.total_s * 1e3:.2f} ms: queue {self.queue_s * 1e3:.2f} ms, "
            f"waiting for the batch to fill {self.fill_wait_s * 1e3:.2f} ms, "
            f"behind the replica's previous batch {self.replica_wait_s * 1e3:.2f} ms, "
            f"compute {self.compute_s * 1e3:.2f} ms (batch of {self.batch_size} on "
            f"replica {self.replica_id})"
        )


def trace_of(request: Request, outcome: Outcome, answered_s: float) -> RequestTrace:
    return RequestTrace(
        request_id=request.request_id,
        class_name=request.class_name,
        num_items=request.num_items,
        outcome=outcome,
        arrived_s=request.arrival_s,
        batch_closed_s=request.batch_closed_s,
        compute_started_s=request.compute_start_s,
        compute_ended_s=request.compute_end_s,
        answered_s=answered_s,
        fill_wait_s=request.fill_wait_s,
        batch_size=request.batch_size,
        replica_id=request.replica_id,
    )
