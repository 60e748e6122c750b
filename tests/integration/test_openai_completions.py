"""`carpool serve` (built-in models) answering the official `openai` client on
/v1/completions and /v1/chat/completions with the random-weight tiny Llama: whole and
streamed answers, determinism, concurrency, a client that leaves mid-stream, /metrics; and
where an OpenAI or vLLM user would otherwise see carpool answer differently
(context-length errors, the neutral ``response_format``, seeds past int64)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServedProcess, start_served_process

MODEL = "tiny-random-llama"  # max_model_len 1024, byte tokenizer: one token a byte, BOS first


@pytest.fixture(scope="module")
def served(builtin_served: ServedProcess) -> ServedProcess:
    return builtin_served


@pytest.fixture
def client(openai_client: openai.OpenAI) -> openai.OpenAI:
    return openai_client


def _metrics(served: ServedProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://{served.http_url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("model") == MODEL
    }


def _finished(served: ServedProcess, reason: str) -> float:
    key = (
        "carpool_generation_requests_finished_total",
        (("finished_reason", reason), ("model", MODEL)),
    )
    return _metrics(served).get(key, 0.0)


def test_models_lists_the_generator_labelled_as_random_weights(client):
    models = {m.id: m for m in client.models.list().data}
    assert "random weights" in models[MODEL].owned_by


def test_vllm_probes_answer_as_vllm_answers_them(served):
    """What vLLM's clients ask before their first request: ``guidellm`` checks ``GET
    /health`` (200, empty body) and stops at anything else; ``/ping`` and ``/version``
    are vLLM's too (open without an API key: tests/integration/test_access.py)."""
    base = f"http://{served.http_url}"
    health = httpx.get(f"{base}/health")
    assert (health.status_code, health.content) == (200, b"")
    assert httpx.get(f"{base}/ping").status_code == 200
    assert httpx.post(f"{base}/ping").status_code == 200
    version = httpx.get(f"{base}/version")
    assert version.status_code == 200
    assert version.json()["version"] == httpx.get(f"{base}/v2").json()["version"]
    assert httpx.post(f"{base}/health").status_code == 405


def test_completion_answers_with_text_finish_reason_and_usage(client):
    response = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )  # ignore_eos: the random-weight model would otherwise end wherever it samples EOS
    choice = response.choices[0]
    assert response.object == "text_completion" and response.model == MODEL
    assert choice.finish_reason == "length"
    assert response.usage is not None
    assert response.usage.prompt_tokens == 6  # BOS and five bytes
    assert response.usage.completion_tokens == 8
    assert response.usage.total_tokens == 6 + response.usage.completion_tokens


def test_streamed_completion_matches_the_whole_one_and_reports_usage(client):
    kwargs = {"model": MODEL, "prompt": "Stream me", "max_tokens": 24, "temperature": 0}
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert len(chunks) >= 2
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_stream_ends_with_done_on_the_wire(served):
    body = {"model": MODEL, "prompt": "wire", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"http://{served.http_url}/v1/completions", json=body) as response:
        assert response.headers["content-type"] == "text/event-stream"
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])
    assert orjson.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_completion_streams_role_then_content_then_finish(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, stream=True
    )
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    assert whole.choices[0].message.role == "assistant"
    prompt = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"  # the fallback template
    assert whole.usage is not None and whole.usage.prompt_tokens == 1 + len(prompt.encode())


def test_greedy_is_deterministic(client):
    texts = {
        client.completions.create(model=MODEL, prompt="same", max_tokens=16, temperature=0)
        .choices[0]
        .text
        for _ in range(2)
    }
    assert len(texts) == 1


