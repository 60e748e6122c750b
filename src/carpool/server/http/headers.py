"""The one reader of a request's header fields, for the protocol and the ASGI app alike.

A request's fields are read once, where its head is complete, into a
:class:`RequestHeaders`: the first value of each field carpool acts on (as Triton and the
ASGI app always read them), names matched lowercase. Everything else is left alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

CONTENT_LENGTH = b"content-length"
TRANSFER_ENCODING = b"transfer-encoding"


@dataclass(slots=True)
class RequestHeaders:
    """The fields of one request head that carpool reads (None: not sent)."""

    content_length: bytes | None = None
    content_encoding: bytes | None = None  # a compressed body, inflated before decoding
    accept: bytes | None = None  # /metrics: OpenMetrics or the text format
    accept_encoding: bytes | None = None  # the answer's compression
    authorization: bytes | None = None  # the API key (server/access.py)
    header_length: bytes | None = None  # Inference-Header-Content-Length (binary tensors)


def read_headers(fields: Iterable[tuple[bytes, bytes]]) -> RequestHeaders:
    """The first value of each field of ``fields`` (lowercase names) carpool reads."""
    length = encoding = accept = accept_encoding = authorization = header_length = None
    for name, value in fields:
        if name == b"inference-header-content-length":
            if header_length is None:
                header_length = value
        elif name == CONTENT_LENGTH:
            if length is None:
                length = value
        elif name == b"accept-encoding":
            if accept_encoding is None:
                accept_encoding = value
        elif name == b"content-encoding":
            if encoding is None:
                encoding = value
        elif name == b"authorization":
            if authorization is None:
                authorization = value
        elif name == b"accept" and accept is None:
            accept = value
    return RequestHeaders(length, encoding, accept, accept_encoding, authorization, header_length)


def declared_length(value: bytes | None) -> int | None:
    """A ``Content-Length`` value as a number; None when there is none or it is not one.
    llhttp lets through any number of leading zeros (and whitespace around the digits),
    which ``int()`` alone refuses past 4300 digits; it refuses values over 2**64 - 1."""
    if value is None:
        return None
    digits = value.strip().lstrip(b"0") or b"0"
    return int(digits) if len(digits) <= 20 and digits.isdigit() else None
