"""The output processor: text deltas, and the stops a request's tokens and text make."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from carpool.generation.output import OutputProcessor, OutputState, TextDelta
from carpool.generation.request import FinishReason
from carpool.generation.tokenizer import ByteTokenizer
from carpool.generation.types import SamplingParams

EOS, OTHER_EOS = 9, 10
WORDS = {1: "he", 2: "llo", 3: " wor", 4: "ld", 5: "!", 6: "?", 7: "Hello", 8: ","}


class WordTokenizer(ByteTokenizer):
    """Ids 1-8 are words; 9 and 10 both end a sequence (as a folder with two EOS ids)."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (EOS, OTHER_EOS)

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(WORDS[t] for t in token_ids if t not in (EOS, OTHER_EOS))


def start(**sampling: object) -> OutputState:
    params = SamplingParams(**sampling)  # type: ignore[arg-type]
    return OutputProcessor(WordTokenizer()).start((7, 8), params)  # "Hello,"


def start_bytes(**sampling: object) -> OutputState:
    params = SamplingParams(**sampling)  # type: ignore[arg-type]
    return OutputProcessor(ByteTokenizer()).start(list(b"q"), params)


def feed(
    state: OutputState, token_ids: Sequence[int], *, max_tokens: int | None = None
) -> list[TextDelta]:
    """One token a step, as the scheduler appends them, until one ends the request;
    the scheduler's ``length`` comes with token number ``max_tokens``."""
    deltas = []
    for n, token in enumerate(token_ids, start=1):
        length = FinishReason.LENGTH if n == max_tokens else None
        deltas.append(state.process([token], length))
        if deltas[-1].finish_reason is not None:
            break
    return deltas


def text(deltas: list[TextDelta]) -> str:
    return "".join(d.text for d in deltas)


def test_streams_each_token_s_text_and_passes_the_scheduler_s_length_on() -> None:
    deltas = feed(start(), [1, 2, 3], max_tokens=3)
    assert [d.text for d in deltas] == ["he", "llo", " wor"]
    assert [d.finish_reason for d in deltas] == [None, None, FinishReason.LENGTH]


@pytest.mark.parametrize("eos", [EOS, OTHER_EOS])
def test_every_eos_id_stops_unless_ignored_and_counts_without_text(eos: int) -> None:
    deltas = feed(start(), [1, eos, 2])
    assert len(deltas) == 2 and deltas[-1].token_ids == (eos,)
    assert (text(deltas), deltas[-1].finish_reason) == ("he", FinishReason.STOP)
    ignoring = feed(start(ignore_eos=True), [1, eos, 2], max_tokens=3)
    assert (text(ignoring), ignoring[-1].finish_reason) == ("hello", FinishReason.LENGTH)


def test_a_stop_token_id_stops_even_with_ignore_eos_and_its_text_is_not_shown() -> None:
    deltas = feed(start(stop_token_ids=(5, 6), ignore_eos=True), [1, 2, 6, 1])
    assert [d.token_ids for d in deltas] == [(1,), (2,), (6,)]
    assert (text(deltas), deltas[-1].finish_reason) == ("hello", FinishReason.STOP)


def test_a_stop_token_on_the_last_allowed_token_is_a_stop() -> None:
    deltas = feed(start(), [1, EOS], max_tokens=2)
    assert deltas[-1].finish_reason is FinishReason.STOP


def test_stop_string_across_tokens_is_trimmed_and_never_streamed() -> None:
    deltas = feed(start(stop=("lo w",)), [1, 2, 3, 4])
    assert len(deltas) == 3  # "he" "llo" " wor": "lo w" spans two tokens
    assert [d.text for d in deltas] == ["he", "l", ""]  # "lo" was held: it begins "lo w"
    assert (text(deltas), deltas[-1].finish_reason) == ("hel", FinishReason.STOP)


def test_stop_string_found_through_the_detokenizer() -> None:
    deltas = feed(start(stop=("world",)), [7, 8, 3, 4, 5])
    assert len(deltas) == 4
    assert (text(deltas), deltas[-1].finish_reason) == ("Hello, ", FinishReason.STOP)