def test_seed_makes_sampling_repeatable(client):
    def sample(seed: int) -> str:
        response = client.completions.create(
            model=MODEL,
            prompt="dice",
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return response.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


async def test_concurrent_requests_all_complete(served):
    async with openai.AsyncOpenAI(
        base_url=f"http://{served.http_url}/v1", api_key="-", max_retries=0
    ) as client:

        async def one(i: int) -> int:
            response = await client.completions.create(
                model=MODEL, prompt=f"request {i}", max_tokens=20, extra_body={"ignore_eos": True}
            )
            assert response.choices[0].finish_reason == "length"
            assert response.usage is not None
            return response.usage.completion_tokens

        async def streamed(i: int) -> int:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": str(i)}],
                max_tokens=20,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return sum([1 async for chunk in stream if chunk.choices[0].finish_reason])

        counts = await asyncio.gather(
            *(one(i) for i in range(12)), *(streamed(i) for i in range(12))
        )
    assert counts == [20] * 12 + [1] * 12


def test_client_leaving_mid_stream_aborts_and_the_server_goes_on(served, client):
    aborted_before = _finished(served, "abort")
    body = {
        "model": MODEL,
        "prompt": "long",
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"http://{served.http_url}/v1/completions", json=body) as response:
        first = next(line for line in response.iter_lines() if line)
        assert first.startswith("data: {")
    deadline = time.monotonic() + 30  # polling the server's view, not asserting a duration
    while _finished(served, "abort") == aborted_before:
        assert time.monotonic() < deadline, "the server never aborted the request"
        time.sleep(0.05)
    response = client.completions.create(model=MODEL, prompt="still there?", max_tokens=4)
    assert response.choices[0].finish_reason in ("stop", "length")
    metrics = _metrics(served)
    assert metrics[("carpool_generation_requests_running", (("model", MODEL),))] == 0
    assert metrics[("carpool_generation_kv_cache_usage_ratio", (("model", MODEL),))] == 0


def _unread_stream(served: ServedProcess, document: dict[str, object]) -> socket.socket:
    """A connection that posted ``document`` to /v1/completions and, with a receive buffer
    of 1 KiB, reads nothing until the test does."""
    body = orjson.dumps(document)
    host, port = served.http_url.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.settimeout(60)
    try:
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
    except BaseException:
        sock.close()
        raise
    return sock


def test_a_stalled_stream_whose_client_half_closes_is_aborted(served, client):
    """Was: a client that never read its stream and then shut its side (SHUT_WR) was not
    taken as gone while answer bytes waited unread: its 16 choices generated to the end
    for nobody and the connection was held until the client closed it."""
    aborted_before = _finished(served, "abort")
    sock = _unread_stream(
        served,
        {"model": MODEL, "prompt": "hello", "max_tokens": 1000, "stream": True,
         "ignore_eos": True, "n": 16, "logprobs": 5},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30  # polling the server's view, not timing it
        while (
            _metrics(served).get(("carpool_generation_requests_running", (("model", MODEL),)), 0)
            < 16
        ):
            assert time.monotonic() < deadline, "the choices never ran"
            time.sleep(0.05)
        time.sleep(3.0)  # answers fill the socket's buffers, then the server's own
        sock.shutdown(socket.SHUT_WR)
        while _finished(served, "abort") < aborted_before + 16:
            assert time.monotonic() < deadline + 30, "the server never aborted the choices"
            time.sleep(0.05)
    finally:
        sock.close()
    response = client.completions.create(model=MODEL, prompt="still there?", max_tokens=4)
    assert response.choices[0].finish_reason in ("stop", "length")


def _gauge(served: ServedProcess, name: str) -> float:
    return _metrics(served).get((name, (("model", MODEL),)), 0.0)


def test_a_stalled_stream_is_held_then_finishes_whole_when_its_client_reads(served):
    """Back-pressure. Was: a client that stopped reading its stream left its choices
    generating on into the server's memory (some 310 MB for n=128 with 20 log-probabilities),
    outside every limit. Now each choice is held out of the steps once it is a few events
    ahead of its reader, and goes on when the reader does."""
    before = _gauge(served, "carpool_generation_tokens_total")
    sock = _unread_stream(
        served,
        {"model": MODEL, "prompt": "hello", "max_tokens": 500, "stream": True,
         "ignore_eos": True, "n": 16, "logprobs": 20,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60  # polling the server's view, not timing it
        while _gauge(served, "carpool_generation_requests_held") < 16:
            assert time.monotonic() < deadline, "the choices were never all held"
            time.sleep(0.1)
        generated = _gauge(served, "carpool_generation_tokens_total")
        time.sleep(1.0)
        assert _gauge(served, "carpool_generation_tokens_total") == generated
        # Held short of what was asked: the kernel's send buffer takes some 2,800 of these
        # events (Linux's default tcp_wmem max, 4 MiB), each choice's queue a few dozen.
        assert generated - before < 16 * 500
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        answer = b""
        while b"data: [DONE]" not in answer:  # now it reads, all of it
            data = sock.recv(1 << 16)
            assert data, "the server closed the stream before its end"
            answer += data
    finally:
        sock.close()
    events = [
        orjson.loads(line[len(b"data: ") :])
        for line in answer.split(b"\n")
        if line.startswith(b"data: {")
    ]
    finished = [c for e in events for c in e["choices"] if c.get("finish_reason")]
    assert sorted(c["index"] for c in finished) == list(range(16))
    assert {c["finish_reason"] for c in finished} == {"length"}
    assert events[-1]["usage"]["completion_tokens"] == 16 * 500
    assert _gauge(served, "carpool_generation_requests_held") == 0


def test_metrics_show_generation_in_vllm_vocabulary(served, client):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3)
    names = {name for name, _ in _metrics(served)}
    for expected in (
        "carpool_generation_requests_running",
        "carpool_generation_requests_waiting",
        "carpool_generation_kv_cache_usage_ratio",
        "carpool_generation_prefix_cache_queries_total",
        "carpool_generation_prefix_cache_hits_total",
        "carpool_generation_preemptions_total",
        "carpool_generation_prompt_tokens_total",
        "carpool_generation_tokens_total",
        "carpool_generation_time_to_first_token_seconds_count",
        "carpool_generation_inter_token_latency_seconds_bucket",
        "carpool_generation_e2e_request_latency_seconds_sum",
        "carpool_generation_request_queue_time_seconds_count",
    ):
        assert expected in names
    metrics = _metrics(served)
    assert metrics[("carpool_generation_prompt_tokens_total", (("model", MODEL),))] >= 9


def _prompt_logprobs_by_transformers(
    prompt_ids: list[int], tmp_path: Path
) -> tuple[list[float], list[int]]:
    """The built-in model's weights in transformers: each prompt token's log-probability
    after the ones before it, and the most likely token there."""
    import torch
    from transformers import LlamaForCausalLM

    from carpool.generation.tokenizer import ByteTokenizer
    from carpool.generation.weights import random_llama, save_hf_folder
    from carpool.server.generation import TINY_LLAMA

    config = {**TINY_LLAMA, "vocab_size": ByteTokenizer().vocab_size}
    save_hf_folder(random_llama(config, seed=0), tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt_ids])).logits[0, :-1].float().log_softmax(-1)
    own = logprobs.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist()
    return own, logprobs.argmax(-1).tolist()


def test_echo_with_logprobs_gives_the_prompt_tokens_log_probabilities_first_null(client, tmp_path):
    response = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=2, temperature=0, echo=True, logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    logprobs = response.choices[0].logprobs
    assert response.choices[0].text.startswith("Hello there")
    prompt_ids = [256, *b"Hello there"]  # BOS, then a token a byte
    tokens = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
    assert tokens[: len(prompt_ids)] == prompt_ids and len(tokens) == len(prompt_ids) + 2
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    own, best = _prompt_logprobs_by_transformers(prompt_ids, tmp_path)
    found = logprobs.token_logprobs[1 : len(prompt_ids)]
    assert found == pytest.approx(own, abs=1e-4)
    tops = logprobs.top_logprobs[1 : len(prompt_ids)]  # the token and the most likely
    assert all(f"token_id:{b}" in top for top, b in zip(tops, best, strict=True))
    assert logprobs.text_offset[0] == 0
    # Streamed: the first chunk holds the echo and the prompt's part.
    chunks = list(client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=2, temperature=0, echo=True, logprobs=1,
        stream=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    ))  # fmt: skip
    first = chunks[0].choices[0]
    assert first.text == "Hello there"
    assert first.logprobs.token_logprobs == [None, *logprobs.token_logprobs[1 : len(prompt_ids)]]


