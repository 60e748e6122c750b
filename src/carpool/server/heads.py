"""HTTP/1.1 heads the infer fast path keeps: a request head a client repeats, and the
status line and header fields of answers of one shape.

A client sends the same head (request line and header fields) for every request of one
shape: wrk does, and so does ``tritonclient`` for one input shape. A head's parse depends
on its bytes alone, so the protocol (:mod:`carpool.server.fasthttp`) keeps the head of a
connection's last fast-path request as a :class:`RepeatedHead`, and takes a later read
that starts with those bytes without the parser and its callbacks.
"""

from __future__ import annotations

from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from carpool.server.infer import Headers

MAX_REPEATED_HEAD_BYTES = 4096
MAX_ANSWER_HEADS = 256


@dataclass(frozen=True, slots=True)
class RepeatedHead:
    """A fast-path request's head, byte for byte, and what the parser made of it.

    A later request on the connection whose bytes start with ``head`` (the parser between
    two messages) has this request line and these header fields; its body is the ``size``
    bytes after them, as the head's Content-Length said.
    """

    head: bytes
    size: int  # the body's Content-Length
    url: bytes
    header_length: bytes | None  # Inference-Header-Content-Length
    encoding: bytes | None  # the answer's Content-Encoding, None: identity
    http_version: str
    path: str  # ``url`` decoded, as a request's path is kept for the access log


def repeated_head(
    chunk: bytes,
    url: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    header_length: bytes | None,
    encoding: bytes | None,
    http_version: str,
) -> RepeatedHead | None:
    """The head of the first request parsed from ``chunk`` (a read that began between two
    messages), to take later requests without the parser; None unless its parse is all in
    its bytes: a Content-Length body, the request whole in the read, lines ending in CRLF
    (the parser takes a bare LF too), the head ending at the first empty line, where the
    parser ended it, and ``body`` following it byte for byte.

    ``headers`` are the request's fields as the protocol keeps them (names lowercase). The
    caller keeps only keep-alive requests without ``Expect``: the parser tracks more for
    the others.
    """
    size = len(body)
    lengths = [value for name, value in headers if name == b"content-length"]
    if lengths != [b"%d" % size] or any(name == b"transfer-encoding" for name, _ in headers):
        return None
    end = chunk.find(b"\r\n\r\n") + 4
    if end < 4 or end > MAX_REPEATED_HEAD_BYTES or end + size > len(chunk):
        return None
    head = chunk[:end]
    if not head.startswith(b"POST %s HTTP/" % url):
        return None
    if head.count(b"\n") != head.count(b"\r\n") or chunk[end : end + size] != body:
        return None
    path = url.decode("latin-1")
    return RepeatedHead(head, size, url, header_length, encoding, http_version, path)


class AnswerHeads:
    """Status lines and header fields of answers, by (status, headers, body length,
    keep-alive), with the server's default headers they were written with: uvicorn
    replaces those (the date among them) every second, and a head written with others is
    written again. Shared by a server's connections; bounded."""

    __slots__ = ("_heads",)

    def __init__(self) -> None:
        self._heads: dict[tuple[int, Headers, int, bool], tuple[object, bytes]] = {}

    def head(
        self,
        defaults: list[tuple[bytes, bytes]],
        status: int,
        headers: Headers,
        length: int,
        keep_alive: bool,
    ) -> bytes:
        key = (status, headers, length, keep_alive)
        heads = self._heads
        kept = heads.get(key)
        if kept is not None and kept[0] is defaults:
            return kept[1]
        parts = [STATUS_LINE[status]]
        for name, value in (*defaults, *headers):
            parts += (name, b": ", value, b"\r\n")
        parts += (b"content-length: ", b"%d" % length, b"\r\n")
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        head = b"".join(parts)
        if len(heads) >= MAX_ANSWER_HEADS:
            heads.clear()  # a new second (a new date) or many shapes: started again
        heads[key] = (defaults, head)
        return head
