"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions``.

:func:`prepare` reads and checks a request body (raising before any byte is sent, so a
bad request gets a plain error response); then :func:`respond` builds the whole answer,
or :func:`stream` yields it as server-sent events in OpenAI's chunk shape::

    data: {"id": "cmpl-…", "object": "text_completion", "choices": [{"index": 0, "text": "He", …}]}

    data: {… "choices": [{"index": 1, "text": "llo", "finish_reason": "length", …}]}

    data: {… "choices": [], "usage": {…}}          (with stream_options.include_usage)

    data: [DONE]

Taken: ``model``, ``prompt`` (a string or a list of token ids; one prompt) or
``messages``, ``max_tokens`` (chat: also ``max_completion_tokens``; default 16 for
completions, the rest of the context for chat), ``stream``,
``stream_options.include_usage``, ``n`` (choices sampled side by side; with a ``seed``,
choice i samples with ``seed + i``, as vLLM), ``echo`` (completions: the prompt's text
first; with ``logprobs``, its tokens' log-probabilities first), ``logprobs`` /
``top_logprobs``, the sampling fields of ``completion_params.py`` and carpool's
``priority`` (a class name: interactive, normal, background). Other fields follow
``openai_fields.py``. A prompt past the context, or a ``max_tokens`` past the whole
context, is a 400 with OpenAI's ``context_length_exceeded`` code; a ``max_tokens`` that
only this prompt takes past it is lowered to fit, as vLLM does (a 400 too under
``--strict-openai``, as OpenAI answers).
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from carpool.generation.types import SamplingParams, TokenLogprobs
from carpool.server.completion_logprobs import LogprobsWriter
from carpool.server.completion_params import flag, integer, sampling_params
from carpool.server.errors import NotFound, openai_error
from carpool.server.generation import GenerationService
from carpool.server.openai import BadParam, parse_object, priority_class
from carpool.server.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, IgnoredFields
from carpool.server.repository import ModelRepository

MAX_CHOICES = 128  # OpenAI's bound on n
CHOICE_EVENTS_AHEAD = 2  # a choice's events in the merge of n > 1 (_choices) not yet read


@dataclass(frozen=True, slots=True)
class CompletionCall:
    """A checked request, ready to run: ``n`` choices, each sampled with
    ``choice_sampling(i)``; ``echo`` is the text written before each choice's."""

    service: GenerationService
    prompt_ids: list[int]
    sampling: SamplingParams
    priority: str | None
    is_chat: bool
    is_stream: bool
    include_usage: bool
    response_id: str
    created: int
    n: int = 1
    echo: str = ""
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids

    def choice_sampling(self, index: int) -> SamplingParams:
        seed = self.sampling.seed
        if index == 0 or seed is None:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=(seed + index + 2**63) % 2**64 - 2**63)

    def logprobs_writer(self) -> LogprobsWriter | None:
        if self.sampling.logprobs is None:
            return None
        tokenizer = self.service.tokenizer
        return LogprobsWriter(
            tokenizer,
            is_chat=self.is_chat,
            start_offset=len(self.echo),
            tokens_as_ids=self.tokens_as_ids,
        )


async def prepare(
    repository: ModelRepository,
    body: bytes,
    *,
    is_chat: bool,
    fields: IgnoredFields | None = None,
) -> CompletionCall:
    """The request in ``body``, checked and tokenized; ``fields``: the server's policy
    for fields no one defines (default: ignore them, uncounted), whose ``strict`` also
    refuses a ``max_tokens`` past the context instead of lowering it.

    Raises:
        BadParam: naming the field that is missing, malformed or not supported.
        NotFound: when ``model`` is not a generation model.
    """
    doc = parse_object(body)
    fields = fields or IgnoredFields()
    fields.check(doc, CHAT_FIELDS if is_chat else COMPLETION_FIELDS)
    service = _service(repository, doc)
    loop = asyncio.get_running_loop()
    if is_chat:
        add_special = flag(
            doc, "add_special_tokens", default=service.tokenizer.chat_adds_special_tokens
        )
        prompt_ids = await loop.run_in_executor(
            None, _chat_prompt, service, doc.get("messages"), add_special
        )
    else:
        add_special = flag(doc, "add_special_tokens", default=True)
        prompt_ids = await loop.run_in_executor(
            None, _completion_prompt, service, doc.get("prompt"), add_special
        )
    stream = flag(doc, "stream")
    options = doc.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise BadParam("stream_options", "stream_options: expected an object, with stream: true")
    priority = priority_class(doc, service.classes)
    sampling = sampling_params(doc, service, len(prompt_ids), is_chat, not fields.strict)
    if is_chat and flag(doc, "echo"):  # vLLM's: the last message again; not done here
        raise BadParam("echo", "echo=True is not supported by carpool on chat; leave echo out")
    echo = "" if is_chat else _echo(doc, service, prompt_ids)
    if echo and sampling.logprobs is not None:  # the prompt's log-probabilities too
        sampling = dataclasses.replace(sampling, prompt_logprobs=sampling.logprobs)
    return CompletionCall(
        service=service,
        prompt_ids=prompt_ids,
        sampling=sampling,
        priority=priority,
        is_chat=is_chat,
        is_stream=stream,
        include_usage=bool(options and options.get("include_usage") is True),
        response_id=f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()),
        n=integer(doc, "n", 1, 1, MAX_CHOICES),
        echo=echo,
        tokens_as_ids=flag(doc, "return_tokens_as_token_ids"),
    )


def _echo(doc: dict[str, Any], service: GenerationService, prompt_ids: list[int]) -> str:
    if not flag(doc, "echo"):
        return ""
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else service.tokenizer.decode(prompt_ids)


