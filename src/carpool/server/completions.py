"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions``.

:func:`prepare` reads and checks a request body (raising before any byte is sent, so a
bad request gets a plain error response); then :func:`respond` builds the whole answer,
or :func:`stream` yields it as server-sent events in OpenAI's chunk shape::

    data: {"id": "cmpl-…", "object": "text_completion", "choices": [{"text": "He", …}]}

    data: {… "choices": [{"text": "llo", "finish_reason": "length", …}]}

    data: {… "choices": [], "usage": {…}}          (with stream_options.include_usage)

    data: [DONE]

Taken: ``model``, ``prompt`` (a string or a list of token ids; one prompt) or
``messages``, ``max_tokens`` (chat: also ``max_completion_tokens``; default 16 for
completions, the rest of the context for chat), ``temperature``, ``top_p``, ``seed``,
``stop``, ``n`` (1 only), ``stream``, ``stream_options.include_usage``, ``user``
(ignored), and carpool's extensions ``top_k``, ``ignore_eos``, ``stop_token_ids`` and
``priority`` (a class name: interactive, normal, background). Refused with a 400 naming
the field: ``n > 1``, ``echo``, ``logprobs``, ``best_of > 1``, ``suffix``, ``logit_bias``,
non-zero penalties, tools, a ``response_format`` other than text. A prompt or
``max_tokens`` past the context is a 400 with OpenAI's ``context_length_exceeded`` code.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import orjson

from carpool.errors import InvalidInput
from carpool.generation.chat import ChatMessage, render_chat
from carpool.generation.engine import GenerationEvent, Usage
from carpool.generation.tokenizer import check_token_ids
from carpool.generation.types import SamplingParams
from carpool.server.errors import NotFound, openai_error
from carpool.server.generation import GenerationService
from carpool.server.openai import BadParam, json_object, priority_class
from carpool.server.repository import ModelRepository

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code
MAX_STOP_STRINGS = 4

_COMMON = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "user",
    "priority",
    "ignore_eos",
    "stop_token_ids",
    "logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
)
COMPLETION_FIELDS = (*_COMMON, "prompt", "echo", "best_of", "suffix")
CHAT_FIELDS = (
    *_COMMON,
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
)
# Known fields carpool does not implement: the values that mean "not used".
_UNUSED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}),  # plain text: what carpool writes anyway
}


@dataclass(frozen=True, slots=True)
class CompletionCall:
    """A checked request, ready to run."""

    service: GenerationService
    prompt_ids: list[int]
    sampling: SamplingParams
    priority: str | None
    is_chat: bool
    is_stream: bool
    include_usage: bool
    response_id: str
    created: int


async def prepare(repository: ModelRepository, body: bytes, *, is_chat: bool) -> CompletionCall:
    """The request in ``body``, checked and tokenized.

    Raises:
        BadParam: naming the field that is missing, malformed or not supported.
        NotFound: when ``model`` is not a generation model.
    """
    doc = json_object(body, CHAT_FIELDS if is_chat else COMPLETION_FIELDS)
    service = _service(repository, doc)
    for name, unused in _UNUSED.items():
        if name in doc and not _is_unused(doc[name], unused):
            raise BadParam(name, _unsupported(name, doc[name]))
    loop = asyncio.get_running_loop()
    if is_chat:
        prompt_ids = await loop.run_in_executor(None, _chat_prompt, service, doc.get("messages"))
    else:
        prompt_ids = await loop.run_in_executor(
            None, _completion_prompt, service, doc.get("prompt")
        )
    stream = _flag(doc, "stream")
    options = doc.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise BadParam("stream_options", "stream_options: expected an object, with stream: true")
    priority = priority_class(doc, service.classes)
    return CompletionCall(
        service=service,
        prompt_ids=prompt_ids,
        sampling=_sampling(doc, service, len(prompt_ids), is_chat),
        priority=priority,
        is_chat=is_chat,
        is_stream=stream,
        include_usage=bool(options and options.get("include_usage") is True),
        response_id=f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()),
    )


async def respond(call: CompletionCall) -> bytes:
    """The whole (non-streamed) response body."""
    engine = call.service.engine
    texts: list[str] = []
    last: GenerationEvent | None = None
    async for event in engine.generate(call.prompt_ids, call.sampling, call.priority):
        texts.append(event.text)
        last = event
    assert last is not None and last.finish_reason is not None and last.usage is not None
    text = "".join(texts)
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": None,
        "finish_reason": last.finish_reason.value,
    }
    if call.is_chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    document = _envelope(call, chunk=False)
    document["choices"] = [choice]
    document["usage"] = _usage(last.usage)
    return orjson.dumps(document)


async def stream(call: CompletionCall) -> AsyncGenerator[bytes, None]:
    """The response as server-sent events, ``data: [DONE]`` last. A failure after the
    first event is sent as an ``error`` event (the status line is already out)."""
    events = call.service.engine.generate(call.prompt_ids, call.sampling, call.priority)
    try:
        if call.is_chat:
            yield _sse(_chunk(call, {"role": "assistant", "content": ""}, None))
        async for event in events:
            finish = event.finish_reason.value if event.finish_reason is not None else None
            if event.text or finish is not None:
                yield _sse(_chunk(call, event.text, finish))
            if event.usage is not None and call.include_usage:
                document = _envelope(call, chunk=True)
                document["choices"] = []
                document["usage"] = _usage(event.usage)
                yield _sse(document)
    except Exception as error:
        _, document = openai_error(error)
        yield _sse(document)
    finally:
        await events.aclose()  # a client gone mid-stream: abort the request now
    yield b"data: [DONE]\n\n"


