"""Maps carpool's errors to HTTP statuses, gRPC status codes and KServe v2 error
messages; nowhere else does. The server's own errors are defined here too, each a
:class:`~carpool.errors.CarpoolError` (the whole hierarchy is drawn in
:mod:`carpool.errors`).

=================  ====  ==================  =============================================
error              HTTP  gRPC                why
=================  ====  ==================  =============================================
InvalidInput       400   INVALID_ARGUMENT    the client sent something unusable
ConfigError        400   INVALID_ARGUMENT    a policy sent to POST .../policy is invalid
Unauthorized       401   UNAUTHENTICATED     no API key, or not the server's (server/access.py)
PolicyUpdatesOff   403   PERMISSION_DENIED   POST .../policy without --allow-policy-updates
NotFound           404   NOT_FOUND           unknown model or version
MethodNotAllowed   405   UNIMPLEMENTED       a known path, another method (``Allow``)
NotSupported       501   UNIMPLEMENTED       a Triton extension carpool does not implement
PayloadTooLarge    413   RESOURCE_EXHAUSTED  body over the configured limit
QueueFull          429   UNAVAILABLE         admission refused; ``Retry-After`` tells when
DeadlineExceeded   503   UNAVAILABLE         the deadline passed while queued
GenerationTimedOut 503   UNAVAILABLE         a generation model's deadline passed before
                                             its answer was complete
Closed             503   UNAVAILABLE         the server is draining, or cut its drain off
Overloaded         503   UNAVAILABLE         a server limit (connections, bytes held);
                                             ``Retry-After`` tells when
BatchTimeout       504   DEADLINE_EXCEEDED   the batch ran past the model's batch_timeout_s
ModelError         500   INTERNAL            the model raised on this request
CapacityError      500   INTERNAL            out of memory even alone
anything else      500   INTERNAL            a bug: the message says ``internal error``
=================  ====  ==================  =============================================

``PortInUse`` and ``DrainTimedOut`` end ``carpool serve`` rather than answer a request.

Both wires carry the same message (:func:`error_message`). OpenAI-compatible endpoints
wrap it in OpenAI's error object (:func:`openai_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from carpool.errors import (
    BatchTimeout,
    CapacityError,
    CarpoolError,
    Closed,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    ModelError,
    QueueFull,
    duration_text,
)

# The most characters of a client's own input (a path, a model name or version) an error
# message repeats: a 60 KB model name must not come back as a 60 KB body, nor a 1 MiB
# gRPC model_version overflow the status metadata (16 KiB) and turn NOT_FOUND into
# RESOURCE_EXHAUSTED.
MAX_ECHO_CHARS = 256


def echo(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` as an error message may repeat it: whole up to ``limit`` characters, else
    its start and how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... (cut: {len(text)} characters)"


class GenerationTimedOut(CarpoolError, TimeoutError):
    """A generation request's deadline passed before its answer was complete: what it
    was generating was stopped (its KV blocks freed), and nothing is answered but this."""

    def __init__(self, timeout_s: float, ran_s: float) -> None:
        self.timeout_s = timeout_s
        self.ran_s = ran_s
        super().__init__(
            f"the generation did not finish within its timeout of {duration_text(timeout_s)} "
            f"and was stopped after {duration_text(ran_s)}; raise the timeout (KServe's timeout "
            "parameter in µs) or lower the load",
        )

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.timeout_s, self.ran_s), {}


class NotFound(CarpoolError):
    """An unknown path, model or version (a server-level fact: core has no model names).
    ``is_model``: a model or version, which OpenAI's error object calls
    ``model_not_found``. ``what`` (which names the client's input) is cut to
    :data:`MAX_ECHO_CHARS` in the message."""

    def __init__(self, what: str, known: list[str], *, is_model: bool = False) -> None:
        self.what = what
        self.known = known
        self.is_model = is_model
        super().__init__(f"{echo(what)} not found; available: {', '.join(known) or 'none'}")

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.what, self.known), {"is_model": self.is_model}


class MethodNotAllowed(CarpoolError):
    """A known path asked with a method it does not answer."""

    def __init__(self, method: str, path: str, allowed: tuple[str, ...]) -> None:
        self.method = method
        self.path = path
        self.allowed = allowed
        asked = echo(f"{method} {path!r}")
        super().__init__(f"{asked} is not allowed; expected {' or '.join(allowed)}")

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.method, self.path, self.allowed), {}


class NotSupported(CarpoolError):
    """An endpoint of a Triton extension that carpool does not implement (repository
    load/unload, shared memory, tracing, log settings). Triton answers a feature it does
    not support with ``TRITONSERVER_ERROR_UNSUPPORTED``: HTTP 501, gRPC UNIMPLEMENTED."""

    def __init__(self, feature: str, extension: str) -> None:
        self.feature = feature
        self.extension = extension
        super().__init__(
            f"{feature} is not supported by carpool (Triton's {extension!r} extension; "
            "GET /v2 lists the extensions carpool serves)"
        )

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.feature, self.extension), {}


class Unauthorized(CarpoolError):
    """A request without the server's API key (``carpool serve --api-key``); ``reason``
    says what was wrong without repeating what was sent. Answered before the body is
    read (``is_unread``: the connection is then closed)."""

    is_unread = True
    code = "invalid_api_key"  # OpenAI's error code for a missing or wrong key

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"{reason}: this server requires the header 'Authorization: Bearer <key>' (gRPC: "
            "the 'authorization' metadata), the key carpool serve was started with "
            "(--api-key or CARPOOL_API_KEY)"
        )

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.reason,), {}


class PolicyUpdatesOff(CarpoolError):
    """``POST .../policy`` to a server not started with ``--allow-policy-updates``."""

    is_unread = True

    def __init__(self, model: str) -> None:
        self.model = model
        super().__init__(
            f"policy updates over the network are off: start the server with "
            f"'carpool serve --allow-policy-updates' to change the batch policy of "
            f"{echo(model)!r} while it serves (GET .../policy shows it either way)"
        )

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.model,), {}


class PortInUse(CarpoolError):
    """A port the server was told to listen on cannot be bound."""


class DrainTimedOut(CarpoolError):
    """A shutdown ran past ``--drain-timeout-s``: the ``num_cut_off`` requests the models
    had not answered by then were answered 503 (gRPC: UNAVAILABLE)."""

    def __init__(self, num_cut_off: int, drain_timeout_s: float) -> None:
        self.num_cut_off = num_cut_off
        self.drain_timeout_s = drain_timeout_s
        super().__init__(
            f"the shutdown ran past --drain-timeout-s {drain_timeout_s:g}: {num_cut_off} "
            "request(s) still unanswered were cut off with 503 / UNAVAILABLE"
        )

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.num_cut_off, self.drain_timeout_s), {}


# The largest request, an HTTP body or a gRPC message, unless `carpool serve
# --max-request-bytes` says otherwise: Triton's default too (--http-max-input-size).
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024


class PayloadTooLarge(CarpoolError):
    """A body over the limit; ``is_unread`` when the rest of it was left unread (then the
    connection cannot carry another request and is closed)."""

    def __init__(self, size_bytes: int, limit_bytes: int, *, is_unread: bool = False) -> None:
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes
        self.is_unread = is_unread
        super().__init__(
            f"request body of {size_bytes} bytes exceeds the limit of {limit_bytes} bytes "
            "(carpool serve --max-request-bytes)"
        )

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.size_bytes, self.limit_bytes), {"is_unread": self.is_unread}


class Overloaded(CarpoolError):
    """A request refused because the server is at one of its own limits
    (:mod:`carpool.server.limits`): ``what`` names the limit and its flag."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"the server is at its limit of {what}; retry later")

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.what,), {}


