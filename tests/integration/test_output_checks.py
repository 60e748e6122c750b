"""A model whose result contradicts its declared outputs, served and called as a Triton
user calls it: every request of the failed batch gets a 500 (gRPC INTERNAL) naming the
output, what was declared and what came; other models and later requests are served.

Was: the wrong shape was answered as it came, contradicting the model's metadata, and
floats returned for a declared INT64 output were truncated on the wire."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import ServedProcess, start_served_process

MODELS = '''\
"""The models of test_output_checks."""

import ml_dtypes


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


def str_list(inputs):
    """BYTES output as a Python list of str, one per row."""
    return {"S": [f"row{i}" for i in range(len(inputs["X"]))]}


def rows_list(inputs):
    """FP32 [4] output as a Python list of the batch's rows."""
    return {"Y": [row * 2 for row in inputs["X"]]}


def bf16_rows(inputs):
    """FP32 [4] output computed in bfloat16 (ml_dtypes): widening to FP32 is exact."""
    return {"Y": (inputs["X"] * 2).astype(ml_dtypes.bfloat16)}
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
        _entry("str_list", "S", "BYTES", "[]"),
        _entry("rows_list", "Y", "FP32", "[4]"),
        _entry("bf16_rows", "Y", "FP32", "[4]"),
    ]
)
X = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # two rows of four


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


# -- outputs returned as lists or in bfloat16, answered as declared ---------------------------


def _infer_json(served: ServedProcess, model: str) -> httpx.Response:
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 4], "data": X}]}
    return httpx.post(f"http://{served.http_url}/v2/models/{model}/infer", json=body, timeout=30)


def test_a_bytes_output_returned_as_a_list_of_str_is_answered(served: ServedProcess) -> None:
    """Was: a python model returning ``{"S": ["row0", "row1"]}`` for a BYTES output, the
    usual Python way to return strings, was answered ``["row0", "row1"]`` before the output
    checks; now every batch fails with 500 "output 'S': the model returned list; expected
    an array of shape [-1]"."""
    response = _infer_json(served, "str_list")
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == ["row0", "row1"]


def test_an_output_returned_as_a_list_of_rows_is_answered(served: ServedProcess) -> None:
    """Was: a list of the batch's rows (one array per item), which the batcher splits and
    the server stacks per request, was answered before the output checks; now a 500
    "output 'Y': the model returned list; expected an array of shape [-1, 4]"."""
    response = _infer_json(served, "rows_list")
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [2 * v for v in X]


def test_bfloat16_results_for_a_declared_fp32_output_are_answered(
    served: ServedProcess,
) -> None:
    """Was: an ml_dtypes bfloat16 array (NumPy kind 'V') for a declared FP32 output is
    refused with "the model returned bfloat16, which the declared FP32 cannot carry without
    losing values", although bfloat16 widens to FP32 exactly and was answered before; only
    a declared BF16 output takes bfloat16."""
    response = _infer_json(served, "bf16_rows")
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [2 * v for v in X]


def test_a_good_model_is_answered_between_failing_batches(served: ServedProcess) -> None:
    """A batch that fails its checks does not stop the server: the next one is served."""
    _infer_json(served, "str_list")
    response = _infer_json(served, "good")
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [2 * v for v in X]
