"""Triton's classification extension against a real server with ``tritonclient``: an output
asked with ``class_count`` comes back as its top classes, checked against NumPy's top-k
of the plain output of the same request (the model returns one array under two names),
over both HTTP paths (the infer fast path, and with a query string the ASGI path), JSON
and binary, and gRPC; a bad ``class_count`` fails alone."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from queue import Queue
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import HERE, ServedProcess, free_port, start_served_process

WAIT_LIMIT_S = 30.0
# identity: every IN_<x> comes back as OUT_<x>; the client sends the same rows to both
# inputs, so OUT_P (or OUT_Q) is the plain output the classes are checked against.
CONFIG = """\
models:
  - name: scores
    kind: python
    source: configmodels:identity
    inputs:
      - {name: IN_S, datatype: FP32, shape: [5]}
      - {name: IN_P, datatype: FP32, shape: [5]}
    outputs:
      - {name: OUT_S, datatype: FP32, shape: [5], label_filename: labels/animals.txt}
      - {name: OUT_P, datatype: FP32, shape: [5]}
    max_batch_size: 16
    max_delay_s: 0.005
  - name: counts
    kind: python
    source: configmodels:identity
    inputs:
      - {name: IN_C, datatype: INT32, shape: [4, 1, 1]}
      - {name: IN_Q, datatype: INT32, shape: [4, 1, 1]}
    outputs:
      - {name: OUT_C, datatype: INT32, shape: [4, 1, 1]}
      - {name: OUT_Q, datatype: INT32, shape: [4, 1, 1]}
    max_batch_size: 16
    max_delay_s: 0.005
  - name: halves
    kind: python
    source: configmodels:identity
    inputs: [{name: IN_H, datatype: FP16, shape: [3]}]
    outputs: [{name: OUT_H, datatype: FP16, shape: [3]}]
"""
# Index 3 has an empty line: no label, as Triton answers it.
LABELS = ["cat", "dog", "emu", "", "fox"]
# No query string: the HTTP infer fast path; a query string: the ASGI path.
PATHS = [None, {"via": "asgi"}]
PATH_IDS = ["fast", "asgi"]
Module = Any  # tritonclient.http or tritonclient.grpc


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    folder = tmp_path_factory.mktemp("classification")
    (folder / "labels").mkdir()
    (folder / "labels" / "animals.txt").write_text("\n".join(LABELS) + "\n", encoding="utf-8")
    process = start_served_process(CONFIG, folder, grpc=True)
    yield process
    assert process.stop() == 0, process.output()
    assert "Traceback" not in process.output(), process.output()


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


def _scores(num_rows: int, seed: int) -> np.ndarray:
    """Distinct float32 scores: no ties, so every order is Triton's too."""
    rng = np.random.default_rng(seed)
    return rng.permutation(num_rows * 5).reshape(num_rows, 5).astype(np.float32) / 7 - 2


