"""Which request heads are kept to be taken again without the parser
(`carpool.server.heads.repeated_head`), and the answer heads shared by connections."""

from __future__ import annotations

import pytest

from carpool.server.heads import MAX_REPEATED_HEAD_BYTES, AnswerHeads, repeated_head

URL = b"/v2/models/m/infer"
BODY = b'{"inputs":[]}'
HEAD = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (URL, len(BODY))
HEADERS = [(b"host", b"t"), (b"content-length", b"%d" % len(BODY))]


def _kept(chunk: bytes, headers: list[tuple[bytes, bytes]] = HEADERS, body: bytes = BODY) -> bool:
    return repeated_head(chunk, URL, headers, body, None, None, "1.1") is not None


def test_a_plain_request_is_kept_with_what_it_parsed_to() -> None:
    repeat = repeated_head(HEAD + BODY + b"POST", URL, HEADERS, BODY, b"12", b"gzip", "1.1")
    assert repeat is not None
    assert (repeat.head, repeat.size, repeat.url) == (HEAD, len(BODY), URL)
    assert (repeat.header_length, repeat.encoding, repeat.http_version) == (b"12", b"gzip", "1.1")


@pytest.mark.parametrize(
    ("chunk", "headers", "body"),
    [
        pytest.param(HEAD + BODY[:-1], HEADERS, BODY, id="the body not whole in the read"),
        pytest.param(HEAD + b"x" + BODY, HEADERS, BODY, id="the body not right after the head"),
        pytest.param(
            HEAD + BODY, [*HEADERS, (b"transfer-encoding", b"chunked")], BODY, id="chunked"
        ),
        pytest.param(
            HEAD + BODY, [*HEADERS, (b"content-length", b"13")], BODY, id="two content-lengths"
        ),
        pytest.param(HEAD + BODY, [(b"host", b"t")], BODY, id="no content-length"),
        pytest.param(b"\r\n" + HEAD + BODY, HEADERS, BODY, id="a blank line first"),
        pytest.param(HEAD.replace(b"POST", b"PUT", 1) + BODY, HEADERS, BODY, id="another line"),
        pytest.param(
            HEAD.replace(b"Host: t\r\n", b"Host: t\n") + BODY, HEADERS, BODY, id="a bare LF"
        ),
        pytest.param(b"\r\n\r\n" + HEAD, HEADERS, b"", id="an empty head"),
    ],
)
def test_heads_whose_parse_is_not_all_in_their_bytes_are_not_kept(
    chunk: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    if body == b"":
        headers = [(b"content-length", b"0")]
    assert not _kept(chunk, headers, body)


def test_heads_over_the_limit_are_not_kept() -> None:
    padding = b"x" * MAX_REPEATED_HEAD_BYTES
    head = HEAD.replace(b"Host: t", b"Host: " + padding)
    headers = [(b"host", padding), HEADERS[1]]
    assert not _kept(head + BODY, headers)


def test_answer_heads_are_written_again_for_new_default_headers() -> None:
    heads = AnswerHeads()
    first = [(b"date", b"1")]
    json_type = ((b"content-type", b"application/json"),)
    ok = heads.head(first, 200, json_type, 10, True)
    assert ok == (
        b"HTTP/1.1 200 OK\r\ndate: 1\r\ncontent-type: application/json\r\n"
        b"content-length: 10\r\n\r\n"
    )
    assert heads.head(first, 200, json_type, 10, True) is ok
    assert heads.head(first, 200, json_type, 10, False).endswith(b"connection: close\r\n\r\n")
    assert b"date: 2" in heads.head([(b"date", b"2")], 200, json_type, 10, True)
