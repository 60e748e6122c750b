"""`carpool serve --max-request-bytes`: the largest HTTP body and gRPC message.

A body whose declared length is over the limit is refused from its head (413), before any
of it is read and without the ``100 Continue`` that would ask for it, on the fast infer
path and on the ASGI one (a compressed body). A client that sends its body all the same
still reads the 413: the server half-closes and drops what follows until the client is
done, instead of closing into a reset. The tests whose docstrings start "Was:" failed
before the change they name.
"""

from __future__ import annotations

import gzip
import socket
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import DOUBLER_CONFIG, ServedProcess, StartServer, read_until_closed

LIMIT = 100_000
INFER = b"/v2/models/doubler/infer"
# Far more than loopback's socket buffers hold: closed at once, the server would have
# left most of it unread, and the kernel would answer it with a reset.
SENT_ANYWAY_BYTES = 32 * 1024 * 1024
PATHS = {  # the fast infer path; a compressed body, which uvicorn's ASGI path inflates
    "fast": b"",
    "asgi": b"Content-Encoding: gzip\r\n",
}


@pytest.fixture
def served(start_server: StartServer) -> ServedProcess:
    return start_server(DOUBLER_CONFIG, grpc=True, args=["--max-request-bytes", str(LIMIT)])


def _connect(url: str) -> socket.socket:
    host, port = url.split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _head(length: int, extra: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n%s\r\n" % (INFER, length, extra)


def _the_413(answer: bytes, size: int) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"connection: close" in head
    assert orjson.loads(body)["error"] == (
        f"request body of {size} bytes exceeds the limit of {LIMIT} bytes "
        "(carpool serve --max-request-bytes)"
    )


def _json_body(values: list[float]) -> bytes:
    tensor = {"name": "INPUT0", "shape": [1, len(values)], "datatype": "FP32", "data": values}
    return orjson.dumps({"inputs": [tensor]})


@pytest.mark.parametrize("path", PATHS)
def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_asked_for(
    served: ServedProcess, path: str
) -> None:
    """Was: the fast path answered ``Expect: 100-continue`` with 100 Continue and read
    the body up to the limit before its 413; the ASGI path asked for it too."""
    size = LIMIT + 1
    with _connect(served.http_url) as sock:
        sock.sendall(_head(size, PATHS[path] + b"Expect: 100-continue\r\n"))
        answer = read_until_closed(sock)  # no body sent: the answer comes from the head
    _the_413(answer, size)


@pytest.mark.parametrize("path", PATHS)
def test_a_client_that_sends_its_whole_body_anyway_reads_the_413(
    served: ServedProcess, path: str
) -> None:
    """Was: the connection was closed right after the 413 while the body still came, so
    the client's send failed with a reset (as `requests`, which sends the body whole
    before it reads, reports it) instead of reading the answer."""
    with _connect(served.http_url) as sock:
        sock.sendall(_head(SENT_ANYWAY_BYTES, PATHS[path]))
        sock.sendall(b"\0" * SENT_ANYWAY_BYTES)  # raises on a reset
        sock.shutdown(socket.SHUT_WR)
        answer = read_until_closed(sock)
    _the_413(answer, SENT_ANYWAY_BYTES)


def test_bodies_within_the_limit_are_served_on_both_paths(served: ServedProcess) -> None:
    values = [float(i) for i in range(1000)]
    body = _json_body(values)
    assert len(body) < LIMIT
    for extra, data in [(b"", body), (PATHS["asgi"], gzip.compress(body))]:
        with _connect(served.http_url) as sock:
            sock.sendall(_head(len(data), extra + b"Connection: close\r\n") + data)
            answer = read_until_closed(sock)
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), answer[:300]
        assert orjson.loads(payload)["outputs"][0]["data"] == [2 * v for v in values]


def _refused_then_served(module: Any, client: Any, size_bytes: int) -> InferenceServerException:
    """What ``client`` raised for an input of ``size_bytes``; a small one after it is served."""
    big = np.ones((1, size_bytes // 4), dtype=np.float32)
    tensor = module.InferInput("INPUT0", list(big.shape), "FP32")
    tensor.set_data_from_numpy(big)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("doubler", [tensor])
    small = np.arange(4, dtype=np.float32).reshape(1, 4)
    tensor = module.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(small)
    np.testing.assert_array_equal(client.infer("doubler", [tensor]).as_numpy("OUTPUT0"), small * 2)
    return caught.value


def test_tritonclient_http_gets_the_413_and_its_next_request_is_served(
    served: ServedProcess,
) -> None:
    """Was (with an input far over the socket buffers): the client's send of the body
    failed with a reset, not the server's message."""
    client = httpclient.InferenceServerClient(served.http_url)
    try:
        error = _refused_then_served(httpclient, client, SENT_ANYWAY_BYTES)
    finally:
        client.close()
    assert f"exceeds the limit of {LIMIT} bytes" in str(error)


def test_a_grpc_message_over_the_limit_is_resource_exhausted(served: ServedProcess) -> None:
    assert served.grpc_url is not None
    client = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        error = _refused_then_served(grpcclient, client, LIMIT + 4)
    finally:
        client.close()
    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert f"vs. {LIMIT})" in error.message()
