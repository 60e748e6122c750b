"""The sampling fields of a completion request, checked and turned into ``SamplingParams``.

Ranges are OpenAI's where it has the field (``temperature`` [0, 2], penalties [-2, 2],
``logit_bias`` values [-100, 100], ``logprobs`` at most 20) and vLLM's for its extensions
(``repetition_penalty`` > 0, ``min_p`` [0, 1], ``min_tokens`` at most ``max_tokens``).
Completions take ``logprobs`` as a count (0: only the sampled token's); chat takes
``logprobs: true`` and ``top_logprobs`` as that count.
"""

from __future__ import annotations

import math
from typing import Any

from carpool.errors import InvalidInput
from carpool.generation.tokenizer import check_token_ids
from carpool.generation.types import SamplingParams
from carpool.server.generation import GenerationService
from carpool.server.openai import BadParam

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code
MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs (vLLM's default max_logprobs too)
MAX_LOGIT_BIAS = 100.0
MAX_TOKEN_ID_DIGITS = (
    18  # a logit_bias key longer than this is no token id (and int() may refuse it)
)


def sampling_params(
    doc: dict[str, Any],
    service: GenerationService,
    num_prompt: int,
    is_chat: bool,
    fit_max_tokens: bool = True,
) -> SamplingParams:
    """The sampling fields of ``doc``, for a prompt of ``num_prompt`` tokens.
    ``fit_max_tokens``: a ``max_tokens`` that runs past the context with this prompt is
    lowered to what fits, as vLLM does (else refused, as OpenAI does).

    Raises:
        BadParam: naming the field out of range or past the context.
    """
    max_tokens = _max_tokens(doc, service, num_prompt, is_chat, fit_max_tokens)
    vocab_size = service.engine.vocab_size  # the tokenizer's, or the model's if smaller
    # -1 or 0: off (vLLM writes -1); more than the vocabulary is all of it.
    top_k = min(max(integer(doc, "top_k", 0, -1), 0), vocab_size)
    try:
        stop_token_ids = tuple(
            check_token_ids(list_of(doc, "stop_token_ids"), vocab_size, "stop_token_ids")
        )
    except InvalidInput as error:  # check_token_ids knows no OpenAI params: name it
        raise BadParam("stop_token_ids", str(error)) from None
    min_tokens = integer(doc, "min_tokens", 0, 0, max_tokens)
    return SamplingParams(
        temperature=number(doc, "temperature", 1.0, 0.0, 2.0),
        top_p=number(doc, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=top_k,
        min_p=number(doc, "min_p", 0.0, 0.0, 1.0),
        seed=integer(doc, "seed", None, -(2**63), 2**63 - 1),  # int64, as vLLM bounds it
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=_stop(doc.get("stop")),
        stop_token_ids=stop_token_ids,
        ignore_eos=flag(doc, "ignore_eos"),
        repetition_penalty=number(doc, "repetition_penalty", 1.0, 0.0, math.inf, low_open=True),
        presence_penalty=number(doc, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number(doc, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(doc.get("logit_bias"), vocab_size),
        logprobs=_logprobs(doc, is_chat),
        include_stop_str_in_output=flag(doc, "include_stop_str_in_output"),
        skip_special_tokens=flag(doc, "skip_special_tokens", default=True),
    )


def _max_tokens(
    doc: dict[str, Any], service: GenerationService, num_prompt: int, is_chat: bool, fit: bool
) -> int:
    room = service.max_model_len - num_prompt
    # Context errors open as OpenAI's and vLLM's do ("This model's maximum context length
    # is N tokens"; clients such as LiteLLM match it) and carry OpenAI's code.
    what = "messages" if is_chat else "prompt"
    context = f"This model's maximum context length is {service.max_model_len} tokens"
    if room < 1:
        raise BadParam(
            what,
            f"{context}. However, your {what} resulted in {num_prompt} tokens, leaving no "
            f"room for output (at most {service.max_model_len} tokens per sequence, "
            f"{what} and output together); shorten the {what}",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    # The newer name first, unless it is absent or null (the client's None), as vLLM reads it.
    is_new = is_chat and doc.get("max_completion_tokens") is not None
    key = "max_completion_tokens" if is_new else "max_tokens"
    max_tokens = doc.get(key)
    if max_tokens is None:
        max_tokens = room if is_chat else min(DEFAULT_MAX_TOKENS, room)
    elif isinstance(max_tokens, int) and max_tokens > room:
        if fit and max_tokens <= service.max_model_len:
            # vLLM's answer: the output stops where the context ends (finish_reason
            # "length"); a max_tokens past the whole context is refused, as vLLM does.
            return room
        raise BadParam(  # refused before a stream starts
            key,
            f"{context}. However, you requested {num_prompt + max_tokens} tokens "
            f"({num_prompt} in the {what}, {max_tokens} in the completion); lower {key} "
            f"to {room} or less",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    return integer({key: max_tokens}, key, None, 1)  # type: ignore[no-any-return]


def _logprobs(doc: dict[str, Any], is_chat: bool) -> int | None:
    if not is_chat:
        return integer(doc, "logprobs", None, 0, MAX_LOGPROBS)  # type: ignore[no-any-return]
    top: int | None = integer(doc, "top_logprobs", None, 0, MAX_LOGPROBS)
    if not flag(doc, "logprobs"):
        if top:
            raise BadParam("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    return top or 0


def _token_id(key: Any) -> int:
    """A logit_bias key as a token id; -1 for what is not a plain decimal integer (a
    digit int() refuses, such as "²", or one longer than Python converts)."""
    if not isinstance(key, str):
        return -1
    text = key.strip()
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()) or len(digits) > MAX_TOKEN_ID_DIGITS:
        return -1
    return int(text)


def _logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise BadParam("logit_bias", f"logit_bias={value!r}: expected an object of token id: bias")
    bias: list[tuple[int, float]] = []
    for key, amount in value.items():
        token = _token_id(key)
        if not 0 <= token < vocab_size:
            raise BadParam(
                "logit_bias", f"logit_bias key {key!r}: expected a token id in [0, {vocab_size})"
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise BadParam("logit_bias", f"logit_bias[{key!r}]={amount!r}: expected a number")
        # OpenAI: "values between -100 and 100"; vLLM clamps to that range.
        bias.append((token, max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(amount)))))
    return tuple(bias)


def number(
    doc: dict[str, Any],
    name: str,
    default: float,
    low: float,
    high: float,
    *,
    low_open: bool = False,
) -> float:
    """``doc[name]``, a number in its range (null or absent: ``default``)."""
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadParam(name, f"{name}={value!r}: expected a number")
    if not (low < value if low_open else low <= value) or value > high:
        bracket = "(" if low_open else "["
        raise BadParam(name, f"{name}={value!r}: expected a number in {bracket}{low}, {high}]")
    return float(value)


def integer(doc: dict[str, Any], name: str, default: Any, low: int, high: int | None = None) -> Any:
    """``doc[name]``, an integer in ``[low, high]`` (null or absent: ``default``)."""
    value = doc.get(name)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        expected = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise BadParam(name, f"{name}={value!r}: expected an integer {expected}")
    return value


def flag(doc: dict[str, Any], name: str, *, default: bool = False) -> bool:
    """``doc[name]``, true or false (null or absent: ``default``)."""
    value = doc.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadParam(name, f"{name}={value!r}: expected true or false")
    return value


def list_of(doc: dict[str, Any], name: str) -> list[Any]:
    """``doc[name]``, a list (null or absent: empty)."""
    value = doc.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadParam(name, f"{name}={value!r}: expected a list")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadParam("stop", f"stop={value!r}: expected a string or a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise BadParam("stop", f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS}")
    return tuple(stops)
