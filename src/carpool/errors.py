"""Every exception carpool raises, in one place.

::

    CarpoolError                  root: catch this to catch anything carpool raises
    ├── ConfigError               a policy or config value is invalid (names the field)
    ├── InvalidInput              one request's payload cannot be batched or run
    │   └── BadParam              ... named by an OpenAI parameter (server/openai.py)
    ├── QueueFull                 admission refused: a queue bound was reached
    │   └── QueueTooLong          ... in time: too much work queued ahead (max_queue_time_s)
    ├── DeadlineExceeded          the request's deadline passed before it ran
    ├── ModelError                the model raised on this request (carries the cause)
    │   └── BatchTimeout          its batch ran past batch_timeout_s; the replica was replaced
    ├── CapacityError             out of memory even at the smallest batch
    ├── Closed                    the batcher is stopped or stopping
    │
    │   the server's own (carpool.server.errors: facts of HTTP and gRPC, not of batching)
    ├── NotFound                  an unknown path, model or version
    ├── MethodNotAllowed          a known path asked with another method
    ├── NotSupported              a Triton extension carpool does not serve
    ├── Unauthorized              no API key, or not the server's
    ├── PolicyUpdatesOff          POST .../policy to a server that does not take them
    ├── PayloadTooLarge           a body over --max-request-bytes
    ├── Overloaded                a server limit (connections, bytes held) was reached
    ├── PortInUse                 a port to listen on cannot be bound
    └── DrainTimedOut             a shutdown ran past --drain-timeout-s

Each exception keeps its facts as attributes (request id, limit, value) and builds its
message in ``__init__``: what was expected, what came, what to do. Wire formats (HTTP
status, KServe or OpenAI error bodies, gRPC codes) are mapped in one module,
``carpool.server.errors``.

Below the hierarchy, outside it, are the signals a replica's model call gives the
:class:`~carpool.core.settle.Settler` about what became of the call. They never reach a
caller (the settler answers each request with one of the errors above), so none is a
``CarpoolError``: one that escaped would be a bug, and reads as an internal error::

    CallNotRun                    the call did not run; its requests are answered or run again
    ├── StartedLate               its turn came past one of its requests' deadline
    ├── Withdrawn                 its turn came with requests their callers cancelled
    └── Displaced                 it waited on a replica thread given up after a hang
    Hung                          it ran past batch_timeout_s (its requests get BatchTimeout)
    ReplicaDied                   its replica's process died under it (a ModelError saying so)
    └── ActorDied                 its replica's Ray actor died or was lost with its node
"""

from __future__ import annotations

from typing import Any


class CarpoolError(Exception):
    """Root of every error carpool raises."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's default rebuilds cls(*self.args), from the message alone, which the
        # __init__ of the classes below does not take: pickle and copy.copy failed, or
        # nested the message and lost the fields. Rebuild from the fields instead.
        args, kwargs = self._init_args()
        return (_rebuild, (type(self), args, kwargs), self.__dict__)

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        """What ``__init__`` took: enough to build this error again."""
        return self.args, {}


def _rebuild(
    cls: type[CarpoolError], args: tuple[object, ...], kwargs: dict[str, Any]
) -> CarpoolError:
    return cls(*args, **kwargs)


class ConfigError(CarpoolError, ValueError):
    """A configuration value is invalid; ``file`` names the config file it came from, if any."""

    def __init__(
        self, field: str, value: object, expected: str, *, file: str | None = None
    ) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        self.file = file
        where = f"{file}: " if file is not None else ""
        super().__init__(f"{where}invalid {field}={value!r}: expected {expected}")

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.field, self.value, self.expected), {"file": self.file}


class InvalidInput(CarpoolError, ValueError):
    """One request's input is unusable; the other requests of its batch are unaffected."""

    def __init__(self, reason: str, *, request_id: int | None = None) -> None:
        self.reason = reason
        self.request_id = request_id
        where = f"request {request_id}: " if request_id is not None else ""
        super().__init__(f"{where}{reason}")

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.reason,), {"request_id": self.request_id}


