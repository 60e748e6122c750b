"""The one check of a request body against the server's limits, for the protocol and the
ASGI app alike.

A body is held against two limits as it arrives: ``--max-request-bytes`` for the request
itself (past it: a 413, the rest left unread, so the connection closes) and
``--max-inflight-bytes`` for the bytes all connections hold (past it: a 503 with
``Retry-After``; the connection may go on). The bytes are held from the head (its declared
length) or as chunks come, until the answer is written or the connection is lost
(:class:`~carpool.server.limits.InflightBytes`).
"""

from __future__ import annotations

import enum

from carpool.server.errors import PayloadTooLarge
from carpool.server.http.headers import declared_length
from carpool.server.limits import InflightBytes


class BodyCheck(enum.Enum):
    """What became of a chunk added to a body."""

    TAKEN = "taken"
    TOO_LARGE = "too large"  # past --max-request-bytes
    OVER_BUDGET = "over budget"  # past --max-inflight-bytes


def declared_too_large(content_length: bytes | None, max_body_bytes: int) -> PayloadTooLarge | None:
    """The 413 for a declared ``Content-Length`` over the limit, refused before any of the
    body is read (nor ``100 Continue`` sent to ask for it); None when within it."""
    declared = declared_length(content_length)
    if declared is not None and declared > max_body_bytes:
        return PayloadTooLarge(declared, max_body_bytes, is_unread=True)
    return None


_TAKEN, _TOO_LARGE, _OVER_BUDGET = BodyCheck.TAKEN, BodyCheck.TOO_LARGE, BodyCheck.OVER_BUDGET


class BodyBytes:
    """A request body as it arrives, and the bytes of it held in the server's budget."""

    __slots__ = ("chunks", "held_bytes", "size_bytes")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size_bytes = 0
        self.held_bytes = 0

    def hold(self, size_bytes: int, inflight: InflightBytes) -> bool:
        """Hold ``size_bytes`` more in the budget; False (nothing held) when it is full."""
        if inflight.take(size_bytes):
            self.held_bytes += size_bytes
            return True
        return False

    def add(self, chunk: bytes, max_body_bytes: int, inflight: InflightBytes) -> BodyCheck:
        """Take ``chunk``: past ``max_body_bytes`` it is TOO_LARGE; bytes beyond those held
        (a chunked body, or more than declared) are held now, or it is OVER_BUDGET."""
        self.chunks.append(chunk)
        size = self.size_bytes = self.size_bytes + len(chunk)
        if size > max_body_bytes:
            return _TOO_LARGE
        if size > self.held_bytes and not self.hold(size - self.held_bytes, inflight):
            return _OVER_BUDGET
        return _TAKEN

    def too_large(self, max_body_bytes: int) -> PayloadTooLarge:
        """The 413 for this body, past ``max_body_bytes`` with the rest of it unread."""
        return PayloadTooLarge(self.size_bytes, max_body_bytes, is_unread=True)

    def release(self, inflight: InflightBytes) -> None:
        """Give back what is held (the answer is written, or nobody is left to answer)."""
        if self.held_bytes:
            inflight.release(self.held_bytes)
            self.held_bytes = 0

    def take(self) -> bytes:
        """The body received, whole; its chunks are let go."""
        chunks, self.chunks = self.chunks, []
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
