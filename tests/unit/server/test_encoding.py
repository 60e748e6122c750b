"""Which coding an infer answer goes back in (``Accept-Encoding``, RFC 9110 12.5.3), and
the compressed bytes themselves (answers compressed: test_infer.py)."""

from __future__ import annotations

import gzip
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.server.encoding import compress, response_encoding


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


# -- properties ---------------------------------------------------------------------------

_TOKENS = st.sampled_from(
    [b"gzip", b"x-gzip", b"deflate", b"identity", b"*", b"br", b"zstd", b"GZIP", b""]
)
_WEIGHTS = st.one_of(
    st.just(b""),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda q: b";q=%r" % q),
    st.binary(max_size=6).map(lambda raw: b";q=" + raw),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(_TOKENS, _WEIGHTS), max_size=6), st.binary(max_size=64))
def test_response_encoding_never_raises_and_only_picks_what_was_named_or_starred(
    items: list[tuple[bytes, bytes]], noise: bytes
) -> None:
    # A header is client input: whatever it holds, the answer is a coding carpool can
    # write (or none), and never one the client did not name or cover with "*".
    for accept in (b", ".join(name + weight for name, weight in items), noise):
        chosen = response_encoding(accept)
        assert chosen in (None, b"gzip", b"deflate")
        if chosen is not None:
            named = accept.lower()
            assert chosen in named or (chosen == b"gzip" and b"x-gzip" in named) or b"*" in named
