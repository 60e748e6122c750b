"""One request on a connection and its answer: an :class:`Exchange`.

A connection keeps the exchanges whose head has come and whose answer has not gone, in
order; the first is the one whose turn it is (RFC 9112 9.3.2: answers go out in the
order the requests came). Only that one runs: a pipelined request reaches its model or
handler when the answers before it are written.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any

from carpool.core.request import Request
from carpool.server.http.body import BodyBytes
from carpool.server.http.router import HttpRequest, Route
from carpool.server.infer import Answer, InferCall
from carpool.server.repository import ServedModel


@dataclass(slots=True)
class Head:
    """A request's head, complete, as the parser gave it (field names lowercase)."""

    method: bytes
    url: bytes
    fields: list[tuple[bytes, bytes]]
    http_version: str
    keep_alive: bool
    is_upgrade: bool  # asks to switch protocols: answered as plain HTTP, then closed
    expects_continue: bool
    arrival_s: float  # when its first byte was read (monotonic)


class ExchangeKind(enum.Enum):
    INFER = "infer"  # POST .../infer its model's batcher answers: decoded, queued, no task
    ROUTE = "route"  # any other request: its route's handler, in a task
    REFUSAL = "refusal"  # bad bytes, answered in their turn; then the connection closes


class Exchange(BodyBytes):
    """One request and its answer, from its head to its answer's last byte."""

    __slots__ = (
        "arrival_s",
        "call",
        "encoding",
        "error",
        "expects_continue",
        "head_answer",
        "header_length",
        "http_version",
        "is_answered",
        "is_received",
        "is_started",
        "is_too_large",
        "is_watched",
        "keep_alive",
        "keeps_body",
        "kind",
        "method",
        "model",
        "path",
        "queued",
        "refusal",
        "request",
        "route",
        "task",
    )

    def __init__(
        self,
        kind: ExchangeKind,
        method: str,
        path: str,
        http_version: str,
        keep_alive: bool,
        arrival_s: float,
    ) -> None:
        self.chunks: list[bytes] = []  # BodyBytes's, set here: one call less a request
        self.size_bytes = 0
        self.held_bytes = 0
        self.kind = kind
        self.method = method
        self.path = path  # the request target, for the access log
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.arrival_s = arrival_s  # when its first byte was read (monotonic)
        self.expects_continue = False  # Expect: 100-continue, not answered yet
        self.keeps_body = True  # False: its body is read and dropped
        self.is_received = False  # its whole body is in
        self.is_started = False  # its turn came
        self.is_answered = False
        self.is_too_large = False  # its body passes the limit: a 413, the rest unread
        # Answered from its head once its body is in (read and dropped): a refusal (a
        # queue or the byte budget full) or a health probe's answer.
        self.head_answer: Answer | None = None
        # Answered at its turn without its body: what its route refused from the head.
        self.error: Exception | None = None
        # INFER: its model, the header fields its answer depends on, what it queued.
        self.model: ServedModel | None = None
        self.header_length: bytes | None = None
        self.encoding: bytes | None = None  # the answer's Content-Encoding, None: identity
        self.call: InferCall | None = None
        self.queued: Request | None = None
        # ROUTE: the request as its handler reads it, its route, the task answering it.
        self.request: HttpRequest | None = None
        self.route: Route | None = None
        self.task: asyncio.Task[Any] | None = None
        self.is_watched = False  # its task awaits the model: a lost connection cancels it
        self.refusal = b""  # REFUSAL: the whole answer

    @property
    def is_openai(self) -> bool:
        return self.request is not None and self.request.is_openai
