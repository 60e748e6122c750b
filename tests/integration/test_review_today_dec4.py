"""Review of the day's changes (b50482d..HEAD): output checks, the KServe ``timeout``
cap, the lazily timed keep-alive wait and the fast path's route cache, as a Triton user
meets them against a served `carpool serve`.

The tests whose docstrings start "Was:" fail on the code under review; the others are
checks that pass and would fail if the behaviour regressed."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import numpy as np
import orjson
import pytest

from carpool import Batcher, BatchPolicy, ClassPolicy
from carpool.server.infer import InferPlans, prepare_infer
from carpool.server.outputs import OutputMismatch, check_outputs
from carpool.server.repository import ServedModel, TensorSpec

from .conftest import ServedProcess, read_until_closed, start_served_process

MODELS = '''\
"""The models of test_review_today_dec4."""

import time

import ml_dtypes
import numpy as np


def str_list(inputs):
    """BYTES output as a Python list of str, one per row."""
    return {"S": [f"row{i}" for i in range(len(inputs["X"]))]}


def rows_list(inputs):
    """FP32 [4] output as a Python list of the batch's rows."""
    return {"Y": [row * 2 for row in inputs["X"]]}


def bf16_rows(inputs):
    """FP32 [4] output computed in bfloat16 (ml_dtypes): widening to FP32 is exact."""
    return {"Y": (inputs["X"] * 2).astype(ml_dtypes.bfloat16)}


def good(inputs):
    return {"Y": inputs["X"] * 2}


def sleepy(inputs):
    """Longer than uvicorn's timeout_keep_alive (5 s): its wait fires during the answer."""
    time.sleep(5.5)
    return {"Y": inputs["X"] * 2}
