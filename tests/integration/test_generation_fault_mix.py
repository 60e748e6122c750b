"""`carpool serve` generating under a mix of concurrent good and bad traffic, with a KV
cache too small for it (preemption by recompute happens), then SIGTERM with streams open.

The model is a random-weight Llama with a character-level tokenizer: every token but EOS
is one character, so the text a client sees says how many tokens were generated (the EOS
``~`` is an ordinary character, so with ``ignore_eos`` it shows as one). Each good request
is first answered alone; under load, streamed or not, next to preempted neighbours,
prefix-cache hits, clients that hang up and malformed requests, it must get the same
answer (greedy, and seeded sampling: a request's seed makes it repeatable alone or
batched). Afterwards ``/metrics`` must show no request left, every KV block free, one abort
per client that left, and the server must still answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .charllama import CHARS, EOS, char_llama_folder
from .conftest import ServedProcess, start_served_process

MODEL = "tight-llama"
LIMIT_S = 30.0  # only against hangs
MAX_MODEL_LEN = 128
BLOCK_SIZE = 4
NUM_BLOCKS = 40  # 160 tokens: far less than 8 sequences of up to 128 want
CONFIG = """\
models:
  - name: {model}
    kind: generation
    source: {folder}
    block_size: {block_size}
    num_blocks: {num_blocks}
    max_num_seqs: 8
    max_num_batched_tokens: 48
    max_model_len: {max_model_len}
