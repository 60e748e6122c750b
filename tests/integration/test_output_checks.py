"""A model whose result contradicts its declared outputs, served and called as a Triton
user calls it: every request of the failed batch gets a 500 (gRPC INTERNAL) naming the
output, what was declared and what came; other models and later requests are served.

Was: the wrong shape was answered as it came, contradicting the model's metadata, and
floats returned for a declared INT64 output were truncated on the wire."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import ServedProcess, start_served_process

MODELS = '''\
"""The models of test_output_checks."""


def narrow(inputs):
    """Declared Y [-1, 4]; returns 3 columns for a batch holding a negative value (a bad
    request's marker, whatever batch it rides in), 4 otherwise."""
    x = inputs["X"]
    return {"Y": x[:, :3] if (x < 0).any() else x}


def halves(inputs):
    """Declared N INT64; returns x / 2 as floats."""
    return {"N": inputs["X"][:, :1] / 2}


def good(inputs):
    return {"Y": inputs["X"] * 2}
'''


def _entry(name: str, output: str, datatype: str, shape: str) -> str:
    return f"""\
  - name: {name}
    kind: python
    source: outchecks:{name}
    inputs: [{{name: X, datatype: FP32, shape: [4]}}]
    outputs: [{{name: {output}, datatype: {datatype}, shape: {shape}}}]
    max_batch_size: 8
    max_delay_s: 0.0
"""


CONFIG = "models:\n" + "".join(
    [
        _entry("narrow", "Y", "FP32", "[4]"),
        _entry("halves", "N", "INT64", "[1]"),
        _entry("good", "Y", "FP32", "[4]"),
    ]
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    folder = tmp_path_factory.mktemp("outchecks")
    (folder / "outchecks.py").write_text(MODELS, encoding="utf-8")
    process = start_served_process(CONFIG, folder, grpc=True)
    try:
        yield process
    finally:
        process.stop()


def _infer(url: str, model: str, rows: int, sign: int = 1) -> np.ndarray:
    client = httpclient.InferenceServerClient(url)
    x = (np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + 1) * sign
    tensor = httpclient.InferInput("X", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer(model, [tensor])
    output = "N" if model == "halves" else "Y"
    return result.as_numpy(output)


def test_a_wrong_output_shape_is_a_500_naming_it_and_the_server_goes_on(
    served: ServedProcess,
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        _infer(served.http_url, "narrow", 1, -1)
    assert caught.value.status() == "500"
    message = caught.value.message()
    assert "output 'Y'" in message and "shape [1, 3]" in message, message
    assert "declared [-1, 4]" in message, message
    # The model itself and the server still serve what fits.
    assert _infer(served.http_url, "narrow", 2).shape == (2, 4)
    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(_infer, served.http_url, "good", 2) for _ in range(8)]
        bads = [pool.submit(_infer, served.http_url, "narrow", 1, -1) for _ in range(4)]
        for future in goods:
            np.testing.assert_array_equal(future.result()[0], [2, 4, 6, 8])
        for future in bads:
            with pytest.raises(InferenceServerException, match="output 'Y'"):
                future.result()


def test_floats_for_a_declared_int64_output_are_refused_not_truncated(
    served: ServedProcess,
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        _infer(served.http_url, "halves", 2)
    message = caught.value.message()
    assert "output 'N'" in message and "float32" in message and "INT64" in message, message

    assert served.grpc_url is not None
    client = grpcclient.InferenceServerClient(served.grpc_url)
    tensor = grpcclient.InferInput("X", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    with pytest.raises(InferenceServerException) as grpc_caught:
        client.infer("halves", [tensor])
    assert grpc_caught.value.status() == "StatusCode.INTERNAL"
    assert "output 'N'" in grpc_caught.value.message()