class QueueFull(CarpoolError):
    """A request was refused at admission because a queue bound was reached (``limit``:
    requests; seconds for :class:`QueueTooLong`)."""

    def __init__(self, queue: str, limit: int) -> None:
        self.queue = queue
        self.limit: float = limit
        super().__init__(
            f"queue {queue!r} is full ({limit} requests waiting, the configured maximum); "
            "retry later or raise max_queue_size"
        )

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.queue, self.limit), {}


def duration_text(seconds: float) -> str:
    """Milliseconds to 0.1 ms, or whole microseconds below that.

    KServe's ``timeout`` parameter is given in microseconds: a 1 µs timeout shown as
    ``0.0 ms`` would read as no timeout at all.
    """
    if seconds < 1e-4:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.1f} ms"


class QueueTooLong(QueueFull):
    """Refused at admission by a queue bound in time (``max_queue_time_s``): the work
    queued ahead of the request, at the batch times measured, would keep it waiting
    ``wait_s``, more than ``limit_s``. With ``slo_s`` (``max_queue_time_s: auto``), the
    bound was what the class's ``slo_s`` leaves for waiting: less the request's own
    batch, and less what its reading and answer take."""

    def __init__(
        self, queue: str, wait_s: float, limit_s: float, slo_s: float | None = None
    ) -> None:
        self.queue = queue
        self.limit = limit_s
        self.wait_s = wait_s
        self.slo_s = slo_s
        bound = (
            f"max_queue_time_s={duration_text(limit_s)}"
            if slo_s is None
            else f"the {duration_text(limit_s)} that slo_s={duration_text(slo_s)} leaves for it "
            "(max_queue_time_s: auto)"
        )
        CarpoolError.__init__(
            self,
            f"queue {queue!r} holds about {duration_text(wait_s)} of work ahead of this request, "
            f"more than {bound}; retry later",
        )

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.queue, self.wait_s, self.limit, self.slo_s), {}


class DeadlineExceeded(CarpoolError, TimeoutError):
    """The request's deadline passed while it waited, or would pass before its batch
    ended (``left_s``: the time it still had); it never ran."""

    def __init__(
        self, request_id: int, timeout_s: float, waited_s: float, left_s: float = 0.0
    ) -> None:
        self.request_id = request_id
        self.timeout_s = timeout_s
        self.waited_s = waited_s
        self.left_s = left_s
        if left_s > 0:
            what = (
                f"request {request_id} would end past its timeout of {duration_text(timeout_s)}: "
                f"it had {duration_text(left_s)} left, less than its batch takes here (as "
                "measured), and was dropped before it ran rather than answered late"
            )
        else:
            what = (
                f"request {request_id} waited {duration_text(waited_s)}, past its timeout of "
                f"{duration_text(timeout_s)}, and was dropped before it ran"
            )
        super().__init__(
            f"{what}; raise the timeout (timeout_s, or KServe's timeout parameter in µs) "
            "or add capacity"
        )

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.request_id, self.timeout_s, self.waited_s, self.left_s), {}


class ModelError(CarpoolError):
    """The model raised while running this request; ``__cause__`` is the original error."""

    def __init__(self, message: str, *, request_id: int | None = None) -> None:
        self.reason = message
        self.request_id = request_id
        where = f"request {request_id}: " if request_id is not None else ""
        super().__init__(f"{where}{message}")

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.reason,), {"request_id": self.request_id}


class BatchTimeout(ModelError, TimeoutError):
    """The request's batch ran past the model's ``batch_timeout_s``: the model did not
    return, so every request of that batch fails with this, and the replica it ran on is
    given up (its thread cannot be stopped) and replaced by a fresh one."""

    def __init__(
        self,
        model: str,
        batch_timeout_s: float,
        replica_id: int,
        *,
        request_id: int | None = None,
    ) -> None:
        self.model = model
        self.batch_timeout_s = batch_timeout_s
        self.replica_id = replica_id
        super().__init__(
            f"model {model!r} did not finish this request's batch within batch_timeout_s="
            f"{batch_timeout_s:g} s on replica {replica_id}: the batch failed and the replica "
            "is being replaced; if the model can take that long, raise batch_timeout_s "
            "(null for none), else look for what made it hang on this input",
            request_id=request_id,
        )

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.model, self.batch_timeout_s, self.replica_id), {"request_id": self.request_id}


