"""A generation request: its ordered status and when it stops."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from carpool.generation.request import FinishReason, GenRequest, RequestStatus, check_stop
from carpool.generation.types import SamplingParams

TEXT = {1: "he", 2: "llo", 3: " wor", 4: "ld", 5: "!", 6: "?"}


def detokenize(token_ids: Sequence[int]) -> str:
    return "".join(TEXT[t] for t in token_ids)


def make_request(**sampling: object) -> GenRequest:
    return GenRequest(
        request_id=1,
        prompt_token_ids=(7, 8),
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
        class_name="normal",
        rank=1,
        arrival_s=0.0,
    )


def feed(
    request: GenRequest,
    token_ids: Sequence[int],
    *,
    eos_token_id: int | None = None,
    with_detokenize: bool = True,
) -> int:
    """Append tokens until one stops the request; how many were appended."""
    for n, token_id in enumerate(token_ids, start=1):
        request.append_output_token(token_id)
        if check_stop(
            request,
            eos_token_id=eos_token_id,
            detokenize=detokenize if with_detokenize else None,
        ):
            return n
    return len(token_ids)


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


def test_stops_at_max_tokens_with_length() -> None:
    request = make_request(max_tokens=3)
    assert feed(request, [1, 1, 1, 1]) == 3
    assert request.finish_reason is FinishReason.LENGTH


def test_stops_at_eos_unless_ignored() -> None:
    request = make_request(max_tokens=10)
    assert feed(request, [1, 9, 1], eos_token_id=9) == 2
    assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, 9)
    ignoring = make_request(max_tokens=10, ignore_eos=True)
    assert feed(ignoring, [1, 9, 1], eos_token_id=9) == 3
    assert not ignoring.is_finished


def test_stops_at_a_stop_token_id_and_keeps_it() -> None:
    request = make_request(max_tokens=10, stop_token_ids=(5, 6))
    assert feed(request, [1, 2, 6, 1]) == 3
    assert request.stop_reason == 6
    assert request.output_token_ids == [1, 2, 6]


def test_stop_string_across_tokens_is_trimmed_from_the_text() -> None:
    request = make_request(max_tokens=10, stop=("lo w",))
    assert feed(request, [1, 2, 3, 4]) == 3  # "he" "llo" " wor": "lo w" spans two tokens
    assert request.finish_reason is FinishReason.STOP
    assert request.stop_reason == "lo w"
    assert request.text_end == 3
    assert detokenize(request.output_token_ids)[: request.text_end] == "hel"


def test_earliest_stop_string_wins() -> None:
    request = make_request(max_tokens=10, stop=("ld", "wor"))
    assert feed(request, [1, 2, 3, 4]) == 3
    assert (request.stop_reason, request.text_end) == ("wor", 6)


def test_stop_string_on_the_last_allowed_token_is_a_stop() -> None:
    request = make_request(max_tokens=2, stop=("ll",))
    assert feed(request, [1, 2]) == 2
    assert request.finish_reason is FinishReason.STOP


def test_stop_strings_need_a_detokenizer() -> None:
    request = make_request(max_tokens=3, stop=("he",))
    assert feed(request, [1, 1, 1], with_detokenize=False) == 3
    assert request.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_stop_string_found_on_first_token(max_tokens: int) -> None:
    request = make_request(max_tokens=max_tokens, stop=("!",))
    assert feed(request, [5]) == 1
    assert (request.stop_reason, request.text_end) == ("!", 0)
