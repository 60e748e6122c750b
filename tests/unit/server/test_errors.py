"""The one mapping from carpool's errors to wire statuses."""

from __future__ import annotations

import copy
import inspect
import pickle
from collections.abc import Callable

import grpc
import pytest

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
    QueueTooLong,
)
from carpool.server import errors as server_errors
from carpool.server.errors import (
    DrainTimedOut,
    GenerationTimedOut,
    MethodNotAllowed,
    NotFound,
    NotSupported,
    Overloaded,
    PayloadTooLarge,
    PolicyUpdatesOff,
    PortInUse,
    Unauthorized,
    error_message,
    grpc_status,
    http_error,
)


@pytest.mark.parametrize(
    ("exc", "code", "status"),
    [
        (InvalidInput("bad shape"), "INVALID_ARGUMENT", 400),
        (NotFound("model 'x'", ["mlp"]), "NOT_FOUND", 404),
        (QueueFull("normal", 8), "UNAVAILABLE", 429),
        (QueueTooLong("normal", 0.08, 0.05), "UNAVAILABLE", 429),
        (DeadlineExceeded(1, 0.5, 0.6), "UNAVAILABLE", 503),
        (Closed("mlp"), "UNAVAILABLE", 503),
        (ModelError("boom"), "INTERNAL", 500),
        (BatchTimeout("mlp", 60.0, 0, request_id=3), "DEADLINE_EXCEEDED", 504),
        (CapacityError(1, 64), "INTERNAL", 500),
        (RuntimeError("boom"), "INTERNAL", 500),
    ],
)
def test_grpc_and_http_agree_on_each_error(exc: Exception, code: str, status: int) -> None:
    assert grpc_status(exc) == code
    assert grpc.StatusCode[code].name == code
    assert http_error(exc).status == status


def test_both_wires_carry_the_same_message() -> None:
    exc = InvalidInput("input 'X': shape [1, 2]")
    assert error_message(exc) == http_error(exc).message == "input 'X': shape [1, 2]"
    assert error_message(RuntimeError("boom")) == "internal error: RuntimeError: boom"


def test_not_found_cuts_what_the_client_sent_to_a_bounded_echo() -> None:
    from carpool.server.errors import MAX_ECHO_CHARS, echo

    assert echo("short") == "short"
    long = "x" * 100_000
    cut = echo(long)
    assert cut.startswith("x" * MAX_ECHO_CHARS) and cut.endswith("(cut: 100000 characters)")
    message = str(NotFound(f"model {long!r}", ["mlp"], is_model=True))
    assert len(message) < 2 * MAX_ECHO_CHARS and message.endswith("available: mlp")
    assert len(str(MethodNotAllowed("GET", "/" + long, ("POST",)))) < 2 * MAX_ECHO_CHARS


SERVER_ERRORS = [
    NotFound("model 'x'", ["mlp"], is_model=True),
    MethodNotAllowed("GET", "/v2/models/mlp/infer", ("POST",)),
    NotSupported("POST /v2/repository/models/mlp/load", "model_repository"),
    Unauthorized("no API key was sent"),
    PolicyUpdatesOff("mlp"),
    PayloadTooLarge(2048, 1024, is_unread=True),
    Overloaded("connections (--max-connections 8)"),
    PortInUse("HTTP port 127.0.0.1:8000: could not bind (address in use)"),
    DrainTimedOut(3, 5.0),
    GenerationTimedOut(0.001, 0.0042),
]


def test_every_server_error_is_a_carpool_error_with_an_example_here() -> None:
    defined = {
        cls
        for _, cls in inspect.getmembers(server_errors, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == server_errors.__name__
    }
    assert defined == {type(e) for e in SERVER_ERRORS}
    assert all(issubclass(cls, CarpoolError) for cls in defined)


@pytest.mark.parametrize("error", SERVER_ERRORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("clone", [copy.copy, lambda e: pickle.loads(pickle.dumps(e))])
def test_server_errors_survive_pickle_and_copy_with_their_fields(
    error: CarpoolError, clone: Callable[[CarpoolError], CarpoolError]
) -> None:
    again = clone(error)
    assert type(again) is type(error)
    assert str(again) == str(error)
    assert vars(again) == vars(error)


@pytest.mark.parametrize(
    ("exc", "status", "code", "header"),
    [
        (SERVER_ERRORS[0], 404, "NOT_FOUND", None),
        (SERVER_ERRORS[1], 405, "UNIMPLEMENTED", (b"allow", b"POST")),
        (SERVER_ERRORS[2], 501, "UNIMPLEMENTED", None),
        (SERVER_ERRORS[3], 401, "UNAUTHENTICATED", (b"www-authenticate", b"Bearer")),
        (SERVER_ERRORS[4], 403, "PERMISSION_DENIED", None),
        (SERVER_ERRORS[5], 413, "RESOURCE_EXHAUSTED", None),
        (SERVER_ERRORS[6], 503, "UNAVAILABLE", (b"retry-after", b"1")),
        (SERVER_ERRORS[9], 503, "UNAVAILABLE", None),
        (QueueFull("normal", 8), 429, "UNAVAILABLE", (b"retry-after", b"1")),
        (QueueTooLong("normal", 0.08, 0.05), 429, "UNAVAILABLE", (b"retry-after", b"1")),
        (ConfigError("max_batch_size", 0, "an integer >= 1"), 400, "INVALID_ARGUMENT", None),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None,
)
def test_each_server_error_maps_to_its_status_code_and_headers(
    exc: Exception, status: int, code: str, header: tuple[bytes, bytes] | None
) -> None:
    error = http_error(exc)
    assert (error.status, grpc_status(exc)) == (status, code)
    assert error.headers == ((header,) if header else ())
    assert error.message == error_message(exc) == str(exc)
