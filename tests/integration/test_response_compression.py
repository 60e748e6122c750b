"""Compressed infer answers, as Triton gives them: a request with ``Accept-Encoding``
(``tritonclient``'s ``response_compression_algorithm``) gets its successful answer gzip-
or zlib-compressed with ``Content-Encoding``, on the fast path and the ASGI path alike;
small answers, errors and requests that do not ask go back plain. Read on the wire with
``http.client``, which never inflates, and through ``tritonclient``."""

from __future__ import annotations

import gzip
import http.client
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient

from .conftest import DOUBLER_CONFIG, ServedProcess, start_served_process

CONFIG = DOUBLER_CONFIG
INFLATE = {"gzip": gzip.decompress, "deflate": zlib.decompress}
# No query string: the HTTP infer fast path; a query string: the ASGI path.
PATHS = {"fast": "/v2/models/doubler/infer", "asgi": "/v2/models/doubler/infer?via=asgi"}
WIDTH = 1000  # 4000 bytes of FP32 out: over the 1 KiB below which nothing is compressed


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    process = start_served_process(CONFIG, tmp_path_factory.mktemp("compression"))
    try:
        yield process
    finally:
        assert process.stop() == 0, process.output()
        assert "Traceback" not in process.output(), process.output()


def _post(
    served: ServedProcess, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, str], bytes]:
    host, port = served.http_url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        answer = {k.lower(): v for k, v in response.getheaders()}
        return response.status, answer, response.read()
    finally:
        connection.close()


def _json_body(values: list[float], *, binary_output: bool = False) -> bytes:
    document: dict[str, Any] = {
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, len(values)], "data": values}
        ]
    }
    if binary_output:
        document["outputs"] = [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]
    return orjson.dumps(document)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary_output", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("path", list(PATHS), ids=list(PATHS))
def test_answer_is_compressed_as_asked_and_inflates_to_the_plain_one(
    served: ServedProcess, algorithm: str, binary_output: bool, path: str
) -> None:
    values = [float(k % 97) / 4 for k in range(WIDTH)]
    body = _json_body(values, binary_output=binary_output)
    status, plain_headers, plain = _post(served, PATHS[path], body, {})
    assert status == 200
    assert "content-encoding" not in plain_headers
    status, headers, packed = _post(served, PATHS[path], body, {"Accept-Encoding": algorithm})
    assert status == 200, packed
    assert headers["content-encoding"] == algorithm
    assert headers["vary"] == "accept-encoding"  # a cache in between keys on it
    assert int(headers["content-length"]) == len(packed) < len(plain)
    assert INFLATE[algorithm](packed) == plain
    if binary_output:  # counts the JSON header before compression, as Triton's does
        length = int(headers["inference-header-content-length"])
        assert length == int(plain_headers["inference-header-content-length"])
        answer = INFLATE[algorithm](packed)
        assert orjson.loads(answer[:length])["outputs"][0]["parameters"]["binary_data_size"] == (
            4 * WIDTH
        )
        doubled = np.frombuffer(answer[length:], dtype=np.float32)
        assert doubled.tolist() == [2 * v for v in values]
    else:
        document = orjson.loads(INFLATE[algorithm](packed))
        assert document["outputs"][0]["data"] == [2 * v for v in values]


@pytest.mark.parametrize("accept", ["gzip;q=0", "identity;q=1, gzip;q=0.5", "br", "identity"])
@pytest.mark.parametrize("path", list(PATHS), ids=list(PATHS))
def test_answer_stays_plain_when_no_coding_is_acceptable(
    served: ServedProcess, accept: str, path: str
) -> None:
    body = _json_body([1.0] * WIDTH)
    status, headers, answer = _post(served, PATHS[path], body, {"Accept-Encoding": accept})
    assert status == 200
    assert "content-encoding" not in headers
    assert orjson.loads(answer)["outputs"][0]["data"] == [2.0] * WIDTH


@pytest.mark.parametrize("path", list(PATHS), ids=list(PATHS))
def test_small_answers_and_errors_stay_plain(served: ServedProcess, path: str) -> None:
    gzip_only = {"Accept-Encoding": "gzip"}
    status, headers, answer = _post(served, PATHS[path], _json_body([1.0, 2.0]), gzip_only)
    assert (status, headers.get("content-encoding")) == (200, None)
    assert orjson.loads(answer)["outputs"][0]["data"] == [2.0, 4.0]
    wrong = orjson.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "INT8", "shape": [1, 1], "data": [1]}]}
    )
    status, headers, answer = _post(served, PATHS[path], wrong, gzip_only)
    assert (status, headers.get("content-encoding")) == (400, None)
    assert "INT8" in orjson.loads(answer)["error"]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("query", [None, {"via": "asgi"}], ids=["fast", "asgi"])
def test_tritonclient_reads_compressed_answers(
    served: ServedProcess, algorithm: str, binary: bool, query: dict[str, str] | None
) -> None:
    client = httpclient.InferenceServerClient(served.http_url)
    try:
        data = np.arange(2 * WIDTH, dtype=np.float32).reshape(2, WIDTH)
        tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data, binary_data=binary)
        wanted = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
        result = client.infer(
            "doubler",
            [tensor],
            outputs=[wanted],
            query_params=query,
            response_compression_algorithm=algorithm,
        )
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)
        assert result.get_response() is not None
    finally:
        client.close()


def test_other_endpoints_are_never_compressed(served: ServedProcess) -> None:
    host, port = served.http_url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        for path in ("/v2/models/doubler/config", "/v2/models/doubler/stats", "/v2"):
            connection.request("GET", path, headers={"Accept-Encoding": "gzip"})
            response = connection.getresponse()
            body = response.read()
            assert response.status == 200
            assert response.getheader("content-encoding") is None, path
            assert orjson.loads(body)
    finally:
        connection.close()
