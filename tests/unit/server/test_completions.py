"""/v1/completions and /v1/chat/completions through the ASGI app, no sockets: the
built-in random-weight tiny Llama (small settings), request checks, response and chunk
shapes, a client that disconnects mid-stream, sampling parameters as OpenAI and vLLM read
them, and the chat prompt built from a Hugging Face folder's template (checked against
transformers' ``apply_chat_template``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest

from carpool.generation.build import GenerationSettings
from carpool.server.app import KServeApp
from carpool.server.completions import prepare
from carpool.server.generation import GenerationService
from carpool.server.openai import BadParam
from carpool.server.repository import ModelRepository, ServedModel

from ..generation.hf_folders import (
    save_pretrained_folder,
    train_bpe,
    transformers_tokenizer,
    write_folder,
)
from .apps import Exchange, call, started_app
from .http.fakes import until

MODEL = "tiny"


@pytest.fixture
async def app() -> AsyncIterator[KServeApp]:
    async with tiny_generation_app() as app:
        yield app


@asynccontextmanager
async def tiny_generation_app() -> AsyncIterator[KServeApp]:
    """The app serving a started tiny random Llama named MODEL."""
    settings = GenerationSettings(num_blocks=64, max_model_len=128, max_num_seqs=8)
    service = GenerationService.tiny_random(MODEL, settings)
    async with started_app(ServedModel.of_generation(service)) as app:
        yield app


async def _post(app: KServeApp, path: str, leave_after: int | None = None, **body: Any) -> Exchange:
    document = orjson.dumps({"model": MODEL, **body})
    return await Exchange("POST", path, document, leave_after=leave_after).run(app)


async def test_completion_has_openai_shape(app):
    got = await _post(app, "/v1/completions", prompt="hi", max_tokens=5, ignore_eos=True)
    assert got.status == 200
    document = got.json()
    assert document["object"] == "text_completion" and document["id"].startswith("cmpl-")
    assert document["choices"][0]["finish_reason"] == "length"
    assert document["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


async def test_token_prompt_and_text_prompt_give_the_same_greedy_text(app):
    by_text = await _post(app, "/v1/completions", prompt="abc", max_tokens=6, temperature=0)
    by_ids = await _post(
        app, "/v1/completions", prompt=[256, 97, 98, 99], max_tokens=6, temperature=0
    )
    assert by_text.json()["choices"][0]["text"] == by_ids.json()["choices"][0]["text"]


async def test_chat_completion_has_a_message(app):
    got = await _post(
        app,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        ignore_eos=True,
    )
    document = got.json()
    assert document["object"] == "chat.completion"
    assert document["choices"][0]["message"]["role"] == "assistant"
    assert document["usage"]["completion_tokens"] == 3


async def test_stream_sends_chunks_usage_and_done(app):
    got = await _post(
        app,
        "/v1/completions",
        prompt="hi",
        max_tokens=4,
        stream=True,
        ignore_eos=True,
        stream_options={"include_usage": True},
    )
    assert got.status == 200 and got.headers[b"content-type"] == b"text/event-stream"
    events = got.events()
    assert events[-1] == "[DONE]"
    documents = [orjson.loads(e) for e in events[:-1]]
    assert documents[-1]["choices"] == [] and documents[-1]["usage"]["completion_tokens"] == 4
    assert all(d["usage"] is None for d in documents[:-1])
    assert documents[-2]["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_opens_with_the_assistant_role(app):
    got = await _post(
        app,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        stream=True,
    )
    first = orjson.loads(got.events()[0])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


async def test_a_chat_stream_sends_the_role_with_the_first_token_not_before(app, monkeypatch):
    """As vLLM sends it: the role chunk goes out with the choice's first event. Sent at
    once, it made ``vllm bench serve`` time carpool's first chat token before a 128-token
    prompt could have been prefilled (benchmarks/results/chat_ttft_role.json)."""
    from carpool.server import completions

    released = asyncio.Event()
    real = completions._choices

    def gated(call: Any) -> Any:
        async def events() -> Any:
            await released.wait()  # no token yet
            async for item in real(call):
                yield item

        return events()

    monkeypatch.setattr(completions, "_choices", gated)
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                         "max_tokens": 2, "stream": True, "ignore_eos": True, "n": 2})  # fmt: skip
    chunks = completions.stream(await prepare(app.repository, body, is_chat=True))
    first = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0.05)
    assert not first.done()  # nothing is sent before a token is
    released.set()
    events = [await first] + [chunk async for chunk in chunks]
    documents = [orjson.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert events[-1] == b"data: [DONE]\n\n"
    for index in (0, 1):  # each choice: its role first, then its tokens
        deltas = [d["choices"][0]["delta"] for d in documents if d["choices"][0]["index"] == index]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert all("role" not in delta for delta in deltas[1:]) and len(deltas) >= 2


async def test_a_client_leaving_mid_stream_aborts_its_request(app):
    got = await _post(
        app,
        "/v1/completions",
        leave_after=2,
        prompt="hi",
        max_tokens=100,
        stream=True,
        ignore_eos=True,
    )
    assert b"[DONE]" not in b"".join(got.chunks)
    engine = app.repository.generation_services()[MODEL].engine
    # The scheduler forgets it before the engine's next step.
    await until(lambda: engine.snapshot().scheduler.num_running == 0)
    snapshot = engine.snapshot()
    assert snapshot.finished == {"abort": 1}
    assert snapshot.scheduler.num_running == 0 and snapshot.scheduler.kv_cache_usage == 0


async def test_errors_have_openai_shape(app):
    got = await _post(app, "/v1/completions", prompt="x", n=0)
    assert got.status == 400
    error = got.json()["error"]
    assert error["param"] == "n" and error["type"] == "invalid_request_error"
    missing = await _post(app, "/v1/completions", prompt="x", model="other")
    assert missing.status == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_models_lists_the_generation_model(app):
    exchange = Exchange("GET", "/v1/models")
    await app(exchange.scope, exchange.receive, exchange.send)
    (model,) = exchange.json()["data"]
    assert model["id"] == MODEL and "random weights" in model["owned_by"]


async def _prepare(app: KServeApp, is_chat: bool = False, **body: Any):
    return await prepare(app.repository, orjson.dumps({"model": MODEL, **body}), is_chat=is_chat)


async def test_defaults_are_openai_s(app):
    call = await _prepare(app, prompt="abc")
    assert call.sampling.max_tokens == 16 and call.sampling.temperature == 1.0
    assert not call.is_stream and call.priority is None
    chat = await _prepare(app, is_chat=True, messages=[{"role": "user", "content": "a"}])
    assert chat.sampling.max_tokens == 128 - len(chat.prompt_ids)  # the rest of the context


async def test_extensions_and_stop_forms_are_read(app):
    call = await _prepare(
        app,
        prompt=["abc"],
        top_k=5,
        seed=3,
        stop="\n",
        priority="interactive",
        stop_token_ids=[10],
        max_tokens=2,
    )
    s = call.sampling
    assert (s.top_k, s.seed, s.stop, s.stop_token_ids, s.max_tokens) == (5, 3, ("\n",), (10,), 2)
    assert call.priority == "interactive"
    chat = await _prepare(
        app, is_chat=True, messages=[{"role": "user", "content": "a"}], max_completion_tokens=7
    )
    assert chat.sampling.max_tokens == 7


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"prompt": "x", "logprobs": 21}, "logprobs", r"in \[0, 20\]"),
        ({"prompt": "x", "best_of": 2}, "best_of", "not supported"),
        ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty", r"\[-2.0, 2.0\]"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", r"\(0.0, inf\]"),
        ({"prompt": "x", "min_tokens": 17}, "min_tokens", r"in \[0, 16\]"),
        ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias", "token id in"),
        ({"prompt": "x", "logit_bias": {"\u00b2": 1}}, "logit_bias", "token id in"),  # "²"
        ({"prompt": "x", "logit_bias": {"--5": 1}}, "logit_bias", "token id in"),
        ({"prompt": "x", "logit_bias": {"9" * 5000: 1}}, "logit_bias", "token id in"),
        ({"prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias", "expected a number"),
        ({"prompt": "x", "n": 129}, "n", r"in \[1, 128\]"),
        ({"prompt": ["a", "b"]}, "prompt", "holds 2 prompts"),
        ({"prompt": ""}, "prompt", "empty string"),
        ({"prompt": {"a": 1}}, "prompt", "expected a string or a list of token ids"),
        ({"prompt": "x", "stop": ["a", 1]}, "stop", "non-empty strings"),
        ({"prompt": "x", "stop": list("abcde")}, "stop", "at most 4"),
        ({"prompt": "x", "top_p": 0}, "top_p", r"\(0.0, 1.0\]"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"prompt": "x", "priority": 1}, "priority", "class name"),
        ({"prompt": "x", "priority": "vip"}, "priority", "one of"),
        ({"prompt": "x", "max_tokens": 200}, "max_tokens", "lower max_tokens to 126"),
        ({"prompt": "x", "stream": "yes"}, "stream", "true or false"),
        ({"prompt": "x" * 200}, "prompt", "at most 128 tokens"),
    ],
)
async def test_bad_completion_requests_name_the_field(app, body, param, match):
    with pytest.raises(BadParam, match=match) as caught:
        await _prepare(app, **body)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role='robot'"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools="),
        ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo=True"),
    ],
)
async def test_bad_chat_requests_name_the_field(app, body, match):
    with pytest.raises(BadParam, match=match):
        await _prepare(app, is_chat=True, **body)


class _BracketTokenizer:
    """A tokenizer of its own (not carpool's ByteTokenizer): bytes as ids, a template that
    brackets each message, and BOS added by encoding, as the protocol lets it say."""

    def __init__(self) -> None:
        from carpool.generation.tokenizer import ByteTokenizer

        self._bytes = ByteTokenizer()
        self.vocab_size = self._bytes.vocab_size
        self.bos_token_id = self._bytes.bos_token_id
        self.eos_token_ids = self._bytes.eos_token_ids
        self.bos_token = self.eos_token = ""
        self.chat_template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
        self.chat_adds_special_tokens = True

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._bytes.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Any) -> str:
        return self._bytes.decode(token_ids)


async def test_chat_uses_the_tokenizers_template_and_its_word_on_bos(app):
    service = app.repository.generation_services()[MODEL]
    service.tokenizer = _BracketTokenizer()
    chat = await _prepare(app, is_chat=True, messages=[{"role": "user", "content": "hi"}])
    assert chat.prompt_ids == [256, *b"[hi]"]
    service.tokenizer.chat_adds_special_tokens = False  # a template that writes BOS itself
    chat = await _prepare(app, is_chat=True, messages=[{"role": "user", "content": "hi"}])
    assert chat.prompt_ids == list(b"[hi]")
    service.tokenizer.chat_template = None  # no template: refused, whatever the tokenizer
    with pytest.raises(BadParam, match="has no chat template"):
        await _prepare(app, is_chat=True, messages=[{"role": "user", "content": "hi"}])


# -- sampling parameters as OpenAI and vLLM read them --------------------------------------
# Each test states what OpenAI's API (or vLLM's server) does.


async def test_a_top_k_past_int64_is_the_whole_vocabulary_and_harms_no_neighbour(app):
    """Was: top_k was only checked >= 0; 2**63 reached torch.tensor in the sampler, whose
    overflow failed the whole engine step: every request batched with it got a 500. A
    top_k over the vocabulary now means all of it (as vLLM clamps it)."""
    innocent, big = await asyncio.gather(
        call(
            app, "/v1/completions", model=MODEL, prompt="innocent", max_tokens=20,
            temperature=0, ignore_eos=True,
        ),
        call(
            app, "/v1/completions", model=MODEL, prompt="evil", max_tokens=20, top_k=2**63,
            ignore_eos=True,
        ),
    )  # fmt: skip
    assert innocent.status == 200, innocent.json()
    assert big.status == 200, big.json()
    assert big.json()["usage"]["completion_tokens"] == 20


async def test_completion_logprobs_zero_is_not_silently_dropped(app):
    """OpenAI: logprobs=0 still returns the sampled token's logprob ("up to logprobs+1
    elements"). Was: 0 == False slipped through and the answer carried "logprobs": null."""
    got = await call(
        app, "/v1/completions", model=MODEL, prompt="hi", max_tokens=2, logprobs=0, ignore_eos=True
    )
    assert got.status == 200, got.json()
    logprobs = got.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 2 and all(v <= 0 for v in logprobs["token_logprobs"])
    assert [len(top) for top in logprobs["top_logprobs"]] == [1, 1]  # the sampled token only


async def test_invalid_stop_token_ids_name_the_param(app):
    got = await call(app, "/v1/completions", model=MODEL, prompt="hi", stop_token_ids=[9999])
    assert got.status == 400
    assert got.json()["error"]["param"] == "stop_token_ids", got.json()


async def test_chat_null_max_completion_tokens_falls_back_to_max_tokens(app):
    """The openai client sends null for max_completion_tokens=None; vLLM then uses
    max_tokens (max_completion_tokens or max_tokens). carpool ignores max_tokens and
    generates to the end of the context."""
    got = await call(
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
    greedy = await call(app, "/v1/completions", **body, temperature=0)
    tiny = await call(app, "/v1/completions", **body, temperature=1e-40)
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


async def test_top_k_minus_one_means_off_as_in_vllm(app):
    """vLLM's documented value for 'top_k off' is -1 (0 too); carpool refused -1."""
    got = await call(app, "/v1/completions", model=MODEL, prompt="hi", max_tokens=2, top_k=-1)
    assert got.status == 200, got.json()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_vllms_default_priority_zero_is_the_default_class(app, path):
    """vLLM's requests carry an integer priority, 0 by default (its clients may send it
    always); carpool's priority is a class name. 0 is the default class; other integers
    and unknown names stay a 400 naming priority."""
    prompt = {"prompt": "hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]
    }  # fmt: skip
    got = await call(app, path, model=MODEL, max_tokens=2, priority=0, **prompt)
    assert got.status == 200, got.json()
    for bad in (1, -1, 0.0, False, "vip"):
        got = await call(app, path, model=MODEL, max_tokens=2, priority=bad, **prompt)
        assert got.status == 400 and got.json()["error"]["param"] == "priority", bad


# -- the chat prompt from a Hugging Face folder ------------------------------------------


@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pretrained_folder(tmp_path_factory.mktemp("saved"))


def _model_folder(folder: Path, bpe: Any) -> Path:
    from carpool.generation.weights import random_llama, save_hf_folder

    config = {
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": bpe.get_vocab_size(),
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 128,
    }
    return save_hf_folder(random_llama(config, seed=0), folder)


async def _chat_prompt_ids(folder: Path, messages: list[dict[str, Any]]) -> list[int]:
    settings = GenerationSettings(block_size=8, num_blocks=16, max_num_seqs=1, max_model_len=64)
    service = GenerationService.from_folder("m", folder, settings)
    repository = ModelRepository([ServedModel.of_generation(service)])
    body = orjson.dumps({"model": "m", "messages": messages, "max_tokens": 1})
    call = await prepare(repository, body, is_chat=True)
    return call.prompt_ids


async def test_chat_prompt_has_the_templates_bos_once(saved_folder, tmp_path):
    folder = _model_folder(tmp_path, train_bpe())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes((saved_folder / name).read_bytes())
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello world"}]}]
    ids = await _chat_prompt_ids(folder, messages)
    expected = transformers_tokenizer(folder).apply_chat_template(
        [{"role": "user", "content": "Hello world"}], add_generation_prompt=True
    )["input_ids"]
    assert ids == expected
    assert ids.count(0) == 1 and ids[0] == 0


async def test_chat_with_a_folder_without_template_is_a_400(tmp_path):
    """As vLLM (transformers >= 4.44 has no default template): a clear 400 naming
    ``messages``, not a prompt in a format the model never saw."""
    bpe = train_bpe()
    folder = _model_folder(tmp_path, bpe)
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    write_folder(folder, bpe, config)
    with pytest.raises(BadParam, match="no chat template") as refused:
        await _chat_prompt_ids(folder, [{"role": "user", "content": "Hi"}])
    assert refused.value.param == "messages"


# -- the fields the ecosystem sends ---------------------------------------------------------


async def test_sampling_extensions_reach_the_sampling_params(app):
    got = await _prepare(
        app, prompt="x", repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=1.0,
        min_p=0.1, min_tokens=3, logit_bias={"7": 150, "9": -2}, logprobs=3,
        include_stop_str_in_output=True, skip_special_tokens=False, n=2, seed=5,
    )  # fmt: skip
    s = got.sampling
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.2, -0.5, 1.0)
    assert (s.min_p, s.min_tokens, s.logprobs) == (0.1, 3, 3)
    assert s.logit_bias == ((7, 100.0), (9, -2.0))  # clamped to OpenAI's [-100, 100]
    assert s.include_stop_str_in_output and not s.skip_special_tokens
    assert got.n == 2 and [got.choice_sampling(i).seed for i in range(2)] == [5, 6]
    chat = await _prepare(
        app, is_chat=True, messages=[{"role": "user", "content": "a"}], logprobs=True,
        top_logprobs=4,
    )  # fmt: skip
    assert chat.sampling.logprobs == 4
    with pytest.raises(BadParam, match="needs logprobs: true"):
        await _prepare(
            app, is_chat=True, messages=[{"role": "user", "content": "a"}], top_logprobs=2
        )


async def test_n_choices_each_have_an_index_and_usage_counts_all(app):
    got = await call(
        app, "/v1/completions", model=MODEL, prompt="hi", max_tokens=4, n=3, seed=1,
        ignore_eos=True, echo=True,
    )  # fmt: skip
    assert got.status == 200, got.json()
    document = got.json()
    assert [c["index"] for c in document["choices"]] == [0, 1, 2]
    assert all(c["text"].startswith("hi") for c in document["choices"])  # echo
    assert document["usage"]["completion_tokens"] == 12
    assert document["usage"]["prompt_tokens"] == 3  # counted once
    texts = {c["text"] for c in document["choices"]}
    assert len(texts) > 1  # seeds 1, 2, 3: not three copies of one sample


async def test_a_streamed_chat_carries_logprobs_per_chunk(app):
    got = await _post(
        app, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
        max_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=2, stream=True,
    )  # fmt: skip
    chunks = _chunks(got)
    entries = [
        entry for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
        for entry in c["choices"][0]["logprobs"]["content"]
    ]  # fmt: skip
    assert len(entries) == 5
    for entry in entries:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert entry["logprob"] <= entry["top_logprobs"][0]["logprob"] + 1e-6


async def test_min_tokens_holds_back_eos(app):
    """vLLM: min_tokens keeps EOS (and stop_token_ids) from being sampled until that many
    tokens are out. EOS (257) is made the certain pick by logit_bias."""
    body = {"prompt": "hi", "max_tokens": 10, "temperature": 0, "logit_bias": {"257": 100}}
    at_once = (await _post(app, "/v1/completions", **body)).json()
    assert at_once["usage"]["completion_tokens"] == 1
    held = (await _post(app, "/v1/completions", min_tokens=3, **body)).json()
    assert held["usage"]["completion_tokens"] == 4  # three held, then EOS
    assert held["choices"][0]["finish_reason"] == "stop"


async def test_streamed_choices_each_finish_and_usage_counts_all(app):
    got = await _post(
        app, "/v1/completions", prompt="hi", max_tokens=3, n=2, ignore_eos=True, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = _chunks(got)
    finished = [c["choices"][0] for c in chunks if c["choices"]]
    finished = [choice["index"] for choice in finished if choice["finish_reason"]]
    assert sorted(finished) == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def _chunks(got: Exchange) -> list[Any]:
    """The JSON chunks of a streamed answer (``[DONE]`` left out)."""
    return [orjson.loads(event) for event in got.events() if event != "[DONE]"]


async def test_add_special_tokens_and_tokens_as_ids_are_vllm_s(app):
    plain = await _prepare(app, prompt="ab")
    assert plain.prompt_ids == [256, *b"ab"]  # BOS added by default
    bare = await _prepare(app, prompt="ab", add_special_tokens=False)
    assert bare.prompt_ids == list(b"ab")
    # ignore_eos: sampled at temperature 1 without a seed, the random model's first
    # token was once its EOS (257), and the answer then held one token.
    got = await call(
        app, "/v1/completions", model=MODEL, prompt="hi", max_tokens=2, logprobs=1,
        return_tokens_as_token_ids=True, ignore_eos=True,
    )  # fmt: skip
    tokens = got.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 2 and all(t.startswith("token_id:") for t in tokens)