async def _choices(call: CompletionCall) -> AsyncGenerator[tuple[int, GenerationEvent], None]:
    """Every choice's events as they come, each with its choice's index. Leaving early
    (or one choice failing) aborts every choice still running.

    Each choice has at most :data:`CHOICE_EVENTS_AHEAD` events in the merge: what a slow
    reader has not taken waits in the engine, which holds a choice that falls too far
    behind (carpool.generation.engine, back-pressure) rather than generating on into
    this queue."""
    engine = call.service.engine
    if call.n == 1:
        events = engine.generate(call.prompt_ids, call.sampling, call.priority)
        try:
            async for event in events:
                yield 0, event
        finally:
            await events.aclose()
        return
    queue: asyncio.Queue[tuple[int, GenerationEvent | BaseException | None]] = asyncio.Queue()
    rooms = [asyncio.Semaphore(CHOICE_EVENTS_AHEAD) for _ in range(call.n)]

    async def pump(index: int) -> None:
        room = rooms[index]
        try:
            sampling = call.choice_sampling(index)
            async for event in engine.generate(call.prompt_ids, sampling, call.priority):
                await room.acquire()
                queue.put_nowait((index, event))
        except Exception as error:
            queue.put_nowait((index, error))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(call.n)]
    try:
        running = call.n
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                rooms[index].release()
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def respond(call: CompletionCall) -> bytes:
    """The whole (non-streamed) response body."""
    texts: list[list[str]] = [[call.echo] for _ in range(call.n)]
    logprobs: list[list[TokenLogprobs]] = [[] for _ in range(call.n)]
    prompt_logprobs: list[tuple[TokenLogprobs, ...]] = [() for _ in range(call.n)]
    finish: list[str | None] = [None] * call.n
    completion_tokens = prompt_tokens = 0
    async for index, event in _choices(call):
        texts[index].append(event.text)
        logprobs[index].extend(event.logprobs)
        prompt_logprobs[index] = prompt_logprobs[index] or event.prompt_logprobs
        if event.finish_reason is not None:
            finish[index] = event.finish_reason.value
        if event.usage is not None:
            prompt_tokens = event.usage.prompt_tokens
            completion_tokens += event.usage.completion_tokens
    choices = []
    for index in range(call.n):
        text = "".join(texts[index])
        writer = call.logprobs_writer()
        found = None if writer is None else writer.document(logprobs[index])
        if writer is not None and found is not None and call.sampling.prompt_logprobs is not None:
            echoed = writer.prompt_document(call.prompt_ids[0], prompt_logprobs[index])
            found = {key: echoed[key] + found[key] for key in found}
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": found,
            "finish_reason": finish[index],
        }
        if call.is_chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choices.append(choice)
    document = _envelope(call, chunk=False)
    document["choices"] = choices
    document["usage"] = _usage(Usage(prompt_tokens, completion_tokens))
    return orjson.dumps(document)


async def stream(call: CompletionCall) -> AsyncGenerator[bytes, None]:
    """The response as server-sent events, ``data: [DONE]`` last. A failure after the
    first event is sent as an ``error`` event (the status line is already out).

    A chat choice's first chunk, the assistant's role with empty content, goes out with
    its first event (its first token), as vLLM sends it: a client times its first token
    from the first chunk (``vllm bench serve`` does), and a role sent at once would have
    it time the request's arrival instead."""
    events = _choices(call)
    writers = [call.logprobs_writer() for _ in range(call.n)]
    completion_tokens = prompt_tokens = 0
    # With the prompt's log-probabilities the echo waits for them: they come with the
    # choice's first event.
    waiting_echo = set(range(call.n)) if call.sampling.prompt_logprobs is not None else set()
    waiting_role = set(range(call.n)) if call.is_chat else set()
    try:
        for index in range(call.n):
            if call.echo and not call.is_chat and index not in waiting_echo:
                yield _sse(_chunk(call, index, call.echo, None))
        async for index, event in events:
            if index in waiting_role:
                waiting_role.discard(index)
                yield _sse(_chunk(call, index, {"role": "assistant", "content": ""}, None))
            finish = event.finish_reason.value if event.finish_reason is not None else None
            writer = writers[index]
            if index in waiting_echo and writer is not None:
                waiting_echo.discard(index)
                echoed = writer.prompt_document(call.prompt_ids[0], event.prompt_logprobs)
                yield _sse(_chunk(call, index, call.echo, None, echoed))
            if event.text or finish is not None or (writer is not None and event.logprobs):
                found = None if writer is None else writer.document(event.logprobs)
                yield _sse(_chunk(call, index, event.text, finish, found))
            if event.usage is not None:
                prompt_tokens = event.usage.prompt_tokens
                completion_tokens += event.usage.completion_tokens
        if call.include_usage:
            document = _envelope(call, chunk=True)
            document["choices"] = []
            document["usage"] = _usage(Usage(prompt_tokens, completion_tokens))
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


def _chunk(
    call: CompletionCall,
    index: int,
    text: str | dict[str, str],
    finish: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    document = _envelope(call, chunk=True)
    choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
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


def _completion_prompt(service: GenerationService, prompt: Any, add_special: bool) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise BadParam("prompt", "prompt is an empty string; expected some text")
        return service.tokenizer.encode(prompt, add_special_tokens=add_special)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list):
        try:
            return check_token_ids(prompt, service.engine.vocab_size)
        except InvalidInput as error:
            raise BadParam("prompt", str(error)) from None
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadParam("prompt", f"prompt holds {len(prompt)} prompts; send one per request")
    raise BadParam("prompt", f"prompt={prompt!r}: expected a string or a list of token ids")


def _chat_prompt(service: GenerationService, messages: Any, add_special: bool) -> list[int]:
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
    return tokenizer.encode(text, add_special_tokens=add_special)