'''


def _entry(name: str, output: str, datatype: str, shape: str) -> str:
    return f"""\
  - name: {name}
    kind: python
    source: dec4models:{name}
    inputs: [{{name: X, datatype: FP32, shape: [4]}}]
    outputs: [{{name: {output}, datatype: {datatype}, shape: {shape}}}]
    max_batch_size: 8
    max_delay_s: 0.0
"""


CONFIG = "models:\n" + "".join(
    [
        _entry("str_list", "S", "BYTES", "[]"),
        _entry("rows_list", "Y", "FP32", "[4]"),
        _entry("bf16_rows", "Y", "FP32", "[4]"),
        _entry("good", "Y", "FP32", "[4]"),
        _entry("sleepy", "Y", "FP32", "[4]"),
    ]
)
KEEP_ALIVE_S = 5  # uvicorn's timeout_keep_alive, which carpool serve keeps
X = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # two rows of four


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    folder = tmp_path_factory.mktemp("dec4")
    (folder / "dec4models.py").write_text(MODELS, encoding="utf-8")
    process = start_served_process(CONFIG, folder)
    try:
        yield process
    finally:
        assert process.stop() == 0, process.output()


def _infer(served: ServedProcess, model: str) -> httpx.Response:
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 4], "data": X}]}
    return httpx.post(f"http://{served.http_url}/v2/models/{model}/infer", json=body, timeout=30)


# -- output checks: outputs that were answered right before the checks -------------------


def test_a_bytes_output_returned_as_a_list_of_str_is_answered(served: ServedProcess) -> None:
    """Was: a python model returning ``{"S": ["row0", "row1"]}`` for a BYTES output, the
    usual Python way to return strings, was answered ``["row0", "row1"]`` before the output
    checks; now every batch fails with 500 "output 'S': the model returned list; expected
    an array of shape [-1]"."""
    response = _infer(served, "str_list")
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == ["row0", "row1"]


def test_an_output_returned_as_a_list_of_rows_is_answered(served: ServedProcess) -> None:
    """Was: a list of the batch's rows (one array per item), which the batcher splits and
    the server stacks per request, was answered before the output checks; now a 500
    "output 'Y': the model returned list; expected an array of shape [-1, 4]"."""
    response = _infer(served, "rows_list")
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [2 * v for v in X]


def test_bfloat16_results_for_a_declared_fp32_output_are_answered(
    served: ServedProcess,
) -> None:
    """Was: an ml_dtypes bfloat16 array (NumPy kind 'V') for a declared FP32 output is
    refused with "the model returned bfloat16, which the declared FP32 cannot carry without
    losing values", although bfloat16 widens to FP32 exactly and was answered before; only
    a declared BF16 output takes bfloat16."""
    response = _infer(served, "bf16_rows")
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [2 * v for v in X]


@pytest.mark.parametrize(
    ("value", "spec"),
    [
        (["a", "b"], TensorSpec("S", "BYTES", ())),
        ([b"a", b"b"], TensorSpec("S", "BYTES", ())),
        ([np.zeros(4, np.float32)] * 2, TensorSpec("Y", "FP32", (4,))),
    ],
    ids=["str-list", "bytes-list", "rows-list"],
)
def test_check_outputs_takes_lists_the_server_answers(value: object, spec: TensorSpec) -> None:
    """Was: check_outputs refuses any output without a ``shape`` (OutputMismatch "the
    model returned list"), while split_outputs and ServedModel.outputs_of answer lists."""
    assert check_outputs({spec.name: value}, (spec,)) == {spec.name: value}


def test_a_wrong_shape_is_still_refused_naming_the_output() -> None:
    """The check itself: a row of 3 for a declared [-1, 4] output fails the batch."""
    spec = TensorSpec("Y", "FP32", (4,))
    with pytest.raises(OutputMismatch, match=r"output 'Y': the model returned shape \[2, 3\]"):
        check_outputs({"Y": np.zeros((2, 3), np.float32)}, (spec,))


def test_torch_tensors_and_declared_bf16_pass_the_check() -> None:
    """Torch tensors (their dtype has no NumPy kind) and bfloat16 for a declared BF16
    output are taken as before."""
    torch = pytest.importorskip("torch")
    import ml_dtypes

    y = TensorSpec("Y", "FP32", (4,))
    b = TensorSpec("B", "BF16", (4,))
    result = {"Y": torch.zeros(2, 4), "B": np.zeros((2, 4), ml_dtypes.bfloat16)}
    assert check_outputs(result, (y, b)) is result


def test_a_good_model_is_answered_between_failing_batches(served: ServedProcess) -> None:
    """A batch that fails its checks does not stop the server: the next one is served."""
    _infer(served, "str_list")
    response = _infer(served, "good")
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [2 * v for v in X]


# -- the KServe timeout: a cap by the class's deadline, across policy updates -------------


def _timeout_model() -> ServedModel:
    batcher = Batcher(
        lambda inputs: {"y": inputs["x"]},
        BatchPolicy(
            max_batch_size=8,
            classes=(ClassPolicy("interactive", timeout_s=0.1), ClassPolicy("normal")),
            default_class="normal",
        ),
        collate="dict",
    )
    return ServedModel(
        name="m",
        version="1",
        platform="python",
        inputs=(TensorSpec("x", "FP32", (4,)),),
        outputs=(TensorSpec("y", "FP32", (4,)),),
        batcher=batcher,
    )


def _json_body(**parameters: object) -> bytes:
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
    return orjson.dumps({"inputs": [tensor], "parameters": parameters})


def test_a_cached_plans_timeout_follows_the_class_deadline_of_each_policy() -> None:
    """The HTTP plans cache a request's options per policy object: a policy update must
    resolve the cap again, for the default class and for a class named by priority."""
    model, plans = _timeout_model(), InferPlans()
    longer = _json_body(timeout=5_000_000)
    named = _json_body(priority="interactive", timeout=5_000_000)
    by_level = _json_body(priority=1, timeout=50_000)
    assert prepare_infer(model, longer, None, plans).options == {"timeout_s": 5.0}
    assert prepare_infer(model, named, None, plans).options == {"priority": "interactive"}
    assert prepare_infer(model, by_level, None, plans).options == pytest.approx(
        {"priority": "interactive", "timeout_s": 0.05}
    )
    model.batcher.update_policy(
        classes=(ClassPolicy("interactive", timeout_s=10.0), ClassPolicy("normal", timeout_s=1.0))
    )
    assert prepare_infer(model, longer, None, plans).options == {}  # capped at 1 s
    assert prepare_infer(model, named, None, plans).options == {
        "priority": "interactive",
        "timeout_s": 5.0,
    }
    model.batcher.update_policy(timeout_s=2.0, classes=(ClassPolicy("normal"),))
    assert prepare_infer(model, longer, None, plans).options == {}  # the model-wide 2 s


# -- the keep-alive wait timed lazily, and the route cache, on a real server -------------


def _connect(served: ServedProcess) -> socket.socket:
    host, port = served.http_url.split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _post(path: bytes, body: bytes) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (path, len(body))
    return head + body


def _good_request() -> bytes:
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": X[:4]}]}
    return _post(b"/v2/models/good/infer", orjson.dumps(body))


def _read_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """``count`` answers (status, body) read off a keep-alive connection."""
    data = b""
    answers: list[tuple[int, bytes]] = []
    while len(answers) < count:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {len(answers)} answers"
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in lines
            if line.lower().startswith(b"content-length:")
        )
        while len(data) < length:
            chunk = sock.recv(65536)
            assert chunk, "closed in the middle of an answer"
            data += chunk
        answers.append((int(lines[0].split()[1]), data[:length]))
        data = data[length:]
    assert data == b"", data
    return answers


def test_a_head_stalled_after_answers_gets_408(served: ServedProcess) -> None:
    """The wait after the last answer is the deadline for the next head: the timer armed
    at connect catches up with it, and a half request line then gets its 408."""
    with _connect(served) as sock:
        for _ in range(3):
            sock.sendall(_good_request())
            assert [status for status, _ in _read_answers(sock, 1)] == [200]
        sock.sendall(b"POST /v2/mod")
        answer = read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == b"408", answer
    message = orjson.loads(body)["error"]
    assert f"request head did not arrive in full within {KEEP_ALIVE_S} s" in message


def test_pipelined_fast_and_asgi_requests_then_a_stalled_body_gets_408(
    served: ServedProcess,
) -> None:
    """Fast and ASGI requests pipelined in one write are answered in order; a body that
    then stops arriving gets a 408 naming the body."""
    ready = b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"
    body = orjson.dumps(
        {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": X[:4]}]}
    )
    stalled = b"POST /v2/models/good/infer HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (len(body) + 5)
    with _connect(served) as sock:
        sock.sendall(_good_request() + ready + _good_request() + ready)
        statuses = [status for status, _ in _read_answers(sock, 4)]
        assert statuses == [200, 200, 200, 200]
        sock.sendall(stalled + body)
        answer = read_until_closed(sock)
    head, _, error = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == b"408", answer
    assert "request body did not arrive in full" in orjson.loads(error)["error"]


def test_an_answer_longer_than_the_keep_alive_wait_keeps_its_connection(
    served: ServedProcess,
) -> None:
    """The timer armed at connect fires while the model works past timeout_keep_alive: the
    answer arrives and the connection serves the next request, then closes idle."""
    body = orjson.dumps(
        {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": X[:4]}]}
    )
    with _connect(served) as sock:
        sock.sendall(_post(b"/v2/models/sleepy/infer", body))
        assert [status for status, _ in _read_answers(sock, 1)] == [200]
        sock.sendall(_good_request())
        assert [status for status, _ in _read_answers(sock, 1)] == [200]
        assert read_until_closed(sock) == b""  # idle: closed without a word


def test_versioned_and_wrong_version_urls_are_routed_each_time(served: ServedProcess) -> None:
    """The route cache keeps only served URLs: a wrong version stays a 404 however often it
    is asked, and the versioned URL of the right one is answered on the fast path."""
    base = f"http://{served.http_url}/v2/models/good"
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": X[:4]}]}
    with httpx.Client(timeout=30) as client:
        for _ in range(3):
            assert client.post(f"{base}/versions/1/infer", json=body).status_code == 200
            assert client.post(f"{base}/versions/2/infer", json=body).status_code == 404
            assert client.post(f"{base}/infer", json=body).status_code == 200
            missing = client.post(f"http://{served.http_url}/v2/models/nope/infer", json=body)
            assert missing.status_code == 404
