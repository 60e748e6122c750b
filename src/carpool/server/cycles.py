"""What stands in uvicorn's ``self.cycle`` and pipeline besides its own request cycles.

uvicorn's httptools protocol keeps the request being answered in ``self.cycle`` and the
pipelined ones in ``self.pipeline``, and reads a few attributes of them
(``response_complete``, ``more_body``, ``disconnected``, ``message_event``) to keep
alive, pipeline, control flow and shut down. :class:`FastCycle` is an infer request of
the fast path (:mod:`carpool.server.fasthttp`) there, and :class:`Refusal` the error
answer about bad bytes waiting for the answers of the requests before them.
"""

from __future__ import annotations

from typing import Any

from carpool.core.request import Request
from carpool.server.infer import InferCall
from carpool.server.repository import ServedModel


class NoEvent:
    """uvicorn sets the cycle's message event on disconnect; nothing waits on it here."""

    def set(self) -> None:
        pass


class Refusal:
    """A refusal (400, 431) about the bytes after requests still being answered, waiting
    in uvicorn's pipeline for its turn as a request would: answers go out in order."""

    more_body = False
    message_event = NoEvent()

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.response_complete = False
        self.disconnected = False


class FastCycle:
    """One fast-path request where uvicorn keeps its RequestResponseCycle."""

    __slots__ = (
        "arrival_s",
        "call",
        "chunks",
        "disconnected",
        "encoding",
        "head_answer",
        "header_length",
        "held",
        "http_version",
        "keep_alive",
        "model",
        "more_body",
        "on_response",
        "oversize",
        "path",
        "queued",
        "response_complete",
        "size",
        "started",
        "waiting_for_100_continue",
    )
    message_event = NoEvent()

    def __init__(
        self,
        model: ServedModel,
        path: str,
        header_length: bytes | None,
        encoding: bytes | None,
        http_version: str,
        keep_alive: bool,
        expect_continue: bool,
        on_response: Any,
    ) -> None:
        self.model = model
        self.path = path
        self.header_length = header_length
        self.encoding = encoding  # the answer's Content-Encoding, None: identity
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_continue
        self.on_response = on_response
        self.chunks: list[bytes] = []
        self.size = 0
        self.held = 0  # body bytes held in the server's --max-inflight-bytes budget
        self.oversize = False  # the body passed the limit: a 413, the rest is ignored
        # Answered from its head, the body read and ignored: a refusal (a queue or the
        # byte budget full) or a health probe's answer.
        self.head_answer: tuple[int, bytes, Any] | None = None
        self.more_body = True
        self.started = False
        self.response_complete = False
        self.disconnected = False
        self.queued: Request | None = None
        self.call: InferCall | None = None
        self.arrival_s: float | None = None  # when its first byte was read (monotonic)
