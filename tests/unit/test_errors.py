"""Every error carpool raises: one root, facts as attributes, a message that says what to do."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest

import carpool
from carpool import errors
from carpool.errors import (
    ActorDied,
    BatchTimeout,
    CallNotRun,
    CapacityError,
    CarpoolError,
    Closed,
    ConfigError,
    DeadlineExceeded,
    Displaced,
    Hung,
    InvalidInput,
    ModelError,
    QueueFull,
    QueueTooLong,
    ReplicaDied,
    StartedLate,
    Withdrawn,
)

ALL_ERRORS = [
    ConfigError("max_batch_size", 0, "an integer >= 1"),
    InvalidInput("payload cannot be batched", request_id=3),
    QueueFull("normal", 100),
    QueueTooLong("normal", 0.08, 0.05),
    DeadlineExceeded(7, 0.05, 0.0625),
    DeadlineExceeded(7, 0.5, 0.025, left_s=0.475),
    ModelError("the model raised ValueError: bad", request_id=9),
    BatchTimeout("mlp", 60.0, 1, request_id=10),
    CapacityError(11, 64),
    Closed("resnet"),
]


# Signals between core's stages: they never reach a caller.
SIGNALS = {CallNotRun, StartedLate, Withdrawn, Displaced, Hung, ReplicaDied, ActorDied}


def _defined_exception_classes() -> list[type[BaseException]]:
    """The public errors of carpool.errors: every exception class there but the signals."""
    return [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, BaseException)
        and obj.__module__ == errors.__name__
        and obj not in SIGNALS
    ]


def test_every_exception_in_errors_module_is_a_carpool_error() -> None:
    classes = _defined_exception_classes()
    assert CarpoolError in classes
    assert len(classes) == 10
    for cls in classes:
        assert issubclass(cls, CarpoolError), cls


def test_signals_between_stages_are_neither_carpool_errors_nor_public() -> None:
    """One that escaped would be a bug: the wire reads it as an internal error, and an
    ``except CarpoolError`` does not swallow it."""
    for cls in SIGNALS:
        assert cls.__module__ == errors.__name__
        assert not issubclass(cls, CarpoolError), cls
        assert not hasattr(carpool, cls.__name__), cls
    assert all(issubclass(c, CallNotRun) for c in (StartedLate, Withdrawn, Displaced))
    assert issubclass(ActorDied, ReplicaDied)  # handled as a dead process replica is


def test_a_dead_actor_says_which_replica_and_what_ray_said() -> None:
    died = ActorDied("mlp", 1, "killed by ray.kill")
    assert str(died) == (
        "the Ray actor of replica 1 of model 'mlp' died while running this batch: its "
        "process or its node was lost (killed by ray.kill)"
    )
    assert (died.replica_id, died.reason, died.exitcode) == (1, "killed by ray.kill", None)
    lost = ActorDied("mlp", 0, "socket closed", where="pid 7 on node 9f3a")
    assert "replica 0 of model 'mlp' (pid 7 on node 9f3a) died" in str(lost)
    assert lost.where == "pid 7 on node 9f3a"


def test_every_exception_is_exported_from_the_package() -> None:
    for cls in _defined_exception_classes():
        assert getattr(carpool, cls.__name__) is cls


def test_examples_cover_every_subclass() -> None:
    covered = {type(e) for e in ALL_ERRORS}
    assert covered == set(_defined_exception_classes()) - {CarpoolError}


@pytest.mark.parametrize("error", ALL_ERRORS, ids=lambda e: type(e).__name__)
def test_every_error_is_caught_by_the_root(error: CarpoolError) -> None:
    with pytest.raises(CarpoolError):
        raise error


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (ConfigError, ValueError),
        (InvalidInput, ValueError),
        (DeadlineExceeded, TimeoutError),
        (BatchTimeout, TimeoutError),
        (BatchTimeout, ModelError),
        (CapacityError, MemoryError),
    ],
)
def test_errors_also_are_the_matching_builtin(
    cls: type[CarpoolError], builtin: type[Exception]
) -> None:
    assert issubclass(cls, builtin)


def test_config_error_names_field_value_and_expectation() -> None:
    error = ConfigError("max_delay_s", -1.0, "a finite number >= 0")
    assert (error.field, error.value, error.expected) == (
        "max_delay_s",
        -1.0,
        "a finite number >= 0",
    )
    assert str(error) == "invalid max_delay_s=-1.0: expected a finite number >= 0"


def test_invalid_input_names_request_and_reason() -> None:
    error = InvalidInput("cost=-1: expected a finite number >= 0", request_id=4)
    assert (error.reason, error.request_id) == ("cost=-1: expected a finite number >= 0", 4)
    assert str(error) == "request 4: cost=-1: expected a finite number >= 0"


def test_invalid_input_without_request_is_just_the_reason() -> None:
    error = InvalidInput("unknown priority 'vip'")
    assert error.request_id is None
    assert str(error) == "unknown priority 'vip'"


def test_queue_full_names_queue_limit_and_remedy() -> None:
    error = QueueFull("background", 16)
    assert (error.queue, error.limit) == ("background", 16)
    message = str(error)
    assert "'background'" in message
    assert "16 requests waiting" in message
    assert "retry later or raise max_queue_size" in message


def test_deadline_exceeded_reports_timeout_and_wait_in_milliseconds() -> None:
    error = DeadlineExceeded(7, 0.05, 0.0625)
    assert (error.request_id, error.timeout_s, error.waited_s) == (7, 0.05, 0.0625)
    message = str(error)
    assert "request 7" in message
    assert "waited 62.5 ms" in message
    assert "timeout of 50.0 ms" in message
    assert "raise the timeout (timeout_s, or KServe's timeout parameter in µs)" in message


def test_deadline_exceeded_before_it_passed_says_the_batch_would_end_late() -> None:
    error = DeadlineExceeded(7, 0.5, 0.025, left_s=0.475)
    assert error.left_s == 0.475
    message = str(error)
    assert "would end past its timeout of 500.0 ms" in message
    assert "it had 475.0 ms left, less than its batch takes here" in message
    assert "waited" not in message
    assert "raise the timeout (timeout_s, or KServe's timeout parameter in µs)" in message


def test_model_error_names_request_and_keeps_cause() -> None:
    cause = ValueError("bad row")
    error = ModelError("the model raised ValueError: bad row", request_id=9)
    error.__cause__ = cause
    assert error.request_id == 9
    assert str(error) == "request 9: the model raised ValueError: bad row"
    assert error.__cause__ is cause
    assert str(ModelError("boom")) == "boom"


def test_batch_timeout_names_model_limit_replica_and_remedy() -> None:
    error = BatchTimeout("resnet", 2.5, 1, request_id=12)
    assert (error.model, error.batch_timeout_s, error.replica_id) == ("resnet", 2.5, 1)
    assert error.request_id == 12
    message = str(error)
    assert message.startswith("request 12: model 'resnet' did not finish")
    assert "within batch_timeout_s=2.5 s on replica 1" in message
    assert "the replica is being replaced" in message
    assert "raise batch_timeout_s (null for none)" in message


def test_capacity_error_names_request_items_and_remedy() -> None:
    error = CapacityError(11, 64)
    assert (error.request_id, error.num_items) == (11, 64)
    message = str(error)
    assert "request 11 (64 items) ran out of memory even alone" in message
    assert "send fewer items per request" in message


def test_closed_names_the_batcher() -> None:
    error = Closed("resnet")
    assert error.name == "resnet"
    assert str(error) == "batcher 'resnet' is not accepting requests (stopped or draining)"


def test_config_error_names_the_file_when_given() -> None:
    error = ConfigError("models[0].max_delay_s", -1, "a number >= 0", file="serve.yaml")
    assert error.file == "serve.yaml"
    assert str(error) == "serve.yaml: invalid models[0].max_delay_s=-1: expected a number >= 0"


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("max_batch_size", 0, "an integer >= 1", file="carpool.yaml"),
        InvalidInput("bad payload", request_id=3),
        QueueFull("normal", 8),
        QueueTooLong("normal", 0.08, 0.05),
        QueueTooLong("normal", 0.08, 0.03, 0.05),
        DeadlineExceeded(4, 0.1, 0.25),
        ModelError("the model raised ValueError: no", request_id=5),
        CapacityError(6, 2),
        Closed("w1"),
    ],
    ids=lambda error: type(error).__name__,
)
@pytest.mark.parametrize("clone", [copy.copy, lambda e: pickle.loads(pickle.dumps(e))])
def test_errors_survive_pickle_and_copy_with_their_fields_and_message(error, clone):
    """An error crossing a process (multiprocessing, a process pool) or copied keeps its
    class, message and fields; before, most raised TypeError when rebuilt, and Closed
    nested its own message."""
    fields = {k: v for k, v in vars(error).items() if not k.startswith("_")}
    again = clone(error)
    assert type(again) is type(error)
    assert str(again) == str(error)
    assert {k: v for k, v in vars(again).items() if not k.startswith("_")} == fields
    assert isinstance(again, CarpoolError)