def _counts(num_rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = rng.choice(np.arange(-1000, 1000), size=num_rows * 4, replace=False)
    return values.reshape(num_rows, 4, 1, 1).astype(np.int32)


def _top_k(plain: np.ndarray, k: int, labels: list[str] | None = None) -> list[list[str]]:
    """NumPy's top ``k`` of each row, written as Triton's extension writes them."""
    rows = plain.reshape(len(plain), -1)
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    answer = []
    for row, indices in zip(rows, order, strict=True):
        texts = []
        for index in indices.tolist():
            value = row[index]
            text = f"{float(value):f}" if rows.dtype.kind == "f" else str(int(value))
            text += f":{index}"
            if labels is not None and labels[index]:
                text += f":{labels[index]}"
            texts.append(text)
        answer.append(texts)
    return answer


def _texts(array: np.ndarray) -> list[list[str]]:
    """tritonclient reads BYTES as bytes from binary data and as str from JSON."""
    return [[e.decode() if isinstance(e, bytes) else e for e in row] for row in array.tolist()]


def _inputs(module: Module, names: list[str], array: np.ndarray, *, binary: bool) -> list[Any]:
    datatype = {"f": "FP32", "i": "INT32"}[array.dtype.kind]
    tensors = []
    for name in names:
        tensor = module.InferInput(name, list(array.shape), datatype)
        if module is httpclient:
            tensor.set_data_from_numpy(array, binary_data=binary)
        else:
            tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _output(module: Module, name: str, *, binary: bool, class_count: int = 0) -> Any:
    if module is httpclient:
        return module.InferRequestedOutput(name, binary_data=binary, class_count=class_count)
    return module.InferRequestedOutput(name, class_count=class_count)


def _scores_request(
    module: Module, rows: np.ndarray, k: int, *, labelled: bool, binary: bool = True
) -> tuple[list[Any], list[Any], str, str]:
    """(inputs, outputs, classified name, plain name) of a request to ``scores`` asking
    the labelled OUT_S, or the unlabelled OUT_P, as its top ``k`` classes."""
    classified, plain = ("OUT_S", "OUT_P") if labelled else ("OUT_P", "OUT_S")
    outputs = [
        _output(module, classified, binary=binary, class_count=k),
        _output(module, plain, binary=binary),
    ]
    return _inputs(module, ["IN_S", "IN_P"], rows, binary=binary), outputs, classified, plain


def _read(
    module: Module, result: Any, classified: str, plain: str
) -> tuple[list[list[str]], np.ndarray, str, list[int]]:
    """(classes, the plain output, the classified output's datatype and shape)."""
    output = result.get_output(classified)
    if module is httpclient:
        datatype, shape = output["datatype"], output["shape"]
    else:
        datatype, shape = output.datatype, list(output.shape)
    return _texts(result.as_numpy(classified)), result.as_numpy(plain), datatype, shape


def _classify_scores(
    client: Any, module: Module, rows: np.ndarray, k: int, *, labelled: bool, **kwargs: Any
) -> tuple[list[list[str]], np.ndarray, str, list[int]]:
    """:func:`_read` of one request of :func:`_scores_request`."""
    binary = kwargs.pop("binary", True)
    inputs, outputs, classified, plain = _scores_request(
        module, rows, k, labelled=labelled, binary=binary
    )
    result = client.infer("scores", inputs, outputs=outputs, **kwargs)
    return _read(module, result, classified, plain)


# -- answers --------------------------------------------------------------------------------


@pytest.mark.parametrize("labelled", [True, False], ids=["labels", "no-labels"])
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
def test_http_classes_are_numpys_top_k_of_the_plain_output(
    http: httpclient.InferenceServerClient,
    query: dict[str, str] | None,
    binary: bool,
    labelled: bool,
) -> None:
    rows = _scores(4, seed=2 * binary + labelled)
    classes, plain, datatype, shape = _classify_scores(
        http, httpclient, rows, 3, labelled=labelled, binary=binary, query_params=query
    )
    np.testing.assert_array_equal(plain, rows)
    assert (datatype, shape) == ("BYTES", [4, 3])
    assert classes == _top_k(plain, 3, LABELS if labelled else None)


@pytest.mark.parametrize("labelled", [True, False], ids=["labels", "no-labels"])
def test_grpc_classes_are_numpys_top_k_of_the_plain_output(
    grpc: grpcclient.InferenceServerClient, labelled: bool
) -> None:
    rows = _scores(3, seed=7 if labelled else 8)
    classes, plain, datatype, shape = _classify_scores(grpc, grpcclient, rows, 2, labelled=labelled)
    np.testing.assert_array_equal(plain, rows)
    assert (datatype, shape) == ("BYTES", [3, 2])
    assert classes == _top_k(plain, 2, LABELS if labelled else None)


@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
def test_http_class_count_above_the_classes_returns_every_class(
    http: httpclient.InferenceServerClient, query: dict[str, str] | None
) -> None:
    rows = _scores(2, seed=3)
    classes, plain, _, shape = _classify_scores(
        http, httpclient, rows, 100, labelled=True, query_params=query
    )
    assert shape == [2, 5]  # Triton: min(class_count, classes per row)
    assert classes == _top_k(plain, 5, LABELS)


def test_grpc_class_count_above_the_classes_returns_every_class(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    classes, plain, _, shape = _classify_scores(grpc, grpcclient, _scores(1, 4), 9, labelled=True)
    assert shape == [1, 5]
    assert classes == _top_k(plain, 5, LABELS)


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_integer_output_of_shape_n_1_1_has_n_classes(served: ServedProcess, module: Module) -> None:
    rows = _counts(3, seed=11)
    url = served.http_url if module is httpclient else served.grpc_url
    client = module.InferenceServerClient(url)
    try:
        outputs = [_output(module, "OUT_C", binary=False, class_count=2)]
        outputs.append(_output(module, "OUT_Q", binary=False))
        inputs = _inputs(module, ["IN_C", "IN_Q"], rows, binary=False)
        result = client.infer("counts", inputs, outputs=outputs)
    finally:
        client.close()
    plain = result.as_numpy("OUT_Q")
    np.testing.assert_array_equal(plain, rows)
    assert _texts(result.as_numpy("OUT_C")) == _top_k(plain, 2)


@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
def test_http_classification_and_plain_requests_alternate_on_one_plan(
    http: httpclient.InferenceServerClient, query: dict[str, str] | None
) -> None:
    # The same input header with and without class_count: each is answered as it asked,
    # however the server keeps the checked headers of earlier requests.
    for seed in range(3):
        rows = _scores(2, seed=seed)
        classes, plain, _, _ = _classify_scores(
            http, httpclient, rows, 2, labelled=True, query_params=query
        )
        assert classes == _top_k(plain, 2, LABELS)
        inputs = _inputs(httpclient, ["IN_S", "IN_P"], rows, binary=True)
        result = http.infer("scores", inputs, query_params=query)
        np.testing.assert_array_equal(result.as_numpy("OUT_S"), rows)


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("query", ["", "?via=asgi"], ids=PATH_IDS)
def test_http_class_count_zero_answers_the_tensor_itself(served: ServedProcess, query: str) -> None:
    # Triton's REST endpoint reads an explicit 0 as its default count: no classification.
    row = [0.5, 2.0, -1.0, 4.0, 3.0]
    body = {
        "inputs": [
            {"name": name, "datatype": "FP32", "shape": [1, 5], "data": row}
            for name in ("IN_S", "IN_P")
        ],
        "outputs": [{"name": "OUT_S", "parameters": {"classification": 0}}],
    }
    url = f"http://{served.http_url}/v2/models/scores/infer{query}"
    answer = httpx.post(url, json=body, timeout=WAIT_LIMIT_S)
    assert answer.status_code == 200, answer.text
    (output,) = answer.json()["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("OUT_S", "FP32", [1, 5])
    assert output["data"] == row


@pytest.mark.parametrize("query", ["", "?via=asgi"], ids=PATH_IDS)
@pytest.mark.parametrize("value", [-1, "3", 2.5, True])
def test_http_bad_class_count_is_400_naming_output_value_and_expected(
    served: ServedProcess, query: str, value: Any
) -> None:
    body = {
        "inputs": [
            {"name": name, "datatype": "FP32", "shape": [1, 5], "data": [1.0] * 5}
            for name in ("IN_S", "IN_P")
        ],
        "outputs": [{"name": "OUT_S", "parameters": {"classification": value}}],
    }
    url = f"http://{served.http_url}/v2/models/scores/infer{query}"
    answer = httpx.post(url, json=body, timeout=WAIT_LIMIT_S)
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]
    assert "output 'OUT_S'" in message
    assert f"classification={value!r}" in message
    assert "integer >= 0" in message


@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
def test_http_negative_class_count_from_tritonclient_is_400(
    http: httpclient.InferenceServerClient, query: dict[str, str] | None
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        _classify_scores(http, httpclient, _scores(1, 1), -2, labelled=True, query_params=query)
    assert caught.value.status() == "400"
    assert "output 'OUT_S'" in caught.value.message()
    assert "classification=-2" in caught.value.message()


def test_grpc_negative_class_count_is_invalid_argument(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        _classify_scores(grpc, grpcclient, _scores(1, 1), -2, labelled=True)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "output 'OUT_S'" in caught.value.message()
    assert "classification=-2" in caught.value.message()


def _halves(module: Module, url: str, **kwargs: Any) -> Any:
    client = module.InferenceServerClient(url)
    try:
        tensor = module.InferInput("IN_H", [1, 3], "FP16")
        tensor.set_data_from_numpy(np.array([[1, 3, 2]], dtype=np.float16))
        output = module.InferRequestedOutput("OUT_H", class_count=2)
        return client.infer("halves", [tensor], outputs=[output], **kwargs)
    finally:
        client.close()


@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
def test_http_output_that_cannot_be_classified_is_400(
    served: ServedProcess, query: dict[str, str] | None
) -> None:
    # As Triton: FP16 (like BOOL, BYTES and BF16) has no top classes.
    with pytest.raises(InferenceServerException) as caught:
        _halves(httpclient, served.http_url, query_params=query)
    assert caught.value.status() == "400"
    message = caught.value.message()
    assert "output 'OUT_H'" in message and "FP16" in message and "FP32" in message


def test_grpc_output_that_cannot_be_classified_is_invalid_argument(
    served: ServedProcess,
) -> None:
    assert served.grpc_url is not None
    with pytest.raises(InferenceServerException) as caught:
        _halves(grpcclient, served.grpc_url)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "output 'OUT_H'" in caught.value.message()


def test_bad_requests_fail_alone_among_concurrent_good_ones(served: ServedProcess) -> None:
    # Every request is in flight before any answer is read: tritonclient.http's greenlets
    # on both HTTP paths, tritonclient.grpc's callbacks; good and bad ones interleaved.
    assert served.grpc_url is not None
    http = httpclient.InferenceServerClient(served.http_url, concurrency=8)
    grpc = grpcclient.InferenceServerClient(served.grpc_url)
    grpc_answers: Queue[tuple[int, Any, Any]] = Queue()
    http_calls, expected, num_grpc = [], {}, 0
    try:
        for seed in range(30):
            module = (httpclient, grpcclient)[seed % 2]
            is_bad = seed % 5 in (2, 4)
            rows = _scores(1 + seed % 3, seed=seed)
            labelled = seed % 3 != 0
            inputs, outputs, classified, plain = _scores_request(
                module, rows, -1 if is_bad else 3, labelled=labelled
            )
            expected[seed] = None if is_bad else (rows, labelled, classified, plain)
            if module is httpclient:
                query = PATHS[(seed // 2) % 2]
                call = http.async_infer("scores", inputs, outputs=outputs, query_params=query)
                http_calls.append((seed, call))
            else:
                num_grpc += 1
                grpc.async_infer(
                    "scores",
                    inputs,
                    partial(lambda n, result, error: grpc_answers.put((n, result, error)), seed),
                    outputs=outputs,
                )
        answers = []
        for seed, call in http_calls:
            try:
                answers.append((httpclient, seed, call.get_result(), None))
            except InferenceServerException as error:
                answers.append((httpclient, seed, None, error))
        for _ in range(num_grpc):
            seed, result, error = grpc_answers.get(timeout=WAIT_LIMIT_S)
            answers.append((grpcclient, seed, result, error))
    finally:
        http.close()
        grpc.close()
    assert sorted(seed for _, seed, _, _ in answers) == list(range(30))
    for module, seed, result, error in answers:
        if expected[seed] is None:
            assert result is None and error is not None, seed
            assert "classification=-1" in error.message()
            continue
        assert error is None, (seed, error)
        rows, labelled, classified, plain = expected[seed]
        classes, plain_rows, _, _ = _read(module, result, classified, plain)
        np.testing.assert_array_equal(plain_rows, rows)
        assert classes == _top_k(plain_rows, 3, LABELS if labelled else None), seed


# -- what the server says about it --------------------------------------------------------


def test_model_config_names_the_label_file_as_given(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    outputs = http.get_model_config("scores")["output"]
    assert [o.get("label_filename") for o in outputs] == ["labels/animals.txt", None]
    config = grpc.get_model_config("scores").config
    assert [o.label_filename for o in config.output] == ["labels/animals.txt", ""]


def test_server_metadata_lists_the_classification_extension(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    assert "classification" in http.get_server_metadata()["extensions"]
    assert "classification" in grpc.get_server_metadata().extensions


@pytest.mark.parametrize(
    ("labels", "fragments"),
    [
        (None, ["models[0].outputs[0].label_filename='labels.txt'", "No such file"]),
        ("cat\ndog\n", ["models[0].outputs[0].label_filename='labels.txt'", "at least 3"]),
    ],
    ids=["missing", "short"],
)
def test_serve_exits_2_when_a_label_file_is_missing_or_short(
    tmp_path: Path, labels: str | None, fragments: list[str]
) -> None:
    if labels is not None:
        (tmp_path / "labels.txt").write_text(labels, encoding="utf-8")
    config = tmp_path / "serve.yaml"
    config.write_text(
        "models:\n"
        "  - name: m\n"
        "    kind: python\n"
        "    source: configmodels:identity\n"
        "    inputs: [{name: IN_S, datatype: FP32, shape: [3]}]\n"
        "    outputs: [{name: OUT_S, datatype: FP32, shape: [3], label_filename: labels.txt}]\n",
        encoding="utf-8",
    )
    command = [sys.executable, "-m", "carpool.cli", "serve", str(config)]
    command += ["--host", "127.0.0.1", "--port", str(free_port()), "--grpc-port", "0"]
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"carpool serve: {config}: invalid ")
    for fragment in fragments:
        assert fragment in done.stderr
    assert "Traceback" not in done.stderr
