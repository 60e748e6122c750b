"""Refusing a connection's bytes, and closing after an answer while the client sends.

A refusal answers bytes that cannot be a request (a parser error, a head past its
limits, the server past ``--max-connections``, a request that stalled): an error answer,
then the connection closes, as what follows in the stream cannot be trusted to start a
request. Requests received before the bad bytes are answered first, in order.

A connection closed while its client may still be sending its body (a 413 before the
body was read) is half-closed instead: the answer goes out with a FIN, and what the
client goes on sending is read and dropped for at most :data:`LINGER_S`, until it closes
its side. Closed at once, the kernel would answer those bytes with a reset, and a client
still writing its body would see "connection reset" instead of the answer (nginx's
lingering close, 5 s as its lingering_timeout).
"""

from __future__ import annotations

import asyncio

import orjson

from carpool.server.http.answer import STATUS_LINE

LINGER_S = 5.0


class Refused(Exception):
    """Raised from a parser callback: answer ``status`` with ``message`` and close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def refusal_answer(status: int, message: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The whole answer refusing a connection's bytes: ``{"error": message}``, closing; a
    503 (a server limit) says when to come back."""
    body = orjson.dumps({"error": message})
    parts = [STATUS_LINE[status]]
    for name, value in default_headers:
        parts += (name, b": ", value, b"\r\n")
    parts += (b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body))
    if status == 503:
        parts.append(b"retry-after: 1\r\n")
    parts += (b"connection: close\r\n\r\n", body)
    return b"".join(parts)


def can_write_eof(transport: asyncio.Transport) -> bool:
    try:
        return transport.can_write_eof()
    except NotImplementedError:  # asyncio's base transport: no half-close
        return False