def test_earliest_stop_string_wins() -> None:
    deltas = feed(start(stop=("ld", "wor")), [1, 2, 3, 4])
    assert len(deltas) == 3
    assert text(deltas) == "hello "


def test_stop_string_on_the_last_allowed_token_is_a_stop() -> None:
    deltas = feed(start(stop=("ll",)), [1, 2], max_tokens=2)
    assert (text(deltas), deltas[-1].finish_reason) == ("he", FinishReason.STOP)


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_stop_string_found_on_the_first_token(max_tokens: int) -> None:
    deltas = feed(start(stop=("!",)), [5], max_tokens=max_tokens)
    assert (deltas[-1].text, deltas[-1].finish_reason) == ("", FinishReason.STOP)


@pytest.mark.parametrize("stop", ["é", "xé"])
def test_a_stop_string_completed_by_a_character_s_last_byte_is_found(stop: str) -> None:
    # "é" is the bytes C3 A9: after C3 the text would end in U+FFFD, which A9 turns
    # into "é"; the half character is held, so the stop string is found whole.
    deltas = feed(start_bytes(stop=(stop,)), [*b"x", 0xC3, 0xA9, *b"yz"])
    assert len(deltas) == 3
    assert (text(deltas), deltas[-1].finish_reason) == ("xé"[: "xé".index(stop)], FinishReason.STOP)


def test_text_held_for_a_possible_stop_string_is_released_when_it_is_not_one() -> None:
    deltas = feed(start(stop=("llo!",)), [1, 2, 6], max_tokens=3)
    assert [d.text for d in deltas] == ["he", "", "llo?"]


def test_the_last_delta_flushes_a_broken_character_and_keeps_the_held_text() -> None:
    state = start_bytes(stop=("x!",))
    assert state.process([*b"a"]).text == "a"
    assert state.process([*b"x"]).text == ""  # may begin "x!"
    assert state.pending_text == "x"
    last = state.process([0xC3], FinishReason.LENGTH)  # half a character, then the end
    assert (last.text, last.finish_reason) == ("x\ufffd", FinishReason.LENGTH)


@pytest.mark.parametrize(("include", "expected"), [(True, "hello w"), (False, "he")])
def test_include_stop_str_in_output_keeps_the_stop_string(include: bool, expected: str) -> None:
    deltas = feed(start(stop=("llo w",), include_stop_str_in_output=include), [1, 2, 3, 4])
    assert text(deltas) == expected and deltas[-1].finish_reason is FinishReason.STOP


@pytest.mark.parametrize(("include", "expected"), [(True, "he?"), (False, "he")])
def test_include_stop_str_in_output_shows_the_stop_token_s_text(
    include: bool, expected: str
) -> None:
    deltas = feed(start(stop_token_ids=(6,), include_stop_str_in_output=include), [1, 6, 2])
    assert text(deltas) == expected and deltas[-1].token_ids == (6,)


def test_stop_strings_wait_for_min_tokens() -> None:
    deltas = feed(start(stop=("llo",), min_tokens=3), [1, 2, 3, 2, 4])
    assert text(deltas) == "hello wor"  # the first "llo" came with token 2 of 3
    assert len(deltas) == 4 and deltas[-1].finish_reason is FinishReason.STOP


class SpecialWordTokenizer(WordTokenizer):
    """Shows EOS as ``<eos>`` when asked not to skip special tokens."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return super().decode(token_ids)
        return "".join("<eos>" if t == EOS else WORDS.get(t, "") for t in token_ids)


@pytest.mark.parametrize(("skip", "expected"), [(True, "hello"), (False, "he<eos>llo")])
def test_skip_special_tokens_false_shows_them(skip: bool, expected: str) -> None:
    params = SamplingParams(ignore_eos=True, skip_special_tokens=skip)
    state = OutputProcessor(SpecialWordTokenizer()).start((7,), params)
    assert text(feed(state, [1, EOS, 2])) == expected