class CapacityError(CarpoolError, MemoryError):
    """Out of memory even when the request ran alone."""

    def __init__(self, request_id: int, num_items: int) -> None:
        self.request_id = request_id
        self.num_items = num_items
        super().__init__(
            f"request {request_id} ({num_items} items) ran out of memory even alone; "
            "send fewer items per request or give the model more memory"
        )

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.request_id, self.num_items), {}


class Closed(CarpoolError):
    """The batcher is stopped or draining and accepts no new requests."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"batcher {name!r} is not accepting requests (stopped or draining)")

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.name,), {}


# -- signals between core's stages (see the module docstring) --------------------------


class CallNotRun(Exception):
    """A model call that did not run: its requests are answered or run again without it."""


class StartedLate(CallNotRun):
    """A model call reached its turn after the earliest deadline of its requests: it did
    not run (a batch that waited behind a busy replica, or a later group or bisection
    half of one). ``started_s`` is when it would have started."""

    def __init__(self, started_s: float) -> None:
        super().__init__(f"the call reached its turn at {started_s:.6f}, past a deadline")
        self.started_s = started_s


class Withdrawn(CallNotRun):
    """A model call reached its turn with some of its requests cancelled by their callers
    (a batch that waited behind a busy replica, or a later group or bisection half of
    one): it did not run, so the others can run without them."""

    def __init__(self, started_s: float) -> None:
        super().__init__(f"the call reached its turn at {started_s:.6f} with requests cancelled")
        self.started_s = started_s


class Displaced(CallNotRun):
    """A model call waited on a replica thread that was given up (behind a call that
    hung): it never started, so it can run again on the replica's fresh thread."""

    def __init__(self, at_s: float) -> None:
        super().__init__(f"the call never started: its thread was given up at {at_s:.6f}")
        self.at_s = at_s


class Hung(Exception):
    """A model call ran past ``batch_timeout_s``: its replica gave up on it."""

    def __init__(self, started_s: float, timeout_s: float, replica_id: int) -> None:
        super().__init__(f"the call started at {started_s:.6f} and ran past {timeout_s} s")
        self.started_s = started_s
        self.timeout_s = timeout_s
        self.replica_id = replica_id


class ReplicaDied(Exception):
    """A replica's process ended while it ran a model call (a crash, ``kill -9``, the OOM
    killer): its requests fail with a ModelError saying so, unless it ran again elsewhere."""

    def __init__(self, model: str, replica_id: int, exitcode: int | None) -> None:
        if exitcode is None:
            how = "with an unknown status"
        elif exitcode < 0:
            how = f"killed by signal {-exitcode}"
        else:
            how = f"with exit code {exitcode}"
        super().__init__(
            f"the process of replica {replica_id} of model {model!r} died ({how}) while "
            "running this batch"
        )
        self.exitcode = exitcode
        self.replica_id = replica_id


class ActorDied(ReplicaDied):
    """A replica's Ray actor died while it ran a model call (killed, crashed, its node
    lost), or was being started again: ``reason`` is what Ray said; ``where`` the process
    and node it ran on, when known (a lost node is named by it)."""

    def __init__(self, model: str, replica_id: int, reason: str, where: str | None = None) -> None:
        at = f" ({where})" if where else ""
        Exception.__init__(
            self,
            f"the Ray actor of replica {replica_id} of model {model!r}{at} died while "
            f"running this batch: its process or its node was lost ({reason})",
        )
        self.exitcode = None
        self.replica_id = replica_id
        self.reason = reason
        self.where = where
