"""Which coding an infer answer goes back in (``Accept-Encoding``, RFC 9110 12.5.3), and
the compressed bytes themselves."""

from __future__ import annotations

import gzip
import zlib

import pytest

from carpool.server.encoding import compress, response_encoding
from carpool.server.infer import compressed


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        (b"gzip", b"gzip"),  # tritonclient's response_compression_algorithm="gzip"
        (b"deflate", b"deflate"),
        (b"gzip, deflate", b"gzip"),  # httpx's default: a tie, the first named
        (b"deflate, gzip", b"deflate"),
        (b"GZip", b"gzip"),
        (b"x-gzip", b"gzip"),
        (b"deflate;q=0.9, gzip;q=0.5", b"deflate"),
        (b"gzip;q=0.5, deflate;q=0.9", b"deflate"),
        (b"gzip; q=0.8", b"gzip"),
        (b"*", b"gzip"),
        (b"*;q=0.3", b"gzip"),
        (b"*;q=0", None),
        (b"gzip;q=0, *", b"deflate"),  # * stands for the codings not named
        (b"gzip;q=0, deflate;q=0, *", None),
        (b"br, zstd, gzip", b"gzip"),
        (b"gzip;q=0", None),
        (b"gzip;q=0.000", None),
        (b"identity", None),
        (b"identity;q=1, gzip;q=0.5", None),  # identity weighed higher
        (b"gzip, identity", b"gzip"),
        (b"identity, gzip", None),
        (b"br", None),
        (b"", None),
        (b" , ,", None),
        (b"gzip;q=abc", None),  # a malformed weight: never compressed by a guess
        (b"gzip;q=7", b"gzip"),  # out of range: clamped to 1
    ],
)
def test_response_encoding_weighs_what_the_client_accepts(
    accept: bytes, chosen: bytes | None
) -> None:
    assert response_encoding(accept) == chosen


@pytest.mark.parametrize(
    ("encoding", "inflate"),
    [(b"gzip", gzip.decompress), (b"deflate", zlib.decompress)],  # deflate: zlib's wrapper
)
def test_compress_writes_what_http_clients_inflate(encoding: bytes, inflate: object) -> None:
    body = b'{"outputs":[' + b"1.5," * 2000 + b"2]}"
    packed = compress(body, encoding)
    assert len(packed) < len(body)
    assert inflate(packed) == body  # type: ignore[operator]


def test_compressed_leaves_small_failed_and_unasked_answers_as_they_are() -> None:
    big = b"x" * 4096
    headers = ((b"content-type", b"application/json"),)
    assert compressed((200, big, headers), None) == (200, big, headers)
    assert compressed((200, b"x" * 1023, headers), b"gzip") == (200, b"x" * 1023, headers)
    assert compressed((400, big, headers), b"gzip") == (400, big, headers)
    status, body, new_headers = compressed((200, big, headers), b"gzip")
    assert status == 200
    assert gzip.decompress(body) == big
    assert new_headers == (*headers, (b"content-encoding", b"gzip"))