"""
SHARED = "Carpools share the ride, so nobody drives alone: "  # a prefix of 12 full blocks


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    root = tmp_path_factory.mktemp("generation_fault_mix")
    folder = char_llama_folder(root / "model", MAX_MODEL_LEN)
    config = CONFIG.format(
        model=MODEL,
        folder=folder,
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
    )
    server = start_served_process(config, root)
    try:
        yield server
    finally:
        assert server.stop() == 0, server.output()
    assert "Traceback" not in server.output(), server.output()


# -- requests and answers -----------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """One good request: its body (``stream`` is set when sent) and the prompt it makes."""

    name: str
    is_chat: bool
    body: dict[str, Any]

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.is_chat else "/v1/completions"

    @property
    def prompt_text(self) -> str:
        """The prompt as text the tokenizer reads (the chat template rendered)."""
        if not self.is_chat:
            prompt = self.body["prompt"]
            if isinstance(prompt, list) and isinstance(prompt[0], int):
                return "".join(CHARS[i] for i in prompt)
            return prompt[0] if isinstance(prompt, list) else str(prompt)
        turns = "".join(f"{m['role']}: {m['content']}\n" for m in self.body["messages"])
        return f"{turns}assistant:"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_text)

    def with_body(self, **changes: Any) -> Ask:
        return replace(self, body={**self.body, **changes})


@dataclass
class Answer:
    text: str
    finish_reason: str
    usage: dict[str, int]
    num_text_chunks: int = 0  # streamed: chunks with text

    @property
    def key(self) -> tuple[str, str, dict[str, int]]:
        return (self.text, self.finish_reason, self.usage)


def _body(ask: Ask, *, stream: bool) -> dict[str, Any]:
    body = {"model": MODEL, **ask.body}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def _whole(client: httpx.AsyncClient, ask: Ask) -> Answer:
    response = await client.post(ask.path, json=_body(ask, stream=False))
    assert response.status_code == 200, (ask.name, response.text)
    document = response.json()
    assert document["object"] == ("chat.completion" if ask.is_chat else "text_completion")
    assert document["model"] == MODEL and len(document["choices"]) == 1
    choice = document["choices"][0]
    if ask.is_chat:
        assert choice["message"]["role"] == "assistant"
        text = choice["message"]["content"]
    else:
        text = choice["text"]
    return Answer(text, choice["finish_reason"], document["usage"])


async def _streamed(client: httpx.AsyncClient, ask: Ask) -> Answer:
    async with client.stream("POST", ask.path, json=_body(ask, stream=True)) as response:
        assert response.status_code == 200, (ask.name, await response.aread())
        assert response.headers["content-type"] == "text/event-stream"
        lines = [line async for line in response.aiter_lines() if line]
    return _parse_events(ask, lines)


def _parse_events(ask: Ask, lines: list[str]) -> Answer:
    """The answer a well-formed event stream holds; fails on any malformed part."""
    assert lines and lines[-1] == "data: [DONE]", (ask.name, lines[-3:])
    assert all(line.startswith("data: {") for line in lines[:-1]), (ask.name, lines)
    chunks = [orjson.loads(line[6:]) for line in lines[:-1]]
    kind = "chat.completion.chunk" if ask.is_chat else "text_completion"
    assert {(c["id"], c["object"], c["model"]) for c in chunks} == {
        (chunks[0]["id"], kind, MODEL)
    }, ask.name
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"] is not None, (ask.name, last)
    choices = [c["choices"][0] for c in choice_chunks]
    assert all(c["usage"] is None for c in choice_chunks), ask.name
    finishes = [c["finish_reason"] for c in choices]
    assert finishes[-1] is not None and set(finishes[:-1]) <= {None}, (ask.name, finishes)
    if ask.is_chat:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}, ask.name
        texts = [c["delta"].get("content", "") for c in choices[1:]]
    else:
        texts = [c["text"] for c in choices]
    return Answer("".join(texts), finishes[-1], last["usage"], sum(1 for t in texts if t))


def _check_accounting(ask: Ask, answer: Answer) -> None:
    """What a character-level tokenizer lets one check on any answer alone."""
    usage, text, body = answer.usage, answer.text, ask.body
    assert usage["prompt_tokens"] == ask.num_prompt_tokens, (ask.name, usage)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    assert not any(s in text for s in stops), (ask.name, text, stops)
    if not body.get("ignore_eos"):
        assert EOS not in text, (ask.name, text)  # EOS stops it; its text is not shown
    assert not any(CHARS[i] in text for i in body.get("stop_token_ids", [])), (ask.name, text)
    if answer.finish_reason == "length":
        assert usage["completion_tokens"] == body["max_tokens"] == len(text), (ask.name, answer)
    else:
        assert answer.finish_reason == "stop", (ask.name, answer)
        assert usage["completion_tokens"] <= body["max_tokens"], (ask.name, answer)
        if stops:  # ends before a stop string, or at EOS (one token, no text)
            ends = [len(text) + len(s) for s in stops]
            if not body.get("ignore_eos"):
                ends.append(len(text) + 1)
            assert usage["completion_tokens"] in ends, (ask.name, answer)
        else:  # at EOS or a stop token: one token, no text
            assert not body.get("ignore_eos") or body.get("stop_token_ids"), (ask.name, answer)
            assert usage["completion_tokens"] == len(text) + 1, (ask.name, answer)


def _good_asks() -> list[Ask]:
    """Completions and chats: greedy and seeded, with and without ``ignore_eos``, short and
    long, every priority class, some sharing a long prompt prefix."""
    priorities = ["interactive", "normal", "background", None]
    asks: list[Ask] = []
    for i in range(6):  # greedy completions that run to max_tokens
        asks.append(
            Ask(
                f"greedy-{i}",
                False,
                {"prompt": f"Request {i} asks for", "max_tokens": (12, 30, 60, 90)[i % 4],
                 "temperature": 0, "ignore_eos": True, "priority": priorities[i % 4]},
            )
        )  # fmt: skip
    for i in range(4):  # greedy completions that may stop at EOS
        asks.append(
            Ask(
                f"eos-{i}",
                False,
                {"prompt": f"Tell {i} a tale", "max_tokens": 70, "temperature": 0,
                 "priority": priorities[(i + 1) % 4]},
            )
        )  # fmt: skip
    for i in range(6):  # seeded sampling, completions and chats
        body: dict[str, Any] = {
            "max_tokens": (20, 45, 80)[i % 3],
            "temperature": 0.9,
            "seed": 1000 + i,
            "priority": priorities[(i + 2) % 4],
        }
        if i % 2:
            body |= {"messages": [{"role": "user", "content": f"Roll {i} dice"}], "top_p": 0.9}
            asks.append(Ask(f"seeded-chat-{i}", True, body))
        else:
            body |= {"prompt": f"Sample {i}:", "ignore_eos": True, "top_k": 20}
            asks.append(Ask(f"seeded-{i}", False, body))
    for i in range(3):  # greedy chats
        messages = [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": f"Question {i}?"},
        ]
        asks.append(
            Ask(f"chat-{i}", True, {"messages": messages, "max_tokens": 40, "temperature": 0})
        )
    for i, prompt in enumerate(("Token ids", [CHARS.index(c) for c in "Token ids"], ["Token ids"])):
        # a prompt as text, as token ids or as a batch of one: the same answer
        asks.append(Ask(f"ids-{i}", False, {"prompt": prompt, "max_tokens": 32, "temperature": 0}))
    edge = "At the edge of the context"  # prompt and output fill max_model_len exactly
    asks.append(
        Ask("edge", False, {"prompt": edge, "max_tokens": MAX_MODEL_LEN - len(edge),
                            "temperature": 0, "ignore_eos": True, "priority": "background"})
    )  # fmt: skip
    stop_ids = [CHARS.index(c) for c in "aeiou"]  # a stop token counts, its text is hidden
    asks.append(
        Ask("stop-ids", False, {"prompt": "Vowels end it", "max_tokens": 60, "temperature": 0,
                                "ignore_eos": True, "stop_token_ids": stop_ids})
    )  # fmt: skip
    for i in range(5):  # a long shared prefix: prefix-cache hits, sharing blocks
        asks.append(
            Ask(
                f"prefix-{i}",
                False,
                {"prompt": f"{SHARED}{i}", "max_tokens": 24 + 8 * i, "temperature": 0,
                 "ignore_eos": True, "priority": priorities[i % 4]},
            )
        )  # fmt: skip
    return asks


def _stop_asks(asks: list[Ask], alone: dict[str, Answer]) -> list[tuple[Ask, Answer]]:
    """Greedy requests again with a stop string taken from their own text (so it is hit),
    with what they must answer: the text up to its first occurrence."""
    derived: list[tuple[Ask, Answer]] = []
    for ask in asks:
        if not ask.name.startswith(("greedy-", "prefix-")) or ask.body["max_tokens"] < 30:
            continue
        full = alone[ask.name].text
        stop = full[20:23]
        end = full.find(stop)
        stops = [stop, "\x7f\x7f"] if len(derived) % 2 else stop
        usage = {
            "prompt_tokens": ask.num_prompt_tokens,
            "completion_tokens": end + len(stop),
            "total_tokens": ask.num_prompt_tokens + end + len(stop),
        }
        again = replace(ask.with_body(stop=stops), name=f"stop-{ask.name}")
        derived.append((again, Answer(full[:end], "stop", usage)))
    return derived


def _json(document: dict[str, Any]) -> bytes:
    return orjson.dumps({"model": MODEL, **document})


LONG = "x" * MAX_MODEL_LEN
# (path, body, status, param, code): each must get its 4xx in OpenAI's error shape.
BAD: list[tuple[str, bytes, int, str | None, str | None]] = [
    ("/v1/completions", b'{"model": "tight-llama", "prompt": ', 400, None, None),
    ("/v1/chat/completions", b"\xff\xfe not json", 400, None, None),
    ("/v1/completions", b'["a list"]', 400, None, None),
    ("/v1/completions", orjson.dumps({"model": "nope", "prompt": "x"}), 404, None,
     "model_not_found"),
    ("/v1/completions", _json({"prompt": LONG}), 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", _json({"prompt": "hi", "max_tokens": MAX_MODEL_LEN + 1}), 400,
     "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", _json({"messages": [{"role": "user", "content": LONG}]}), 400,
     "messages", "context_length_exceeded"),
    ("/v1/completions", _json({"prompt": "hi", "temperature": 3}), 400, "temperature", None),
    ("/v1/completions", _json({"prompt": "hi", "n": 0}), 400, "n", None),
    ("/v1/completions", _json({"prompt": "hi", "priority": "urgent"}), 400, "priority", None),
    ("/v1/completions", _json({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}), 400,
     "stop", None),
    ("/v1/completions", _json({"prompt": "hi", "max_tokens": 0}), 400, "max_tokens", None),
    ("/v1/completions", _json({"prompt": [5, 500]}), 400, "prompt", None),
    ("/v1/completions", _json({"prompt": ""}), 400, "prompt", None),
    # An unknown field is ignored (as vLLM does); one OpenAI defines and carpool cannot do
    # is refused by name.
    ("/v1/completions", _json({"prompt": "hi", "tools": [{"type": "function"}]}), 400,
     "tools", None),
    ("/v1/chat/completions", _json({"messages": "hi"}), 400, "messages", None),
    ("/v1/chat/completions", _json({"messages": [{"role": "user"}]}), 400, "messages", None),
    ("/v1/completions", _json({"prompt": "hi", "stream": "yes"}), 400, "stream", None),
    ("/v1/completions", _json({"prompt": "hi", "seed": 2**63}), 400, "seed", None),
    ("/v1/completions", _json({"prompt": "hi", "stream_options": {"include_usage": True}}),
     400, "stream_options", None),
    ("/v1/completions", _json({"prompt": "hi", "priority": 1}), 400, "priority", None),
    ("/v1/completions", _json({"prompt": "hi", "max_tokens": 1.5}), 400, "max_tokens", None),
    ("/v1/completions", _json({"prompt": "hi", "top_p": 0}), 400, "top_p", None),
    ("/v1/completions", _json({"prompt": "hi", "stop_token_ids": [500]}), 400,
     "stop_token_ids", None),
    ("/v1/chat/completions", orjson.dumps({"model": "nope", "messages": [], "stream": True}),
     404, None, "model_not_found"),
    ("GET /v1/completions", b"", 405, None, None),
    ("GZIP /v1/completions", _json({"prompt": "hi"}), 400, None, None),
    ("/v1/completions", _json({"prompt": LONG, "stream": True}), 400, "prompt",
     "context_length_exceeded"),
    ("/v1/chat/completions", _json({"messages": [{"role": "user", "content": "hi"}],
     "stream": True, "max_completion_tokens": MAX_MODEL_LEN + 1}), 400, "max_completion_tokens",
     "context_length_exceeded"),
]  # fmt: skip


async def _bad(client: httpx.AsyncClient, i: int) -> None:
    path, body, status, param, code = BAD[i]
    method, _, path = path.rpartition(" ")
    headers = {"content-type": "application/json"}
    if method == "GZIP":  # says gzip, is not
        method, headers["content-encoding"] = "POST", "gzip"
    response = await client.request(method or "POST", path, content=body, headers=headers)
    assert response.status_code == status, (i, response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, (i, error)
    assert error["type"] == "invalid_request_error" and error["message"], (i, error)
    assert (error["param"], error["code"]) == (param, code), (i, error)


# -- clients that leave -----------------------------------------------------------------

LEAVING = {"prompt": "Leave me", "max_tokens": 100, "ignore_eos": True, "temperature": 0}


async def _leave_mid_stream(client: httpx.AsyncClient, priority: str) -> None:
    body = _body(Ask("leave", False, {**LEAVING, "priority": priority}), stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {") and orjson.loads(line[6:])["choices"][0]["text"]:
                return  # one token seen: hang up


async def _leave_before_first_token(client: httpx.AsyncClient) -> None:
    chat = {**LEAVING, "messages": [{"role": "user", "content": "Leave me"}]}
    del chat["prompt"]
    body = _body(Ask("leave", True, chat), stream=True)
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200  # the headers come before any token: hang up


async def _leave_at_once(address: str, *, stream: bool = False, cut: int = 0) -> None:
    """A request sent in full (``cut``: all but ``cut`` bytes of its body), the connection
    then closed at once, before any answer."""
    host, port = address.split(":")
    body = _json({**LEAVING, "prompt": "Gone before it began", "stream": stream})
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[: len(body) - cut]
    )
    await writer.drain()
    writer.close()
    await writer.wait_closed()


# -- what the server reports ------------------------------------------------------------


async def _metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """The generation model's samples by name (``finished_reason`` appended)."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.labels.get("model") != MODEL or not sample.name.startswith(
                "carpool_generation_"
            ):
                continue
            name = sample.name.removeprefix("carpool_generation_")
            if "finished_reason" in sample.labels:
                name += ":" + sample.labels["finished_reason"]
            if "le" not in sample.labels:
                found[name] = sample.value
    return found


