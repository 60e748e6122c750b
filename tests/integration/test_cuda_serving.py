"""`carpool serve CONFIG.yaml` with torch models on a CUDA GPU, through tritonclient.

The config's ``device`` and ``dtype`` place each model; answers must match W1 run on the
CPU in float32, batches must form, KServe's config must say KIND_GPU, ``/metrics`` must show
GPU memory, and a real CUDA out-of-memory must be split and retried with nothing lost.
These need a GPU that torch can use and are skipped anywhere else (CI has none); their last
run on one is recorded in docs/benchmarks.md, "On a GPU".
"""

from __future__ import annotations

import functools
import textwrap
from queue import Queue
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from carpool.models.mlp import build_w1

from .conftest import StartServer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch sees none here"
)

TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}  # x max |reference|
IO = """\
    inputs: [{name: INPUT0, datatype: FP32, shape: [256]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [16]}]
    max_batch_size: 64
    max_delay_s: 0.005
"""
W1_CONFIG = "models:\n" + "".join(
    f"  - name: {name}\n    kind: torch\n    source: carpool.models.mlp:build_w1\n{place}{IO}"
    for name, place in [
        ("w1_float32", "    device: cuda:0\n"),
        ("w1_float16", "    device: cuda:0\n    dtype: float16\n"),
        ("w1_bfloat16", "    device: cuda:0\n    dtype: bfloat16\n"),
        ("w1_two", "    devices: [cuda:0, cuda:0]\n"),
    ]
)


def _reference(x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        out: np.ndarray = build_w1()(torch.from_numpy(x)).numpy()
    return out


def _close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE[dtype] * scale)


def _http_infer(
    client: httpclient.InferenceServerClient, model: str, x: np.ndarray, binary: bool
) -> np.ndarray:
    tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
    result = client.infer(model, [tensor], outputs=[output])
    out: np.ndarray = result.as_numpy("OUTPUT0")
    return out


def _grpc_infer(client: grpcclient.InferenceServerClient, model: str, x: np.ndarray) -> np.ndarray:
    tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    out: np.ndarray = client.infer(model, [tensor]).as_numpy("OUTPUT0")
    return out


def _grpc_at_once(
    client: grpcclient.InferenceServerClient, model: str, name_in: str, name_out: str, xs: Any
) -> list[np.ndarray]:
    """Sends every ``xs[i]`` as its own request before any answer comes; the answers in
    order. (tritonclient.http's async_infer sleeps 10 ms after each send, gevent.sleep(0.01)
    in its source, so eight of them may not reach one batch window together.)"""
    answers: Queue[tuple[int, Any, Any]] = Queue()
    for i, x in enumerate(xs):
        tensor = grpcclient.InferInput(name_in, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        client.async_infer(
            model,
            [tensor],
            callback=functools.partial(lambda i, result, error: answers.put((i, result, error)), i),
        )
    outs: list[np.ndarray | None] = [None] * len(xs)
    for _ in xs:
        i, result, error = answers.get(timeout=60)
        assert error is None, error
        outs[i] = result.as_numpy(name_out)
    return [out for out in outs if out is not None]


def _metric(url: str, name: str, model: str, **labels: str) -> float | None:
    text = httpx.get(f"http://{url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            wanted = {"model": model, **labels}
            if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items()):
                return float(sample.value)
    return None


def test_models_run_on_the_gpu_in_the_configured_dtype(start_server: StartServer) -> None:
    served = start_server(W1_CONFIG, grpc=True)
    http = httpclient.InferenceServerClient(served.http_url, concurrency=32)
    grpc = grpcclient.InferenceServerClient(served.grpc_url)
    rng = np.random.default_rng(0)
    try:
        for dtype in ("float32", "float16", "bfloat16"):
            model = f"w1_{dtype}"
            x = rng.standard_normal((3, 256), dtype=np.float32)
            want = _reference(x)
            for got in (
                _http_infer(http, model, x, binary=True),
                _http_infer(http, model, x, binary=False),
                _grpc_infer(grpc, model, x),
            ):
                assert got.dtype == np.float32 and got.shape == (3, 16)
                _close(got, want, dtype)
        # 256 single requests sent at once to two GPU replicas share batches.
        xs = rng.standard_normal((256, 1, 256), dtype=np.float32)
        outs = _grpc_at_once(grpc, "w1_two", "INPUT0", "OUTPUT0", xs)
        _close(np.concatenate(outs), _reference(xs[:, 0]), "float32")
        stats = http.get_inference_statistics("w1_two")["model_stats"][0]
        assert stats["inference_count"] == 256
        assert stats["execution_count"] < 256, stats  # some batches held more than one
        config = http.get_model_config("w1_two")
        assert config["instance_group"] == [{"count": 2, "kind": "KIND_GPU", "gpus": [0]}]
        # GPU memory is the GPU's, all models on it: torch's allocator counts per device.
        # Loaded on it: W1 three times in float32 (w1_float32, w1_two's two replicas) and
        # twice in 16 bits.
        peak = _metric(served.http_url, "carpool_memory_peak_bytes", "w1_two")
        total = _metric(served.http_url, "carpool_memory_total_bytes", "w1_two")
        assert total == torch.cuda.get_device_properties(0).total_memory
        num_weights = sum(p.numel() for p in build_w1().parameters())
        assert peak is not None and 3 * 4 * num_weights + 2 * 2 * num_weights <= peak < total
        volatility = _metric(served.http_url, "carpool_memory_volatility", "w1_two")
        assert volatility is not None and 0 <= volatility < 1
    finally:
        http.close()
        grpc.close()


def test_a_gpu_out_of_memory_is_split_and_retried_with_nothing_lost(
    start_server: StartServer,
) -> None:
    # gpumodels.hog holds a third of the GPU per request: only batches of 2 or fewer fit.
    config = textwrap.dedent("""\
        models:
          - name: hog
            kind: torch
            source: gpumodels:hog
            device: cuda:0
            inputs: [{name: x, datatype: FP32, shape: [4]}]
            outputs: [{name: y, datatype: FP32, shape: [4]}]
            max_batch_size: 8
            max_delay_s: 1.0
        """)
    served = start_server(config, grpc=True)
    client = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        for round_ in range(2):
            # Eight at once: the first round fills one batch of 8, which cannot fit.
            xs = np.arange(8 * 4, dtype=np.float32).reshape(8, 1, 4) + 100 * round_
            outs = _grpc_at_once(client, "hog", "x", "y", xs)
            np.testing.assert_array_equal(np.stack(outs), xs * 2)
        stats = client.get_inference_statistics("hog", as_json=True)["model_stats"][0]
        assert int(stats["inference_count"]) == 16
        sizes = {int(s["batch_size"]) for s in stats["batch_stats"]}
        assert sizes and max(sizes) <= 2, sizes  # every call that succeeded fitted
        formed = _metric(served.http_url, "carpool_batches_total", "hog")
        assert formed is not None and formed < int(stats["execution_count"])  # splits ran
        up_to_4 = _metric(served.http_url, "carpool_batch_size_bucket", "hog", le="4.0")
        assert up_to_4 is not None and formed - up_to_4 >= 1  # a batch of more than 4 formed
        log = served.output()
        assert "Traceback" not in log, log
    finally:
        client.close()
