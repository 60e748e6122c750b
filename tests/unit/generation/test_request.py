"""A generation request and its ordered status (when it stops: test_scheduler.py for
``max_tokens``, test_output.py for stop tokens and strings)."""

from __future__ import annotations

import pytest

from carpool.generation.request import FinishReason, GenRequest, RequestStatus
from carpool.generation.types import SamplingParams


def make_request(**sampling: object) -> GenRequest:
    return GenRequest(
        request_id=1,
        prompt_token_ids=(7, 8),
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
        class_name="normal",
        rank=1,
        arrival_s=0.0,
    )


def test_status_is_ordered_and_finished_after_preempted() -> None:
    assert RequestStatus.WAITING < RequestStatus.RUNNING < RequestStatus.PREEMPTED
    finished = [s for s in RequestStatus if s.is_finished]
    assert finished == [
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
    ]
    assert [s.finish_reason for s in finished] == ["stop", "length", "abort"]
    assert RequestStatus.RUNNING.finish_reason is None


def test_new_request_holds_its_prompt_as_its_sequence() -> None:
    request = make_request()
    assert request.all_token_ids == [7, 8]
    assert (request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (2, 2, 0)
    request.append_output_token(3)
    assert request.all_token_ids == [7, 8, 3]
    assert request.output_token_ids == [3]


@pytest.mark.parametrize("reason", list(FinishReason))
def test_each_finish_reason_has_its_finished_status(reason: FinishReason) -> None:
    status = RequestStatus.finished_by(reason)
    assert status.is_finished and status.finish_reason is reason