async def _settled(client: httpx.AsyncClient, num_aborts: float) -> dict[str, float]:
    """The metrics once nothing runs or waits and ``num_aborts`` aborts are counted (an
    abort is counted when the server sees the hang-up, maybe after the client left)."""
    for _ in range(int(LIMIT_S / 0.02)):
        metrics = await _metrics(client)
        if (
            metrics["requests_running"] == metrics["requests_waiting"] == 0
            and metrics.get("requests_finished_total:abort", 0.0) >= num_aborts
        ):
            return metrics
        await asyncio.sleep(0.02)  # polling another process's state, not a timing check
    pytest.fail(f"the server never settled: {metrics}")


def _client(served: ServedProcess) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=64)
    return httpx.AsyncClient(base_url=f"http://{served.http_url}", timeout=LIMIT_S, limits=limits)


# -- the tests --------------------------------------------------------------------------


async def test_mixed_load_answers_as_alone_and_leaves_nothing_behind(
    served: ServedProcess,
) -> None:
    """Each good request alone first; then all of them twice (whole and streamed) at once
    with clients that leave and malformed requests: the same answers, every bad request
    its 4xx, one abort per client that left, nothing left running, every block free."""
    asks = _good_asks()
    async with _client(served) as client:
        alone = {ask.name: await _whole(client, ask) for ask in asks}
        for ask in asks:
            _check_accounting(ask, alone[ask.name])
        assert alone["ids-0"].key == alone["ids-1"].key == alone["ids-2"].key
        # A chat's prompt is its rendered template: /v1/completions counts the same tokens.
        for ask in (a for a in asks if a.is_chat):
            probe = Ask("probe", False, {"prompt": ask.prompt_text, "max_tokens": 1})
            counted = (await _whole(client, probe)).usage["prompt_tokens"]
            assert counted == alone[ask.name].usage["prompt_tokens"], ask.name
        stopping = _stop_asks(asks, alone)
        expected = {**alone, **{ask.name: answer for ask, answer in stopping}}
        asks += [ask for ask, _ in stopping]
        free: list[dict[str, Any]] = [
            {"prompt": "Free 0"},
            {"messages": [{"role": "user", "content": "Free 1"}]},
        ]
        unseeded = [  # their text is anyone's guess; their accounting is not
            Ask(f"unseeded-{i}", i == 1, {"max_tokens": 30, "temperature": 1.0, **part})
            for i, part in enumerate(free)
        ]
        before = await _metrics(client)
        leaving = [
            *(_leave_mid_stream(client, p) for p in ("interactive", "normal", "background")),
            _leave_before_first_token(client),
            _leave_before_first_token(client),
            _leave_at_once(served.http_url),
            _leave_at_once(served.http_url, stream=True),
        ]
        never_asked = [  # half a body: no request reaches the engine, so no abort
            _leave_at_once(served.http_url, cut=10),
            _leave_at_once(served.http_url, stream=True, cut=10),
        ]
        bad = [_bad(client, i) for i in range(len(BAD))]
        async with asyncio.TaskGroup() as group:  # one failure cancels the rest
            whole = [group.create_task(_whole(client, ask)) for ask in asks + unseeded]
            streamed = [group.create_task(_streamed(client, ask)) for ask in asks + unseeded]
            for other in (*leaving, *never_asked, *bad):
                group.create_task(other)
        answers_whole = [t.result() for t in whole]
        answers_streamed = [t.result() for t in streamed]

        for ask, by_whole, by_stream in zip(
            asks + unseeded, answers_whole, answers_streamed, strict=True
        ):
            _check_accounting(ask, by_whole)
            _check_accounting(ask, by_stream)
            if ask.name in expected:  # deterministic: as alone, streamed or not
                assert by_whole.key == expected[ask.name].key, (ask.name, by_whole)
                assert by_stream.key == expected[ask.name].key, (ask.name, by_stream)
            if not ask.body.get("stop"):  # each token's character came as it was made
                hidden = 1 if by_stream.finish_reason == "stop" else 0
                completion = by_stream.usage["completion_tokens"]
                assert by_stream.num_text_chunks == completion - hidden, ask.name

        after = await _settled(
            client, before.get("requests_finished_total:abort", 0) + len(leaving)
        )
        assert after["kv_cache_usage_ratio"] == 0.0, after  # every block back in the pool
        assert after["preemptions_total"] > before["preemptions_total"], "no preemption"
        assert after["prefix_cache_hits_total"] > before["prefix_cache_hits_total"]
        finished = {
            reason: after.get(f"requests_finished_total:{reason}", 0.0)
            - before.get(f"requests_finished_total:{reason}", 0.0)
            for reason in ("stop", "length", "abort", "error")
        }
        answers = answers_whole + answers_streamed
        assert finished == {
            "stop": sum(a.finish_reason == "stop" for a in answers),
            "length": sum(a.finish_reason == "length" for a in answers),
            "abort": len(leaving),
            "error": 0,
        }
        num_finished = after["e2e_request_latency_seconds_count"]
        num_finished -= before["e2e_request_latency_seconds_count"]
        assert num_finished == sum(finished.values())  # each request ended once
        tokens = sum(a.usage["completion_tokens"] for a in answers)
        assert after["tokens_total"] - before["tokens_total"] >= tokens  # + the leavers'

        fresh = await _streamed(client, asks[0])  # the server still answers, and the same
        assert fresh.key == expected[asks[0].name].key


