"""The output processor: the one place that turns a request's tokens into text and
decides when its tokens or its text stop it.

::

    Scheduler.update_from_output() ──RequestEvent──▶ OutputState.process() ──▶ TextDelta
      appends each sampled token;                     EOS ids and stop_token_ids (the
      finishes at max_tokens (length)                 token counts, its text is hidden),
                                                      stop strings (the text ends before
                                                      them), detokenizing

The scheduler owns ``max_tokens`` because it reserved KV room for exactly that many;
everything the tokens *say* is decided here, with every EOS id of the tokenizer. A
request that stops here is finished in the scheduler by the engine before its next step.

Text is streamed as it is made, never half a character (the incremental detokenizer
holds a broken UTF-8 tail) and never a piece of a stop string: text that could be the
start of one is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from carpool.generation.request import FinishReason
from carpool.generation.tokenizer import IncrementalDetokenizer, Tokenizer
from carpool.generation.types import SamplingParams


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one step added to a request's answer: ``text`` to send (empty while a
    character or a possible stop string is held), the token ids it counts (a stop token
    included, anything after it not), and ``finish_reason`` when the request ended."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None


class OutputProcessor:
    """Starts each request's :class:`OutputState` with the tokenizer's EOS ids.

    Args:
        tokenizer: decodes the text; its ``eos_token_ids`` stop every request that does
            not ``ignore_eos``.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._eos_ids = frozenset(tokenizer.eos_token_ids)

    def start(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> OutputState:
        """The state of a request about to generate after ``prompt_ids``."""
        stop_ids = frozenset(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= self._eos_ids
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, prompt_ids, skip_special_tokens=sampling.skip_special_tokens
        )
        return OutputState(
            detokenizer,
            stop_ids,
            sampling.stop,
            min_tokens=sampling.min_tokens,
            include_stop=sampling.include_stop_str_in_output,
        )


class OutputState:
    """One request's text so far: what was decoded and not yet sent, and its stops.

    Stop strings count only once ``min_tokens`` tokens are out (as in vLLM; the sampler
    holds back stop tokens until then). With ``include_stop`` the stop string, or the
    stop token's text, ends the text instead of being cut off."""

    __slots__ = (
        "_detokenizer",
        "_include_stop",
        "_min_tokens",
        "_num_tokens",
        "_stop_ids",
        "_stops",
        "pending_text",
    )

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        stop_ids: frozenset[int],
        stops: tuple[str, ...],
        *,
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        self._detokenizer = detokenizer
        self._stop_ids = stop_ids
        self._stops = stops
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self._num_tokens = 0
        self.pending_text = ""  # decoded, not yet sent: may begin a stop string

    def process(
        self, new_token_ids: Sequence[int], finish_reason: FinishReason | None = None
    ) -> TextDelta:
        """The text ``new_token_ids`` complete, and whether they end the request.

        ``finish_reason`` is the scheduler's (``length``); a stop token or stop string in
        this step wins over it. On the last delta ``text`` is all that is left to send
        (the detokenizer's held tail too, unless a stop string cut the text).
        """
        token_ids = tuple(new_token_ids)
        text_ids = token_ids
        reason = finish_reason
        for i, token in enumerate(token_ids):
            if token in self._stop_ids:  # the stop token counts, its text is not shown
                shown = i + 1 if self._include_stop else i
                token_ids, text_ids, reason = (
                    token_ids[: i + 1],
                    token_ids[:shown],
                    FinishReason.STOP,
                )
                break
        self._num_tokens += len(token_ids)
        text = self.pending_text + self._detokenizer.push(text_ids)
        stops = self._stops if self._num_tokens >= self._min_tokens else ()
        found = _find_stop(text, stops)
        stop_at = None
        if found is not None:
            stop_at = found[0] + (len(found[1]) if self._include_stop else 0)
            text, reason = text[:stop_at], FinishReason.STOP
        if reason is None:
            held = _held_back(text, stops)
            sent, self.pending_text = text[: len(text) - held], text[len(text) - held :]
            return TextDelta(sent, token_ids)
        if stop_at is None:
            text += self._detokenizer.flush()
        self.pending_text = text
        return TextDelta(text, token_ids, reason)


def _find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Where the earliest stop string in ``text`` starts, and which it is (the text held
    back before this step could begin one, so it is searched again with the new text)."""
    found = [(i, s) for i, s in ((text.find(s), s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin a stop string."""
    longest = max((len(s) for s in stops), default=0)
    for size in range(min(len(text), longest - 1), 0, -1):
        tail = text[-size:]
        if any(s.startswith(tail) for s in stops):
            return size
    return 0
