"""The request fields the LLM ecosystem sends, against `carpool serve` (built-in models):
the exact bodies `vllm bench serve` posts, parsed as it parses the stream; the official
`openai` openai_client with n > 1, logprobs (whole and streamed) and vLLM's sampling extensions;
a field no one defines, ignored and counted in /metrics, or refused under --strict-openai."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServedProcess, start_served_process

MODEL = "tiny-random-llama"  # byte tokenizer: one token a byte, BOS first


def _bench_stream(url: str, payload: dict[str, Any], *, is_chat: bool) -> tuple[str, int, int]:
    """What `vllm bench serve` reads of a stream (vllm/benchmarks/lib/
    endpoint_request_func.py): each ``data:`` message, the text of choices[0] (chat: its
    delta's content) while choices is non-empty, else usage's completion_tokens.
    Returns the text, the count of chunks with choices, and completion_tokens."""
    text, num_chunks, completion_tokens = "", 0, -1
    with httpx.stream("POST", url, json=payload, timeout=60) as response:
        assert response.status_code == 200, response.read()
        body = response.read().decode("utf-8")
    for message in (m.strip() for m in body.split("\n\n")):
        if not message or message.startswith(":"):
            continue
        chunk = message.removeprefix("data: ")
        if chunk == "[DONE]":
            continue
        data = json.loads(chunk)
        if choices := data.get("choices"):
            num_chunks += 1
            part = choices[0]["delta"].get("content") if is_chat else choices[0].get("text")
            text += part or ""
        elif usage := data.get("usage"):
            completion_tokens = usage.get("completion_tokens")
    return text, num_chunks, completion_tokens


def test_vllm_bench_serve_completions_body_streams_as_it_parses(builtin_served):
    payload = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "repetition_penalty": 1.0,
        "max_tokens": 12,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # --ignore-eos
    }
    text, num_chunks, completion_tokens = _bench_stream(
        f"http://{builtin_served.http_url}/v1/completions", payload, is_chat=False
    )
    assert completion_tokens == 12 and num_chunks >= 1 and text


def test_vllm_bench_serve_chat_body_streams_as_it_parses(builtin_served):
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
        "max_completion_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    _, num_chunks, completion_tokens = _bench_stream(
        f"http://{builtin_served.http_url}/v1/chat/completions", payload, is_chat=True
    )
    assert completion_tokens == 9 and num_chunks >= 2  # the role chunk, then the text


def test_n_choices_from_the_openai_client(openai_client):
    response = openai_client.completions.create(
        model=MODEL, prompt="Once", max_tokens=6, n=3, seed=11, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert response.usage is not None and response.usage.completion_tokens == 18
    again = openai_client.completions.create(
        model=MODEL, prompt="Once", max_tokens=6, n=3, seed=11, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in again.choices] == [c.text for c in response.choices]  # seeded
    chat = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in chat.choices)


def test_completion_logprobs_from_the_openai_client(openai_client):
    response = openai_client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, logprobs=3, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs or []) == 5
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs or [], logprobs.top_logprobs or [], strict=True
    ):
        assert max(top.values()) == value  # greedy: the sampled token is the most likely
        assert token in top
        assert 1 <= len(top) <= 4  # 3 and the sampled one (bytes that decode alike share one)
    offsets = logprobs.text_offset or []
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_chat_logprobs_whole_and_streamed_agree(openai_client):
    kwargs: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "Hey"}], "max_tokens": 6,
        "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    whole = openai_client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert content is not None and len(content) == 6
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    streamed = [
        entry
        for chunk in openai_client.chat.completions.create(**kwargs, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None and choice.logprobs.content
        for entry in choice.logprobs.content
    ]
    # The second request finds the first's prompt blocks cached and attends over them apart
    # from its own tokens (merged by log-sum-exp): the same values, rounded in other bits.
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], rel=1e-5)


def test_vllm_sampling_extensions_change_the_answer(openai_client):
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 8, "temperature": 0}
    forced = openai_client.completions.create(**base, logit_bias={"65": 100})  # byte "A"
    assert forced.choices[0].text == "A" * 8
    stops: dict[str, Any] = {"stop_token_ids": [65], "min_tokens": 3, "ignore_eos": True}
    for include in (True, False):
        stopped = openai_client.completions.create(
            **base, logit_bias={"65": 100},
            extra_body={**stops, "include_stop_str_in_output": include},
        )  # fmt: skip
        text = stopped.choices[0].text
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.usage is not None and stopped.usage.completion_tokens == 4  # 3 held, "A"
        assert text.endswith("A") == include and "A" not in text[:-1]


def _ignored(builtin_served: ServedProcess) -> dict[str, float]:
    text = httpx.get(f"http://{builtin_served.http_url}/metrics").text
    return {
        s.labels["field"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "carpool_openai_ignored_fields_total"
    }


def test_a_field_no_one_defines_is_ignored_and_counted(openai_client, builtin_served):
    before = _ignored(builtin_served).get("carpool_test_knob", 0.0)
    for _ in range(2):
        response = openai_client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"carpool_test_knob": 3}
        )
        assert response.choices[0].finish_reason in ("stop", "length")
    assert _ignored(builtin_served)["carpool_test_knob"] == before + 2
    assert builtin_served.output().count("'carpool_test_knob'") == 1  # warned once


@pytest.mark.parametrize("workers", ["1", "2"])  # 2: the workers forward to the engine
def test_strict_openai_refuses_a_field_no_one_defines(tmp_path, workers):
    server = start_served_process(None, tmp_path, args=["--strict-openai", "--workers", workers])
    try:
        with openai.OpenAI(
            base_url=f"http://{server.http_url}/v1", api_key="-", max_retries=0
        ) as client:
            with pytest.raises(openai.BadRequestError, match="--strict-openai") as caught:
                client.completions.create(
                    model=MODEL, prompt="x", max_tokens=2, extra_body={"carpool_test_knob": 3}
                )
            assert caught.value.param == "carpool_test_knob"
            ok = client.completions.create(  # what vLLM defines still passes
                model=MODEL, prompt="x", max_tokens=2, extra_body={"repetition_penalty": 1.0}
            )
            assert ok.choices
    finally:
        assert server.stop() == 0, server.output()
