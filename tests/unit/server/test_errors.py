"""The one mapping from carpool's errors to wire statuses."""

from __future__ import annotations

import grpc
import pytest

from carpool.errors import (
    BatchTimeout,
    CapacityError,
    Closed,
    DeadlineExceeded,
    InvalidInput,
    ModelError,
    QueueFull,
)
from carpool.server.errors import NotFound, error_message, grpc_status, http_error


@pytest.mark.parametrize(
    ("exc", "code", "status"),
    [
        (InvalidInput("bad shape"), "INVALID_ARGUMENT", 400),
        (NotFound("model 'x'", ["mlp"]), "NOT_FOUND", 404),
        (QueueFull("normal", 8), "UNAVAILABLE", 429),
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
    from carpool.server.errors import MAX_ECHO_CHARS, MethodNotAllowed, NotFound, echo

    assert echo("short") == "short"
    long = "x" * 100_000
    cut = echo(long)
    assert cut.startswith("x" * MAX_ECHO_CHARS) and cut.endswith("(cut: 100000 characters)")
    message = str(NotFound(f"model {long!r}", ["mlp"], is_model=True))
    assert len(message) < 2 * MAX_ECHO_CHARS and message.endswith("available: mlp")
    assert len(str(MethodNotAllowed("GET", "/" + long, ("POST",)))) < 2 * MAX_ECHO_CHARS
