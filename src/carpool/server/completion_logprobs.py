"""Log-probabilities in OpenAI's two shapes: the legacy one of ``/v1/completions`` and the
one of ``/v1/chat/completions``. A streamed chunk carries its own tokens' part::

    completions  {"tokens": ["He"], "token_logprobs": [-0.3], "text_offset": [0],
                  "top_logprobs": [{"He": -0.3, "Hi": -1.9}]}     (sampled token included)
    chat         {"content": [{"token": "He", "logprob": -0.3, "bytes": [72, 101],
                  "top_logprobs": [{"token": "Hi", "logprob": -1.9, "bytes": [...]}]}]}

A token's string is its own decoded text (a byte-level piece of a character decodes to
U+FFFD; its ``bytes`` are then those of that text, as the tokenizer gives no more), or,
with vLLM's ``return_tokens_as_token_ids``, ``"token_id:<id>"``, which tells such pieces
apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from carpool.generation.tokenizer import Tokenizer
from carpool.generation.types import TokenLogprobs


class LogprobsWriter:
    """One choice's log-probabilities; ``text_offset`` counts on from ``start_offset``
    (the echoed prompt's length)."""

    __slots__ = ("_as_ids", "_is_chat", "_offset", "_tokenizer")

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        is_chat: bool,
        start_offset: int = 0,
        tokens_as_ids: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._is_chat = is_chat
        self._offset = start_offset
        self._as_ids = tokens_as_ids

    def document(self, logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The ``logprobs`` object of a choice (or chunk) holding these tokens."""
        if self._is_chat:
            return {"content": [self._chat_entry(found) for found in logprobs]}
        tokens: list[str] = []
        offsets: list[int] = []
        tops: list[dict[str, float]] = []
        for found in logprobs:
            text = self._text(found.token_id)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            top: dict[str, float] = {}
            for token, value in found.top:  # most likely first: it keeps a shared string
                top.setdefault(self._text(token), value)
            top.setdefault(text, found.logprob)
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [found.logprob for found in logprobs],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def prompt_document(
        self, first_token_id: int, logprobs: Sequence[TokenLogprobs]
    ) -> dict[str, Any]:
        """The echoed prompt's part (completions, ``echo`` with ``logprobs``), offsets from
        0: its first token has no log-probability (null, as OpenAI and vLLM give it), the
        others theirs (``logprobs``)."""
        writer = LogprobsWriter(self._tokenizer, is_chat=False, tokens_as_ids=self._as_ids)
        first = writer._text(first_token_id)
        writer._offset = len(first)
        rest = writer.document(logprobs)
        return {
            "tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]],
        }

    def _chat_entry(self, found: TokenLogprobs) -> dict[str, Any]:
        entry = self._chat_token(found.token_id, found.logprob)
        entry["top_logprobs"] = [self._chat_token(token, value) for token, value in found.top]
        return entry

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _text(self, token_id: int) -> str:
        """The token's own text, special tokens included (``"</s>"``, as vLLM names them:
        left out, every special token was ``""``, two of them one key of ``top_logprobs``,
        and an echoed prompt's offsets went short of its text)."""
        if self._as_ids:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)
