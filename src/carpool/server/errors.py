"""Maps carpool's errors to HTTP statuses and KServe v2 error bodies; nowhere else does.

=====================  ======  =============================================
error                  status  why
=====================  ======  =============================================
InvalidInput           400     the client sent something unusable
NotFound               404     unknown model or version
PayloadTooLarge        413     body over the configured limit
QueueFull              429     admission refused; ``Retry-After`` tells when
DeadlineExceeded       503     the deadline passed while queued
Closed                 503     the server is draining
ModelError             500     the model raised on this request
CapacityError          500     out of memory even alone
=====================  ======  =============================================
"""

from __future__ import annotations

from dataclasses import dataclass

from carpool.errors import (
    CapacityError,
    CarpoolError,
    Closed,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    ModelError,
    QueueFull,
)


class NotFound(Exception):
    """An unknown model or version (a server-level fact: core has no model names)."""

    def __init__(self, what: str, known: list[str]) -> None:
        self.what = what
        self.known = known
        super().__init__(f"{what} not found; available: {', '.join(known) or 'none'}")


class PayloadTooLarge(Exception):
    def __init__(self, size_bytes: int, limit_bytes: int) -> None:
        super().__init__(
            f"request body of {size_bytes} bytes exceeds the limit of {limit_bytes} bytes"
        )


@dataclass(frozen=True, slots=True)
class HttpError:
    status: int
    message: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (InvalidInput, 400),
    (ConfigError, 400),
    (NotFound, 404),
    (PayloadTooLarge, 413),
    (QueueFull, 429),
    (DeadlineExceeded, 503),
    (Closed, 503),
    (ModelError, 500),
    (CapacityError, 500),
)


def http_error(exc: BaseException) -> HttpError:
    """The status, message and headers to answer ``exc`` with."""
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            headers: tuple[tuple[bytes, bytes], ...] = ()
            if status == 429:
                headers = ((b"retry-after", b"1"),)
            return HttpError(status, str(exc), headers)
    if isinstance(exc, CarpoolError):
        return HttpError(500, str(exc))
    return HttpError(500, f"internal error: {type(exc).__name__}: {exc}")