@pytest.mark.parametrize(
    ("extra", "param", "match"),
    [
        ({"best_of": 2}, "best_of", "best_of=2 is not supported"),
        ({"max_tokens": 5000}, "max_tokens", "lower max_tokens to 1022"),
        ({"temperature": -1}, "temperature", r"expected a number in \[0.0, 2.0\]"),
        ({"prompt": [1, 999]}, "prompt", r"prompt\[1\]=999"),
    ],
)
def test_unsupported_or_bad_fields_are_400s_naming_them(client, extra, param, match):
    kwargs = {"model": MODEL, "prompt": "x", **extra}
    with pytest.raises(openai.BadRequestError, match=match) as caught:
        client.completions.create(**kwargs)
    assert caught.value.param == param


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="generation model 'nope' not found"):
        client.completions.create(model="nope", prompt="x")


def _hf_folder(folder: Path) -> Path:
    """A random-weight Llama saved as a Hugging Face folder, with a byte-level BPE
    tokenizer trained here and a Jinja chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from carpool.generation.weights import random_llama, save_hf_folder

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["carpool shares the ride, señor"] * 10, trainer)
    config = {
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 256,
    }
    save_hf_folder(random_llama(config, seed=1), folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    special = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(orjson.dumps(special).decode())
    return folder


def test_a_configured_hugging_face_folder_serves_chat(start_server, tmp_path):
    folder = _hf_folder(tmp_path / "llama")
    served = start_server(
        f"""
