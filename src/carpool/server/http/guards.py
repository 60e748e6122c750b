"""What guards a connection against clients that send too much or too little: the size
of a request head, how far pipelined requests are read ahead, and the one timer that
times the waits.

Too much: a request's head (request line and header fields) is held in memory until it
is complete. Past :data:`MAX_HEAD_BYTES` received without it ending (or trailer fields
without the body ending) it is refused, 414 or 431, and the connection closed; a head
that arrives within one read of the socket (at most 256 KiB) is parsed whole and then
held to the same limits (a target under MAX_HEAD_BYTES, a head within it,
:data:`MAX_HEADER_FIELDS`). Trailer fields are never kept.

Too little: while no request of a connection is being answered, the head of the next one
must be complete within ``timeout_keep_alive_s`` of the wait's start (connecting counts
as an answer), and a body must not stall for longer than that between two reads, nor
take longer than ``--body-timeout-s`` in all.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

# Pipelined requests read ahead of the one being answered before reading pauses. Reading
# on is how a hang-up is seen: a paused transport never reports one, and the queued
# request would reach the model for nobody.
READ_AHEAD_REQUESTS = 16
READ_AHEAD_BYTES = 1024 * 1024
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADER_FIELDS = 256
DEFAULT_KEEP_ALIVE_S = 5.0  # uvicorn's timeout_keep_alive, which carpool serve kept


def head_refusal(target_bytes: int, field_bytes: int, num_fields: int) -> tuple[int, str] | None:
    """The status and message refusing a complete head, or None when it is within the
    limits. A target of 64 KiB or more is also past what httptools' URL parser can take
    (16-bit offsets)."""
    if num_fields > MAX_HEADER_FIELDS:
        return 431, f"request line and header fields: over {MAX_HEADER_FIELDS} fields, the limit"
    if target_bytes >= MAX_HEAD_BYTES:
        return 414, (
            f"request target of {target_bytes} bytes exceeds the limit of "
            f"{MAX_HEAD_BYTES - 1} bytes"
        )
    head_bytes = target_bytes + field_bytes
    if head_bytes > MAX_HEAD_BYTES:
        return 431, (
            f"request line and header fields of {head_bytes} bytes exceed the limit of "
            f"{MAX_HEAD_BYTES} bytes"
        )
    return None


# RFC 9112 3.2 / RFC 3986 3.2.2: Host = uri-host [ ":" port ], the host a reg-name (of
# unreserved, sub-delims and %-escapes, possibly empty) or an IP literal in brackets.
_HOST_VALUE = re.compile(rb"(?:\[[0-9A-Za-z:.]+\]|[A-Za-z0-9\-._~!$&'()*+,;=%]*)(?::[0-9]*)?")


def host_refusal(version: str, hosts: list[bytes]) -> tuple[int, str] | None:
    """The status and message refusing a request whose ``Host`` fields (their values)
    are not what RFC 9112 3.2 asks: exactly one in HTTP/1.1 (none or one in HTTP/1.0),
    holding a host and an optional port; None when they are."""
    if len(hosts) > 1 or (not hosts and version != "1.0"):
        return 400, f"{len(hosts)} Host header fields; an HTTP/{version} request has one"
    if hosts and _HOST_VALUE.fullmatch(hosts[0]) is None:
        value = hosts[0][:64].decode("latin-1")
        return 400, f"Host {value!r} is not a host and an optional port (RFC 9112 3.2)"
    return None


def grown_head_refusal(
    size_bytes: int, target_bytes: int, has_fields: bool, is_trailer: bool
) -> tuple[int, str]:
    """The status and message for a head, or trailer fields, grown past the limit over
    reads without ending: 414 while it is the request target that grows."""
    if not is_trailer and not has_fields and target_bytes * 2 >= size_bytes:
        return 414, (
            f"request target of over {target_bytes} bytes exceeds the limit of "
            f"{MAX_HEAD_BYTES} bytes"
        )
    what = "trailer fields" if is_trailer else "request line and header fields"
    return 431, f"{what} of over {size_bytes} bytes exceed the limit of {MAX_HEAD_BYTES} bytes"


class WaitTimer:
    """The wait a connection is in, ending at :attr:`deadline` (None: no wait, the
    server's turn), and one loop timer that catches up with it.

    Armed lazily: arming a loop timer for every answer and cancelling it at the next
    request is a measurable share of a request's time, so a wait only moves the deadline,
    and the one timer, when it fires, sleeps on to the deadline of the wait then running,
    if any; ``expired`` runs when one ends unmet.
    """

    __slots__ = ("_expired", "_handle", "_handle_s", "_loop", "deadline")

    def __init__(self, loop: asyncio.AbstractEventLoop, expired: Callable[[], None]) -> None:
        self._loop = loop
        self._expired = expired
        self._handle: asyncio.TimerHandle | None = None
        self._handle_s = 0.0  # when the loop timer fires
        self.deadline: float | None = None

    def arm(self, deadline: float) -> None:
        """A wait until ``deadline`` (the loop's clock) starts, replacing any other."""
        self.deadline = deadline
        handle = self._handle
        if handle is None or deadline < self._handle_s:  # sooner (a body's whole time)
            if handle is not None:
                handle.cancel()
            self._handle = self._loop.call_at(deadline, self._fired)
            self._handle_s = deadline

    def cancel(self) -> None:
        """No more waits: the connection is gone (its timer must not hold it)."""
        handle, self._handle, self.deadline = self._handle, None, None
        if handle is not None:
            handle.cancel()

    def _fired(self) -> None:
        self._handle = None
        deadline = self.deadline
        if deadline is None:
            return
        # A millisecond early is on time: libuv's timers count whole milliseconds.
        if self._loop.time() + 0.001 < deadline:  # a later wait than the one armed for
            self._handle = self._loop.call_at(deadline, self._fired)
            self._handle_s = deadline
            return
        self.deadline = None
        self._expired()
