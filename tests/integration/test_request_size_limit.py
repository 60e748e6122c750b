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

import httpx
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


def _the_413(answer: bytes, size: int, limit: int = LIMIT) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"connection: close" in head
    assert orjson.loads(body)["error"] == (
        f"request body of {size} bytes exceeds the limit of {limit} bytes "
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
    the client's send failed with a reset (as a client that sends the body whole
    before it reads reports it) instead of reading the answer."""
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


def _one_answer(sock: socket.socket) -> bytes:
    """One answer's bytes (a Content-Length body), read without waiting for the close."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _infer_count(served: ServedProcess) -> int:
    stats = httpx.get(f"http://{served.http_url}/v2/models/doubler/stats").json()
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


@pytest.mark.parametrize("path", PATHS)
def test_nothing_after_a_413_on_the_same_connection_is_acted_on(
    start_server: StartServer, path: str
) -> None:
    """Was (review): after the lingering close began, the requests parsed from the same
    read still ran: an infer reached the model (its answer then failed to be written) and
    a policy change was applied, unanswered. A small limit, so that all of it arrives in
    one read: the requests after the 413 are parsed, not dropped unread."""
    args = ["--max-request-bytes", "1000", "--allow-policy-updates"]  # a change that could apply
    served = start_server(DOUBLER_CONFIG, args=args)
    before = _infer_count(served)
    policy = b'{"max_delay_s": 0.25}'
    after = [
        _head(len(body := _json_body([1.0])), b"") + body,
        b"POST /v2/models/doubler/policy HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s"
        % (len(policy), policy),
        _head(100, b"") + b"{",  # cut short
    ]
    size = 1001
    with _connect(served.http_url) as sock:
        sock.sendall(_head(size, PATHS[path]) + b"\0" * size + b"".join(after))
        # Read the 413 without closing: a client gone would hide what the server does next.
        answer = _one_answer(sock)
        _the_413(answer, size, limit=1000)
        current = httpx.get(f"http://{served.http_url}/v2/models/doubler/policy").json()
        assert current["max_delay_s"] == 0.001
        assert _infer_count(served) == before
        assert read_until_closed(sock) == b""  # nothing more: a FIN after the 413
    assert served.stop() == 0  # drains what was queued: a write after the FIN would be logged
    assert "Traceback" not in served.output() and "Exception" not in served.output()


@pytest.mark.parametrize("path", PATHS)
def test_a_content_length_with_thousands_of_leading_zeros_is_served(
    served: ServedProcess, path: str
) -> None:
    """Was (review): int() refuses over 4300 digits: the fast path answered 400 and the
    ASGI path 500 to a length llhttp accepts."""
    body = _json_body([3.0])
    data = gzip.compress(body) if path == "asgi" else body
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: %s%d\r\n" % (
        INFER,
        b"0" * 4400,
        len(data),
    )
    with _connect(served.http_url) as sock:
        sock.sendall(head + PATHS[path] + b"\r\n" + data)
        answer = read_until_closed(sock)
    head_out, _, payload = answer.partition(b"\r\n\r\n")
    assert head_out.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert orjson.loads(payload)["outputs"][0]["data"] == [6.0]
