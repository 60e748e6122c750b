"""One generation request, its status, and when it stops.

Status only moves forward, except a preempted request that is admitted again::

    WAITING ──▶ RUNNING ──▶ FINISHED_STOPPED | FINISHED_LENGTH
       ▲           │
       │           ▼
       └──── PREEMPTED        (any unfinished status ──▶ FINISHED_ABORTED)

The statuses are an ordered ``IntEnum``: ``status > PREEMPTED`` means finished.

A request's sequence is ``prompt_token_ids + output_token_ids`` (``all_token_ids``);
``num_computed_tokens`` of them have K/V in the cache. After preemption by recompute it
drops to zero and both prompt and generated tokens are computed again.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from carpool.generation.tokenizer import REPLACEMENT_CHAR
from carpool.generation.types import SamplingParams

Detokenize = Callable[[Sequence[int]], str]


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
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    text_end: int | None = None  # stop strings: visible text = decoded output[:text_end]
    num_checked_chars: int = 0  # stop strings: output text already searched

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
    """What one request did this step, for streaming: new tokens, and how it finished."""

    request_id: int
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    text_end: int | None = None  # stop string: visible text = decoded output[:text_end]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


def check_stop(
    request: GenRequest, *, eos_token_id: int | None, detokenize: Detokenize | None
) -> bool:
    """After a token was appended: finish ``request`` if it should stop; True when it did.

    In order: EOS (unless ``ignore_eos``), a stop token id, a stop string (needs
    ``detokenize``; sets ``text_end`` so the stop string is trimmed), ``max_tokens``.
    Token ids that stop a request stay in ``output_token_ids``; the engine hides EOS text.
    """
    sampling = request.sampling
    last = request.output_token_ids[-1]
    if (eos_token_id is not None and last == eos_token_id and not sampling.ignore_eos) or (
        last in sampling.stop_token_ids
    ):
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if sampling.stop and detokenize is not None:
        match = _find_stop_string(request, detokenize)
        if match is not None:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason, request.text_end = match
            return True
    if request.num_output_tokens >= sampling.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def _find_stop_string(request: GenRequest, detokenize: Detokenize) -> tuple[str, int] | None:
    """The earliest stop string in the new tail of the output text, and where it starts.

    Only the tail is searched: from ``len(stop) - 1`` characters before the text already
    checked, so a stop string spanning two tokens is still found. A trailing U+FFFD is not
    checked yet: it may be a character still incomplete that the next token completes.
    """
    text = detokenize(request.output_token_ids)
    stops = request.sampling.stop
    start = max(0, request.num_checked_chars - max(len(s) for s in stops) + 1)
    request.num_checked_chars = len(text.rstrip(REPLACEMENT_CHAR))
    best: tuple[str, int] | None = None
    for stop in stops:
        if not stop:
            continue
        at = text.find(stop, start)
        if at != -1 and (best is None or at < best[1]):
            best = (stop, at)
    return best