def _sse(document: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(document) + b"\n\n"


def _envelope(call: CompletionCall, *, chunk: bool) -> dict[str, Any]:
    if call.is_chat:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        kind = "text_completion"
    return {
        "id": call.response_id,
        "object": kind,
        "created": call.created,
        "model": call.service.name,
    }


def _chunk(call: CompletionCall, text: str | dict[str, str], finish: str | None) -> dict[str, Any]:
    document = _envelope(call, chunk=True)
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
    if call.is_chat:
        choice["delta"] = text if isinstance(text, dict) else ({"content": text} if text else {})
    else:
        choice["text"] = text
    document["choices"] = [choice]
    if call.include_usage:
        document["usage"] = None
    return document


def _usage(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _service(repository: ModelRepository, doc: dict[str, Any]) -> GenerationService:
    name = doc.get("model")
    if not isinstance(name, str):
        raise BadParam("model", f"model={name!r}: expected the name of a generation model")
    services = repository.generation_services()
    service = services.get(name)
    if service is None:
        raise NotFound(f"generation model {name!r}", sorted(services), is_model=True)
    return service


def _unsupported(name: str, value: Any) -> str:
    if name == "n":
        return f"n={value!r}: carpool returns one choice per request; send n requests instead"
    return f"{name}={value!r} is not supported by carpool; leave {name} out"


def _completion_prompt(service: GenerationService, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise BadParam("prompt", "prompt is an empty string; expected some text")
        return service.tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list):
        try:
            return check_token_ids(prompt, service.tokenizer.vocab_size)
        except InvalidInput as error:
            raise BadParam("prompt", str(error)) from None
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadParam("prompt", f"prompt holds {len(prompt)} prompts; send one per request")
    raise BadParam("prompt", f"prompt={prompt!r}: expected a string or a list of token ids")


def _chat_prompt(service: GenerationService, messages: Any) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise BadParam("messages", "messages: expected a non-empty list of {role, content}")
    tokenizer = service.tokenizer
    template = tokenizer.chat_template
    if template is None:  # as vLLM: no default template since transformers 4.44
        raise BadParam(
            "messages",
            f"model {service.name!r} has no chat template (no chat_template in its "
            "tokenizer_config.json, no chat_template.jinja); add one to its folder, or send "
            "the prompt text to /v1/completions",
        )
    try:
        parsed = [ChatMessage.from_json(m, i) for i, m in enumerate(messages)]
        text = render_chat(
            parsed,
            template,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
        )
    except InvalidInput as error:
        raise BadParam("messages", str(error)) from None
    return tokenizer.encode(text, add_special_tokens=tokenizer.chat_adds_special_tokens)


def _sampling(
    doc: dict[str, Any], service: GenerationService, num_prompt: int, is_chat: bool
) -> SamplingParams:
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
    elif isinstance(max_tokens, int) and max_tokens > room:  # refused before a stream starts
        raise BadParam(
            key,
            f"{context}. However, you requested {num_prompt + max_tokens} tokens "
            f"({num_prompt} in the {what}, {max_tokens} in the completion); lower {key} "
            f"to {room} or less",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    vocab_size = service.tokenizer.vocab_size
    # -1 or 0: off (vLLM writes -1); more than the vocabulary is all of it.
    top_k = min(max(_integer(doc, "top_k", 0, -1), 0), vocab_size)
    try:
        stop_token_ids = tuple(
            check_token_ids(_list(doc, "stop_token_ids"), vocab_size, "stop_token_ids")
        )
    except InvalidInput as error:  # check_token_ids knows no OpenAI params: name it
        raise BadParam("stop_token_ids", str(error)) from None
    return SamplingParams(
        temperature=_number(doc, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(doc, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=top_k,
        seed=_integer(doc, "seed", None, -(2**63), 2**63 - 1),  # int64, as vLLM bounds it
        max_tokens=_integer({key: max_tokens}, key, None, 1),
        stop=_stop(doc.get("stop")),
        stop_token_ids=stop_token_ids,
        ignore_eos=_flag(doc, "ignore_eos"),
    )


def _is_unused(value: Any, unused: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of the "not used" values, by type too: ``0`` is not
    ``False`` (``logprobs: 0`` asks for log-probabilities)."""
    return any(value is u or (type(value) is type(u) and value == u) for u in unused)


def _number(
    doc: dict[str, Any],
    name: str,
    default: float,
    low: float,
    high: float,
    *,
    low_open: bool = False,
) -> float:
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadParam(name, f"{name}={value!r}: expected a number")
    if not (low < value if low_open else low <= value) or value > high:
        bracket = "(" if low_open else "["
        raise BadParam(name, f"{name}={value!r}: expected a number in {bracket}{low}, {high}]")
    return float(value)


def _integer(
    doc: dict[str, Any], name: str, default: Any, low: int, high: int | None = None
) -> Any:
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


def _flag(doc: dict[str, Any], name: str) -> bool:
    value = doc.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadParam(name, f"{name}={value!r}: expected true or false")
    return value


def _list(doc: dict[str, Any], name: str) -> list[Any]:
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
