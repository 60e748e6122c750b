"""One generation request and its status.

Status only moves forward, except a preempted request that is admitted again::

    WAITING ──▶ RUNNING ──▶ FINISHED_STOPPED | FINISHED_LENGTH
       ▲           │
       │           ▼
       └──── PREEMPTED        (any unfinished status ──▶ FINISHED_ABORTED)

The statuses are an ordered ``IntEnum``: ``status > PREEMPTED`` means finished. The
scheduler finishes a request at ``max_tokens`` (length); a stop token or stop string,
which the output processor finds (``output.py``), and a client that left finish it
through ``Scheduler.finish_request``.

A request's sequence is ``prompt_token_ids + output_token_ids`` (``all_token_ids``);
``num_computed_tokens`` of them have K/V in the cache. After preemption by recompute it
drops to zero and both prompt and generated tokens are computed again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from carpool.generation.types import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)

    @staticmethod
    def finished_by(reason: FinishReason) -> RequestStatus:
        """The finished status of a request that ended for ``reason``."""
        return _FINISHED_BY[reason]


class FinishReason(enum.StrEnum):
    """OpenAI's ``finish_reason`` values (``abort`` is ours: the client went away)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}
_FINISHED_BY = {reason: status for status, reason in _FINISH_REASONS.items()}


@dataclass(slots=True, eq=False)
class GenRequest:
    """A prompt being generated from; built by ``Scheduler.add_request``."""

    request_id: int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    class_name: str
    rank: int  # of the priority class: 0 is the highest
    arrival_s: float
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt, then outputs
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 before it
    num_preemptions: int = 0
    admit_seq: int = -1  # order of the latest admission: higher is more recent
    is_held: bool = False  # out of the steps while its reader is behind (Scheduler.hold)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """What the scheduler did with one request this step: the token it appended, and how
    the request finished if it did (``length`` at ``max_tokens``, ``abort``; the output
    processor, ``output.py``, finds the stops its tokens and text make)."""

    request_id: int
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
