"""The bytes of an answer: status line, header fields, body framing.

Every answer carries the server's default header fields (the ``date``, written again
once a second by :class:`DateHeader`) and a ``content-length``, or ``transfer-encoding:
chunked`` for a stream; ``connection: close`` when it ends the connection. Answers of one
shape (status, header fields, length, keep-alive) share their head
(:class:`AnswerHeads`), so an infer answer costs one concatenation and one write.
"""

from __future__ import annotations

import http
import time
from collections.abc import Callable
from email.utils import formatdate

from carpool.server.infer import Headers

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"
MAX_ANSWER_HEADS = 256
DefaultHeaders = list[tuple[bytes, bytes]]


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


STATUS_LINE = {status: _status_line(status) for status in range(100, 600)}


def answer_head(
    defaults: DefaultHeaders, status: int, headers: Headers, length: int | None, keep_alive: bool
) -> bytes:
    """The status line and header fields of an answer whose body has ``length`` bytes
    (None: sent in chunks as it comes)."""
    parts = [STATUS_LINE[status]]
    for name, value in (*defaults, *headers):
        parts += (name, b": ", value, b"\r\n")
    if length is None:
        parts.append(b"transfer-encoding: chunked\r\n")
    else:
        parts += (b"content-length: ", b"%d" % length, b"\r\n")
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def chunk(data: bytes) -> bytes:
    """``data`` framed as one chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


class AnswerHeads:
    """Heads of answers by (status, headers, body length, keep-alive), with the default
    headers they were written with: a head written with others (a new second's date) is
    written again. Shared by a server's connections; bounded."""

    __slots__ = ("_heads",)

    def __init__(self) -> None:
        self._heads: dict[tuple[int, Headers, int, bool], tuple[object, bytes]] = {}

    def head(
        self, defaults: DefaultHeaders, status: int, headers: Headers, length: int, keep_alive: bool
    ) -> bytes:
        key = (status, headers, length, keep_alive)
        heads = self._heads
        kept = heads.get(key)
        if kept is not None and kept[0] is defaults:
            return kept[1]
        head = answer_head(defaults, status, headers, length, keep_alive)
        if len(heads) >= MAX_ANSWER_HEADS:
            heads.clear()  # a new second (a new date) or many shapes: started again
        heads[key] = (defaults, head)
        return head


class DateHeader:
    """The default header fields, with the ``date`` of the current second: a new list
    once a second (:meth:`tick`), which :class:`AnswerHeads` tells apart by identity.
    ``now``: the wall clock it reads (a test gives its own)."""

    __slots__ = ("_now", "_second", "headers")

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self._now = now
        self._second = -1
        self.headers: DefaultHeaders = []
        self.tick()

    def tick(self) -> None:
        now = self._now()
        second = int(now)
        if second != self._second:
            self._second = second
            self.headers = [(b"date", formatdate(now, usegmt=True).encode())]
