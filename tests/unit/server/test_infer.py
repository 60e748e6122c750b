"""The infer route's answers as the HTTP layer takes them: the KServe codec's REST face,
compressed as the client accepts, and failures as their status and error document."""

from __future__ import annotations

import gzip
import zlib

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.errors import InvalidInput
from carpool.server import infer
from carpool.server.infer import compressed, error_response
from carpool.server.kserve import rest


def test_the_http_layer_calls_the_codecs_rest_face() -> None:
    for name in ("prepare_infer", "infer_response", "InferPlans", "InferCall", "Headers"):
        assert getattr(infer, name) is getattr(rest, name), name


def test_compressed_leaves_small_failed_and_unasked_answers_as_they_are() -> None:
    big = b"x" * 4096
    headers = ((b"content-type", b"application/json"),)
    assert compressed((200, big, headers), None) == (200, big, headers)
    assert compressed((200, b"x" * 1023, headers), b"gzip") == (200, b"x" * 1023, headers)
    assert compressed((400, big, headers), b"gzip") == (400, big, headers)
    status, body, new_headers = compressed((200, big, headers), b"gzip")
    assert status == 200
    assert gzip.decompress(body) == big
    assert new_headers == (*headers, (b"content-encoding", b"gzip"), (b"vary", b"accept-encoding"))


def test_a_failure_is_its_status_and_an_error_document() -> None:
    status, body, headers = error_response(InvalidInput("input 'x': shape [2]"))
    assert status == 400
    assert orjson.loads(body) == {"error": "input 'x': shape [2]"}
    assert headers == ((b"content-type", b"application/json"),)


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=20_000), st.sampled_from([b"gzip", b"deflate"]))
def test_compressed_answers_always_inflate_to_the_plain_one(body: bytes, encoding: bytes) -> None:
    headers = ((b"content-type", b"application/json"),)
    status, packed, new_headers = compressed((200, body, headers), encoding)
    assert status == 200
    if len(body) < 1024:
        assert (packed, new_headers) == (body, headers)
    else:
        inflate = gzip.decompress if encoding == b"gzip" else zlib.decompress
        assert inflate(packed) == body
        assert new_headers[-2:] == ((b"content-encoding", encoding), (b"vary", b"accept-encoding"))
