"""The one header reader (carpool.server.http.headers), as the protocol and the ASGI app
both use it."""

from __future__ import annotations

import pytest

from carpool.server.http.headers import declared_length, read_headers


def test_the_first_value_of_each_field_is_read() -> None:
    headers = read_headers(
        [
            (b"host", b"t"),
            (b"inference-header-content-length", b"7"),
            (b"inference-header-content-length", b"9"),
            (b"accept-encoding", b"gzip"),
            (b"accept-encoding", b"deflate"),
            (b"authorization", b"Bearer a"),
            (b"authorization", b"Bearer b"),
            (b"content-length", b"12"),
            (b"content-encoding", b"gzip"),
            (b"accept", b"application/openmetrics-text"),
        ]
    )
    assert (headers.header_length, headers.accept_encoding) == (b"7", b"gzip")
    assert (headers.authorization, headers.content_length) == (b"Bearer a", b"12")
    assert (headers.content_encoding, headers.accept) == (b"gzip", b"application/openmetrics-text")


def test_fields_not_sent_are_none() -> None:
    headers = read_headers([(b"host", b"t")])
    assert headers.content_length is None and headers.authorization is None


@pytest.mark.parametrize(
    ("value", "length"),
    [(None, None), (b"12", 12), (b" 0012 ", 12), (b"0" * 5000 + b"7", 7), (b"1" * 21, None),
     (b"x", None), (b"", 0)],
)  # fmt: skip
def test_a_declared_length_is_read_as_llhttp_takes_it(
    value: bytes | None, length: int | None
) -> None:
    assert declared_length(value) == length
