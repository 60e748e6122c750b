"""The KServe v2 faces (stats, config, policy, metadata) of the two model kinds that are
not plain batched models, on `carpool serve` with its built-in models: the generation
model ``tiny-random-llama``, whose engine schedules its requests, and the embeddings model
``all-MiniLM-L6-v2``, which queues each text as its own request. Read as a Triton user
reads them: through ``tritonclient`` (HTTP and gRPC), ``openai`` and ``/metrics``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from .conftest import ServedProcess, start_served_process, wait_until

GENERATION = "tiny-random-llama"
EMBEDDINGS = "all-MiniLM-L6-v2"
MAX_NUM_SEQS = 64  # GenerationSettings' default, which the built-in model runs with


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    folder = tmp_path_factory.mktemp("serve-kinds")
    process = start_served_process(None, folder, grpc=True, args=["--allow-policy-updates"])
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture
def http(served: ServedProcess) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(served.http_url)
    yield client
    client.close()


@pytest.fixture
def grpc(served: ServedProcess) -> Iterator[grpcclient.InferenceServerClient]:
    assert served.grpc_url is not None
    client = grpcclient.InferenceServerClient(served.grpc_url)
    yield client
    client.close()


def _stats(client: httpclient.InferenceServerClient, model: str) -> dict[str, Any]:
    (stats,) = client.get_inference_statistics(model)["model_stats"]
    return dict(stats)


def _count(stats: dict[str, Any], name: str) -> int:
    return int(stats["inference_stats"][name].get("count", 0))


def _ns(stats: dict[str, Any], name: str) -> int:
    return int(stats["inference_stats"][name].get("ns", 0))


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"http://{url}/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def _infer_text(client: httpclient.InferenceServerClient, model: str, texts: list[bytes]) -> Any:
    """An infer built from the model's metadata, as a Triton user writes it."""
    (spec,) = client.get_model_metadata(model)["inputs"]
    shape = [len(texts) if d == -1 else d for d in spec["shape"]]
    tensor = httpclient.InferInput(spec["name"], shape, spec["datatype"])
    tensor.set_data_from_numpy(np.array(texts, dtype=np.object_))
    return client.infer(model, [tensor])


# -- the generation model ---------------------------------------------------------------


