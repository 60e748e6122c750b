"""The load generator's HTTP client against a real tiny server on 127.0.0.1 (started and
stopped by each test), and the Server-Sent Events parser."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from carpool.errors import ConfigError
from carpool.server.http.guards import host_refusal
from carpool.tools.httpclient import (
    HttpClient,
    SseParser,
    encode_request,
    host_header,
    json_error_message,
    split_url,
)

Handler = Callable[[str, str, bytes], list[bytes]]


class TinyServer:
    """HTTP/1.1 keep-alive on a free loopback port; ``handler(method, path, body)`` returns
    the raw response parts, written one by one (a stream)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.num_connections = 0
        self.max_open = 0
        self.requests: list[tuple[str, str, bytes]] = []
        self._open = 0
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        self._open += 1
        self.max_open = max(self.max_open, self._open)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = dict(line.split(": ", 1) for line in lines[1:] if line)
                body = await reader.readexactly(int(headers.get("Content-Length", "0")))
                self.requests.append((method, path, body))
                parts = self.handler(method, path, body)
                for part in parts:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0)
                if parts and b"Connection: close" in parts[0]:
                    return
        finally:
            self._open -= 1
            writer.close()


@asynccontextmanager
async def tiny_server(handler: Handler) -> AsyncIterator[TinyServer]:
    server = TinyServer(handler)
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    server.port = listener.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listener.close()
        await listener.wait_closed()


def ok(body: bytes = b"{}", status: str = "200 OK", extra: str = "") -> list[bytes]:
    head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return [head.encode() + body]


def echo(method: str, path: str, body: bytes) -> list[bytes]:
    return ok(f"{method} {path} {len(body)}".encode())


async def test_keep_alive_reuses_one_connection() -> None:
    async with tiny_server(echo) as server:
        client = HttpClient("127.0.0.1", server.port)
        try:
            for _ in range(5):
                request = encode_request("POST", "h", "/x", b"abc")
                response = await client.request(request)
                assert (response.status, response.body) == (200, b"POST /x 3")
        finally:
            await client.close()
    assert server.num_connections == 1
    assert len(server.requests) == 5


async def test_chunked_body_is_reassembled_and_streamed_to_a_sink() -> None:
    def chunked(method: str, path: str, body: bytes) -> list[bytes]:
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        return [head, b"5\r\nhello\r\n", b"6\r\n world\r\n", b"0\r\n\r\n"]

    async with tiny_server(chunked) as server:
        client = HttpClient("127.0.0.1", server.port)
        try:
            assert (await client.get("/")).body == b"hello world"
            pieces: list[bytes] = []
            streamed = await client.request(encode_request("GET", "h", "/"), pieces.append)
        finally:
            await client.close()
    assert streamed.body == b""
    assert b"".join(pieces) == b"hello world"


async def test_connections_are_capped_and_requests_wait_for_one() -> None:
    async with tiny_server(echo) as server:
        client = HttpClient("127.0.0.1", server.port, max_connections=2)
        try:
            request = encode_request("GET", "h", "/")
            responses = await asyncio.gather(*(client.request(request) for _ in range(20)))
        finally:
            await client.close()
    assert all(r.status == 200 for r in responses)
    assert server.max_open <= 2
    assert server.num_connections <= 2


async def test_server_closing_fails_that_request_and_the_next_reconnects() -> None:
    calls = 0

    def close_first(method: str, path: str, body: bytes) -> list[bytes]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return ok(b"bye", extra="Connection: close\r\n")
        return ok()

    async with tiny_server(close_first) as server:
        client = HttpClient("127.0.0.1", server.port)
        try:
            first = await client.get("/")
            second = await client.get("/")
        finally:
            await client.close()
    assert (first.body, second.status) == (b"bye", 200)
    assert server.num_connections == 2


async def test_truncated_answer_raises_connection_error() -> None:
    def truncated(method: str, path: str, body: bytes) -> list[bytes]:
        return [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nConnection: close\r\n\r\nabc"]

    async with tiny_server(truncated) as server:
        client = HttpClient("127.0.0.1", server.port)
        try:
            with pytest.raises(ConnectionError, match="closed the connection"):
                await client.get("/")
            assert client.num_connections == 0
        finally:
            await client.close()


async def test_status_and_error_bodies_come_back() -> None:
    body = b'{"error": {"message": "model not found", "type": "x"}}'
    async with tiny_server(lambda m, p, b: ok(body, "404 Not Found")) as server:
        client = HttpClient("127.0.0.1", server.port)
        try:
            response = await client.get("/v1/embeddings")
        finally:
            await client.close()
    assert response.status == 404
    assert json_error_message(response.body) == "model not found"
    assert json_error_message(b'{"error": "bad shape"}') == "bad shape"
    assert json_error_message(b"oops") == "oops"


def test_encode_request_is_a_complete_http_11_request() -> None:
    data = encode_request("POST", "127.0.0.1:80", "/v1/x", b"{}", {"Content-Type": "a/b"})
    assert data == (
        b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:80\r\nContent-Type: a/b\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    assert b"Content-Length" not in encode_request("GET", "h", "/")


def test_split_url() -> None:
    assert split_url("http://127.0.0.1:8000") == ("127.0.0.1", 8000, "")
    assert split_url("http://example:81/prefix/") == ("example", 81, "/prefix")
    with pytest.raises(ConfigError, match="https is not supported"):
        split_url("https://example")


def test_client_refuses_zero_connections() -> None:
    with pytest.raises(ConfigError, match="max_connections"):
        HttpClient("127.0.0.1", 1, max_connections=0)


# -- Server-Sent Events --------------------------------------------------------------------


def test_sse_events_split_across_chunks() -> None:
    parser = SseParser()
    assert parser.feed(b'data: {"a": 1}\n') == []
    assert parser.feed(b"\ndata: [DO") == [b'{"a": 1}']
    assert parser.feed(b"NE]\n\n") == [b"[DONE]"]


def test_sse_crlf_multiline_data_and_comments() -> None:
    parser = SseParser()
    stream = b": keep-alive\r\n\r\nevent: x\r\ndata: one\r\ndata:two\r\n\r\ndata\r\n\r\n"
    assert parser.feed(stream) == [b"one\ntwo", b""]


def test_sse_crlf_split_between_chunks() -> None:
    parser = SseParser()
    assert parser.feed(b"data: a\r\n\r") == []
    assert parser.feed(b"\n") == [b"a"]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://[::1]:8000", "[::1]:8000"),
        ("http://127.0.0.1:8000/p", "127.0.0.1:8000"),
        ("http://localhost", "localhost:80"),
    ],
)
def test_the_host_header_of_a_url_is_one_the_server_takes(url: str, expected: str) -> None:
    """Was: an IPv6 host went out as ``Host: ::1:8000`` (``urlsplit().hostname`` drops the
    brackets), which the server refuses with 400 (RFC 9112 3.2): `carpool bench` against
    ``http://[::1]:...`` got 400 for every request."""
    host, port, _ = split_url(url)
    assert host_header(host, port) == expected
    assert host_refusal("1.1", [expected.encode()]) is None
    assert host_refusal("1.1", [host_header(host).encode()]) is None