models:
  - name: folder-llama
    kind: generation
    source: {folder}
    block_size: 8
    num_blocks: 64
    max_num_seqs: 4
    max_model_len: 128
"""
    )
    url = f"http://{served.http_url}/v1"
    with openai.OpenAI(base_url=url, api_key="-", max_retries=0) as client:
        (model,) = client.models.list().data
        assert (model.id, model.owned_by) == ("folder-llama", "carpool")
        messages = [{"role": "user", "content": "the ride"}]
        response = client.chat.completions.create(
            model="folder-llama", messages=messages, max_tokens=5, temperature=0
        )
        assert response.usage is not None and response.usage.prompt_tokens > 3
        with pytest.raises(openai.BadRequestError, match="at most 128 tokens"):
            client.completions.create(model="folder-llama", prompt="zqj " * 100)


# -- where an OpenAI or vLLM user would see carpool answer differently -----------------------


CONTEXT = "This model's maximum context length is 1024 tokens"


def _message(error: openai.APIStatusError) -> str:
    """The server's own message (the client's ``message`` prefixes "Error code: ...")."""
    assert isinstance(error.body, dict)
    return str(error.body["message"])


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


def test_max_tokens_that_this_prompt_takes_past_the_context_is_lowered_to_fit(client):
    # vLLM's answer (`vllm bench serve` sends such requests): the output stops where the
    # context ends; OpenAI's 400 is what --strict-openai gives (the next test).
    prompt = "a" * 1013  # BOS + 1013 bytes: 1014 tokens, room for 10 of the 1024
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=500, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == 1014
    assert response.usage.completion_tokens == 10


def test_strict_openai_refuses_max_tokens_past_the_context(tmp_path):
    server = start_served_process(None, tmp_path, args=["--strict-openai"])
    try:
        url = f"http://{server.http_url}/v1"
        with (
            openai.OpenAI(base_url=url, api_key="-", max_retries=0) as strict,
            pytest.raises(openai.BadRequestError) as caught,
        ):
            strict.completions.create(model=MODEL, prompt="a" * 1013, max_tokens=500)
    finally:
        assert server.stop() == 0, server.output()
    error = caught.value
    assert (error.param, error.code) == ("max_tokens", "context_length_exceeded")
    assert "lower max_tokens to 10 or less" in _message(error)


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
