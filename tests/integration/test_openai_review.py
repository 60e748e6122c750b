"""`carpool serve` (built-in models) against the official `openai` client, where an
OpenAI or vLLM user would see carpool answer differently: context-length errors, the
neutral `response_format`, seeds past int64."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from .conftest import ServedProcess, start_served_process

MODEL = "tiny-random-llama"  # max_model_len 1024, byte tokenizer: one token a byte, BOS first
CONTEXT = "This model's maximum context length is 1024 tokens"


def _message(error: openai.APIStatusError) -> str:
    """The server's own message (the client's ``message`` prefixes "Error code: ...")."""
    assert isinstance(error.body, dict)
    return str(error.body["message"])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    server = start_served_process(None, tmp_path_factory.mktemp("openai_review"))
    yield server
    assert server.stop() == 0, server.output()


@pytest.fixture
def client(served: ServedProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{served.http_url}/v1", api_key="-", max_retries=0) as c:
        yield c


def test_chat_messages_past_the_context_are_a_context_length_error_naming_messages(client):
    # OpenAI: param "messages", code "context_length_exceeded"; OpenAI and vLLM both open
    # the message with "This model's maximum context length is N tokens", which LiteLLM
    # and others match to tell a context overflow from other 400s.
    messages = [{"role": "user", "content": "a" * 1100}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages)
    error = caught.value
    assert (error.param, error.code) == ("messages", "context_length_exceeded")
    assert _message(error).startswith(CONTEXT)


def test_a_completion_prompt_past_the_context_is_a_context_length_error(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="a" * 1100)
    error = caught.value
    assert (error.param, error.code) == ("prompt", "context_length_exceeded")
    assert _message(error).startswith(CONTEXT)
    assert "1101 tokens" in _message(error)  # BOS and 1100 bytes


def test_max_tokens_past_the_context_names_both_lengths_as_vllm_does(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    error = caught.value
    assert (error.param, error.code) == ("max_tokens", "context_length_exceeded")
    assert _message(error).startswith(CONTEXT)
    assert "you requested 5002 tokens (2 in the prompt, 5000 in the completion)" in _message(error)
    assert "lower max_tokens to 1022 or less" in _message(error)


def test_chat_max_completion_tokens_past_the_context_names_the_messages(client):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5000)
    error = caught.value
    assert (error.param, error.code) == ("max_completion_tokens", "context_length_exceeded")
    assert _message(error).startswith(CONTEXT) and "in the messages, 5000 in the" in _message(error)


def test_response_format_text_is_accepted_as_openai_and_vllm_accept_it(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        response_format={"type": "text"},
    )
    assert response.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_a_structured_response_format_is_refused_as_unsupported_not_unknown(client, kind):
    response_format = {"type": kind}
    if kind == "json_schema":
        response_format["json_schema"] = {"name": "x", "schema": {"type": "object"}}
    with pytest.raises(openai.BadRequestError, match="not supported by carpool") as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            response_format=response_format,  # type: ignore[arg-type]
        )
    assert caught.value.param == "response_format"
    assert "unknown field" not in _message(caught.value)


def test_a_seed_past_int64_is_refused_not_wrapped_onto_another_seed(client):
    # vLLM bounds seed to int64 (a 400 past it); torch wraps 2**63 onto -2**63, so two
    # different seeds would draw the same sample.
    with pytest.raises(openai.BadRequestError, match=r"seed=9223372036854775808") as caught:
        client.completions.create(model=MODEL, prompt="dice", max_tokens=2, seed=2**63)
    assert caught.value.param == "seed"
    assert str(2**63 - 1) in _message(caught.value)
