"""Request heads a client repeats, taken without the parser.

A client sends the same head (request line and header fields) for every request of one
shape: wrk does, and so does ``tritonclient`` for one input shape. A head's parse depends
on its bytes alone, so the protocol keeps the head of a connection's last fast-path
request as a :class:`RepeatedHead`, and takes a later read that starts with those bytes
without the parser and its callbacks.
"""

from __future__ import annotations

from dataclasses import dataclass

from carpool.server.http.headers import CONTENT_LENGTH, TRANSFER_ENCODING

MAX_REPEATED_HEAD_BYTES = 4096


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
    fields: list[tuple[bytes, bytes]],
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

    ``fields`` are the request's header fields as the protocol keeps them (names
    lowercase). The caller keeps only keep-alive requests without ``Expect``: the parser
    tracks more for the others.
    """
    size = len(body)
    lengths = [value for name, value in fields if name == CONTENT_LENGTH]
    if lengths != [b"%d" % size] or any(name == TRANSFER_ENCODING for name, _ in fields):
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
