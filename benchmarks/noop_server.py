"""A no-op HTTP/1.1 endpoint: any request, any path, answered 200 with ``{}`` at once;
``GET /v1/models`` lists one model, ``noop`` (``carpool bench`` checks an OpenAI model
is listed before it runs).

What a load generator is measured against: it does as little per request as an HTTP
server can in Python (uvloop, an asyncio Protocol, httptools' request parser, one
pre-encoded answer, keep-alive), so whatever rate a client reaches is the client's.

    taskset -c 0 .venv/bin/python benchmarks/noop_server.py --port 8099
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import cast

import httptools
import uvloop

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
MODELS = b'{"object":"list","data":[{"id":"noop","object":"model"}]}'
MODELS_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    % (len(MODELS), MODELS)
)


class NoopProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url += url  # a URL may come in parts

    def on_message_complete(self) -> None:
        assert self._transport is not None
        self._transport.write(MODELS_RESPONSE if self._url == b"/v1/models" else RESPONSE)
        self._url = b""


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(NoopProtocol, host, port, backlog=4096)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set_result, None)
    print(f"noop server on http://{host}:{port}", flush=True)
    async with server:
        await stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8099)
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