def test_generation_stats_count_the_requests_its_engine_served(
    served: ServedProcess,
    http: httpclient.InferenceServerClient,
    grpc: grpcclient.InferenceServerClient,
) -> None:
    """Were all zeros: the model's batcher slot, which stats read, never sees a request."""
    before = _stats(http, GENERATION)
    result = _infer_text(http, GENERATION, [b"hello", b"world"])  # two rows: two sequences
    assert result.as_numpy("TEXT").shape == (2,)
    client = openai.OpenAI(base_url=f"http://{served.http_url}/v1", api_key="unused")
    completion = client.completions.create(
        model=GENERATION, prompt="hi", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 5
    after = _stats(http, GENERATION)

    assert after["inference_count"] - before["inference_count"] == 3
    for name in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert _count(after, name) - _count(before, name) == 3, name
    assert _count(after, "fail") == _count(before, "fail")
    # Each request: its queue and the rest of its time add up to its latency.
    assert _ns(after, "success") > _ns(before, "success")
    gained = {n: _ns(after, n) - _ns(before, n) for n in ("success", "queue", "compute_infer")}
    assert abs(gained["success"] - gained["queue"] - gained["compute_infer"]) <= 2, gained
    # Executions are forward passes: the completion's 5 tokens took 5 of them.
    assert after["execution_count"] - before["execution_count"] >= 5
    batch_stats = after["batch_stats"]
    assert sum(int(b["compute_infer"]["count"]) for b in batch_stats) == after["execution_count"]
    assert all(1 <= int(b["batch_size"]) <= MAX_NUM_SEQS for b in batch_stats)
    assert int(after["last_inference"]) > 0
    # /metrics counts the same requests as finished by stop or length.
    finished = sum(
        _metric(served.http_url, "carpool_generation_requests_finished_total",
                model=GENERATION, finished_reason=reason)
        for reason in ("stop", "length")
    )  # fmt: skip
    assert finished == after["inference_count"]
    # gRPC ModelStatistics carries the same numbers.
    (over_grpc,) = grpc.get_inference_statistics(GENERATION, as_json=True)["model_stats"]
    assert int(over_grpc["inference_count"]) == after["inference_count"]
    assert int(over_grpc["execution_count"]) == after["execution_count"]


def test_generation_stats_count_a_request_the_client_left_as_failed(
    served: ServedProcess, http: httpclient.InferenceServerClient
) -> None:
    before = _stats(http, GENERATION)
    client = openai.OpenAI(base_url=f"http://{served.http_url}/v1", api_key="unused")
    stream = client.completions.create(
        model=GENERATION,
        prompt="go on",
        max_tokens=900,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # it runs: now leave it
    stream.close()
    wait_until(
        lambda: _count(_stats(http, GENERATION), "fail") == _count(before, "fail") + 1,
        "the aborted request counted as failed",
    )
    after = _stats(http, GENERATION)
    assert after["inference_count"] == before["inference_count"]
    assert _ns(after, "fail") > _ns(before, "fail")


def test_generation_policy_get_is_refused_as_post_is_naming_the_engine_settings(
    served: ServedProcess,
) -> None:
    """GET answered a batch policy (32 within 5 ms) that its engine does not schedule by."""
    path = f"http://{served.http_url}/v2/models/{GENERATION}/policy"
    got = httpx.get(path)
    posted = httpx.post(path, json={"max_batch_size": 4})
    assert got.status_code == posted.status_code == 400
    assert got.json() == posted.json()
    message = got.json()["error"]
    assert "no batch policy" in message and f"max_num_seqs={MAX_NUM_SEQS}" in message
    assert "max_num_batched_tokens=" in message and "num_blocks=512" in message, message
    # The embeddings model still has one, and it validates a change.
    embeddings = f"http://{served.http_url}/v2/models/{EMBEDDINGS}/policy"
    policy = httpx.get(embeddings).json()
    assert (policy["max_batch_size"], policy["max_batch_tokens"]) == (64, 4096)
    refused = httpx.post(embeddings, json={"max_batch_tokens": 100})
    assert refused.status_code == 400 and "max_batch_tokens" in refused.json()["error"]
    assert httpx.get(embeddings).json() == policy


def test_generation_config_describes_its_engine_not_a_dynamic_batcher(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    """Was ``max_batch_size`` 32 and ``dynamic_batching`` with a 5 ms delay: the unused
    batcher slot's default policy."""
    config = http.get_model_config(GENERATION)
    assert config["max_batch_size"] == MAX_NUM_SEQS
    assert "dynamic_batching" not in config
    assert config["instance_group"] == [{"count": 1, "kind": "KIND_CPU"}]
    assert [(t["name"], t["data_type"]) for t in config["input"]] == [("TEXT", "TYPE_STRING")]
    assert [(t["name"], t["data_type"]) for t in config["output"]] == [("TEXT", "TYPE_STRING")]
    over_grpc = grpc.get_model_config(GENERATION, as_json=True)["config"]
    assert int(over_grpc["max_batch_size"]) == MAX_NUM_SEQS
    assert "dynamic_batching" not in over_grpc
    # Which kernels its steps run, on both faces (Triton's string parameters).
    assert config["parameters"]["decode_attention"]["string_value"] in ("kernel", "torch")
    assert config["parameters"]["linear"]["string_value"] in (
        "carpool-packed",
        "onednn-prepacked",
        "aten-linear",
    )
    assert config["parameters"]["elementwise"]["string_value"] in ("carpool-fused", "torch")
    pages = config["parameters"]["huge_pages"]["string_value"]
    assert pages in ("madvise", "always") or pages.startswith("off: ")
    assert over_grpc["parameters"] == config["parameters"]


def test_generation_kserve_face_answers_an_infer_built_from_its_metadata(
    http: httpclient.InferenceServerClient,
) -> None:
    metadata = http.get_model_metadata(GENERATION)
    assert metadata["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}]
    assert metadata["outputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}]
    assert http.is_model_ready(GENERATION)
    texts = _infer_text(http, GENERATION, [b"a", b"b", b"a"]).as_numpy("TEXT")
    assert texts.shape == (3,) and texts[0] == texts[2]  # greedy: same prompt, same text


@pytest.mark.parametrize("wire", ["http", "grpc"])
def test_generation_kserve_timeout_stops_the_generation_with_503(
    served: ServedProcess, request: pytest.FixtureRequest, wire: str
) -> None:
    """Triton's ``timeout`` parameter (µs). Was: ignored by the generation model, which
    answered 200 whatever the deadline, where every other model expires the request."""
    client = request.getfixturevalue(wire)
    module = httpclient if wire == "http" else grpcclient
    tensor = module.InferInput("TEXT", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    finished_before = _metric(served.http_url, "carpool_generation_requests_finished_total")
    with pytest.raises(InferenceServerException) as expired:
        client.infer(GENERATION, [tensor], parameters={"timeout": 1})
    status = "503" if wire == "http" else "StatusCode.UNAVAILABLE"
    assert expired.value.status() == status
    assert "did not finish within its timeout of 1 µs" in expired.value.message()
    wait_until(  # stopped: its engine request ended (aborted), not left running
        lambda: (
            _metric(served.http_url, "carpool_generation_requests_finished_total") > finished_before
        ),
        "the stopped generation to end",
    )
    texts = client.infer(GENERATION, [tensor], parameters={"timeout": 60_000_000})
    assert texts.as_numpy("TEXT").shape == (1,)


# -- the embeddings model ---------------------------------------------------------------


def test_embeddings_stats_count_texts_as_metrics_do(
    served: ServedProcess, http: httpclient.InferenceServerClient
) -> None:
    """Each text is one request to the batcher: ``/stats`` and ``/metrics`` count texts,
    over KServe and ``/v1/embeddings`` alike."""
    before = _stats(http, EMBEDDINGS)
    embedded = _infer_text(http, EMBEDDINGS, [b"a cat", b"a dog", b"a bird"])
    assert embedded.as_numpy("EMBEDDING").shape == (3, 384)
    client = openai.OpenAI(base_url=f"http://{served.http_url}/v1", api_key="unused")
    answer = client.embeddings.create(model=EMBEDDINGS, input=["one", "two"])
    assert answer.usage.prompt_tokens == 6  # [CLS] word [SEP] twice
    after = _stats(http, EMBEDDINGS)
    assert after["inference_count"] - before["inference_count"] == 5
    assert _count(after, "success") - _count(before, "success") == 5
    completed = _metric(served.http_url, "carpool_requests_completed_total", model=EMBEDDINGS)
    assert completed == _count(after, "success")
    config = http.get_model_config(EMBEDDINGS)
    assert config["max_batch_size"] == 64
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 5000
    assert config["output"] == [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": [384]}]


def test_tuning_a_generation_model_is_refused_with_the_servers_reason(
    served: ServedProcess, tmp_path: Any
) -> None:
    # `carpool tune` reads the model's batch policy first; a generation model has engine
    # settings instead, and the user gets one line saying so (not an HTTPStatusError).
    out = tmp_path / "tuned.yaml"
    command = [
        sys.executable, "-m", "carpool.cli", "tune",
        f"http://{served.http_url}/v2/models/{GENERATION}",
        "--slo-p99-ms", "100", "--out", str(out), "--param", "max_batch_size=1,2",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "a model with a batch policy" in result.stderr
    assert "max_num_seqs" in result.stderr  # the server's reason, naming the engine settings
    assert not out.exists()