async def test_sigterm_lets_open_streams_finish_then_exits_zero(served: ServedProcess) -> None:
    """docs/server.md: on SIGTERM every accepted request is answered, then exit 0; for
    generation the engine drains (each request in flight, running or waiting, runs to its
    end). Runs last: it stops the module's server."""
    parts: list[dict[str, Any]] = [
        {"prompt": "Still here 0", "temperature": 0},
        {"messages": [{"role": "user", "content": "Still 1"}], "seed": 5},
        {"prompt": "Still here 2", "seed": 6, "priority": "background"},
        {"messages": [{"role": "user", "content": "Still 3"}], "temperature": 0},
        *({"prompt": f"Queued {i}", "temperature": 0, "priority": "interactive"}
          for i in range(6)),
    ]  # fmt: skip
    asks = [  # long enough to be generating still when SIGTERM comes; more than max_num_seqs
        Ask(f"open-{i}", "messages" in part, {"max_tokens": 90, "ignore_eos": True, **part})
        for i, part in enumerate(parts)
    ]
    async with _client(served) as client:
        alone = {ask.name: await _whole(client, ask) for ask in asks}
        async with contextlib.AsyncExitStack() as stack:
            streams = []
            for i, ask in enumerate(asks):  # open; the first four have a token already
                response = await stack.enter_async_context(
                    client.stream("POST", ask.path, json=_body(ask, stream=True))
                )
                lines = aiter(response.aiter_lines())
                seen = [await anext(lines)]
                while i < 4 and not _has_text(seen[-1]):
                    seen.append(await anext(lines))
                streams.append((ask, response, seen, lines))
            whole = asyncio.create_task(_whole(client, asks[0]))  # a whole one in flight
            await _until_queued(client)
            stopped = asyncio.create_task(asyncio.to_thread(served.stop))  # SIGTERM, wait
            *staying, (_, leaving, _, _) = streams
            await leaving.aclose()  # a client that leaves during the drain
            for ask, _, seen, lines in staying:
                rest = [line async for line in lines]
                answer = _parse_events(ask, [line for line in seen + rest if line])
                assert answer.key == alone[ask.name].key, (ask.name, answer)
            assert (await whole).key == alone[asks[0].name].key
        assert await asyncio.wait_for(stopped, LIMIT_S) == 0, served.output()
    assert "stopped" in served.output() and "Traceback" not in served.output()


def _has_text(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    choice = orjson.loads(line[6:])["choices"][0]
    return bool(choice.get("text") or choice.get("delta", {}).get("content"))


async def _until_queued(client: httpx.AsyncClient) -> None:
    """Until the engine runs some requests and has more waiting."""
    for _ in range(int(LIMIT_S / 0.02)):
        metrics = await _metrics(client)
        if metrics["requests_running"] >= 1 and metrics["requests_waiting"] >= 1:
            return
        await asyncio.sleep(0.02)  # polling another process's state, not a timing check
    pytest.fail(f"the requests never reached the engine: {metrics}")
