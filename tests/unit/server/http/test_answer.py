"""The bytes of an answer (carpool.server.http.answer): status lines, heads shared by
answers of one shape, chunks, and the date of the default headers."""

from __future__ import annotations

from carpool.server.http.answer import (
    STATUS_LINE,
    AnswerHeads,
    DateHeader,
    answer_head,
    chunk,
)

JSON_TYPE = ((b"content-type", b"application/json"),)


def test_status_lines_carry_the_reason_phrase() -> None:
    assert STATUS_LINE[200] == b"HTTP/1.1 200 OK\r\n"
    assert STATUS_LINE[431] == b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    assert STATUS_LINE[599] == b"HTTP/1.1 599 \r\n"  # no phrase for it


def test_answer_heads_are_written_again_for_new_default_headers() -> None:
    heads = AnswerHeads()
    first = [(b"date", b"1")]
    ok = heads.head(first, 200, JSON_TYPE, 10, True)
    assert ok == (
        b"HTTP/1.1 200 OK\r\ndate: 1\r\ncontent-type: application/json\r\n"
        b"content-length: 10\r\n\r\n"
    )
    assert heads.head(first, 200, JSON_TYPE, 10, True) is ok
    assert heads.head(first, 200, JSON_TYPE, 10, False).endswith(b"connection: close\r\n\r\n")
    assert b"date: 2" in heads.head([(b"date", b"2")], 200, JSON_TYPE, 10, True)


def test_a_streamed_answer_is_chunked_and_each_chunk_framed() -> None:
    head = answer_head([], 200, JSON_TYPE, None, True)
    assert head.endswith(b"transfer-encoding: chunked\r\n\r\n")
    assert b"content-length" not in head
    assert chunk(b"data: {}\n\n") == b"a\r\ndata: {}\n\n\r\n"


def test_the_date_is_a_new_list_only_when_the_second_changes() -> None:
    now_s = [1_700_000_000.25]
    date = DateHeader(lambda: now_s[0])
    assert date.headers == [(b"date", b"Tue, 14 Nov 2023 22:13:20 GMT")]
    before = date.headers
    now_s[0] += 0.5  # the same second
    date.tick()
    assert date.headers is before
    now_s[0] += 0.5  # the next one
    date.tick()
    assert date.headers == [(b"date", b"Tue, 14 Nov 2023 22:13:21 GMT")]