@dataclass(frozen=True, slots=True)
class HttpError:
    status: int
    message: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (InvalidInput, 400),
    (ConfigError, 400),
    (Unauthorized, 401),
    (PolicyUpdatesOff, 403),
    (NotFound, 404),
    (MethodNotAllowed, 405),
    (NotSupported, 501),
    (PayloadTooLarge, 413),
    (QueueFull, 429),
    (Overloaded, 503),
    (DeadlineExceeded, 503),
    (GenerationTimedOut, 503),
    (Closed, 503),
    (BatchTimeout, 504),  # before ModelError, its base class
    (ModelError, 500),
    (CapacityError, 500),
)

# grpc.StatusCode member names, so this module needs no grpc import.
_GRPC_STATUS: tuple[tuple[type[BaseException], str], ...] = (
    (InvalidInput, "INVALID_ARGUMENT"),
    (ConfigError, "INVALID_ARGUMENT"),
    (Unauthorized, "UNAUTHENTICATED"),
    (PolicyUpdatesOff, "PERMISSION_DENIED"),
    (NotFound, "NOT_FOUND"),
    (MethodNotAllowed, "UNIMPLEMENTED"),
    (NotSupported, "UNIMPLEMENTED"),
    (PayloadTooLarge, "RESOURCE_EXHAUSTED"),
    (QueueFull, "UNAVAILABLE"),  # as Triton; gRPC maps HTTP 429 to it too
    (Overloaded, "UNAVAILABLE"),
    (DeadlineExceeded, "UNAVAILABLE"),
    (GenerationTimedOut, "UNAVAILABLE"),
    (Closed, "UNAVAILABLE"),
    (BatchTimeout, "DEADLINE_EXCEEDED"),
)


def error_message(exc: BaseException) -> str:
    """The message either wire answers ``exc`` with."""
    if isinstance(exc, CarpoolError):
        return str(exc)
    return f"internal error: {type(exc).__name__}: {exc}"


def http_error(exc: BaseException) -> HttpError:
    """The status, message and headers to answer ``exc`` with."""
    message = error_message(exc)
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            headers: tuple[tuple[bytes, bytes], ...] = ()
            if status == 429 or isinstance(exc, Overloaded):
                headers = ((b"retry-after", b"1"),)
            elif isinstance(exc, MethodNotAllowed):
                headers = ((b"allow", ", ".join(exc.allowed).encode()),)
            elif status == 401:  # RFC 9110 11.6.1: a 401 says which scheme it wants
                headers = ((b"www-authenticate", b"Bearer"),)
            return HttpError(status, message, headers)
    return HttpError(500, message)


def grpc_status(exc: BaseException) -> str:
    """The name of the ``grpc.StatusCode`` to answer ``exc`` with (``"INTERNAL"`` for
    model errors, out of memory and anything unexpected)."""
    for kind, code in _GRPC_STATUS:
        if isinstance(exc, kind):
            return code
    return "INTERNAL"


_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                 403: "invalid_request_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error"}  # fmt: skip


def openai_error(exc: BaseException) -> tuple[HttpError, dict[str, Any]]:
    """The status and headers (as :func:`http_error`) and OpenAI's error object."""
    error = http_error(exc)
    code: str | None
    if isinstance(exc, NotFound) and exc.is_model:
        code = "model_not_found"
    else:  # a BadParam's code, such as context_length_exceeded; invalid_api_key
        code = getattr(exc, "code", None) if isinstance(exc, InvalidInput | Unauthorized) else None
    body = {
        "error": {
            "message": error.message,
            "type": _OPENAI_TYPES.get(error.status, "server_error"),
            "param": getattr(exc, "param", None),
            "code": code,
        }
    }
    return error, body
