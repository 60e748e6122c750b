"""carpool: inference serving where requests share the ride.

Submit single items; carpool holds them for a short, bounded time and runs them through
the model together. See ``carpool.batched`` and ``carpool.Batcher``.
"""

from carpool.core import (
    BatchedFunction,
    Batcher,
    BatchPolicy,
    ClassPolicy,
    FakeClock,
    RequestTrace,
    TelemetrySnapshot,
    batched,
)
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

__version__ = "0.1.0"

__all__ = [
    "BatchPolicy",
    "BatchTimeout",
    "BatchedFunction",
    "Batcher",
    "CapacityError",
    "CarpoolError",
    "ClassPolicy",
    "Closed",
    "ConfigError",
    "DeadlineExceeded",
    "FakeClock",
    "InvalidInput",
    "ModelError",
    "QueueFull",
    "QueueTooLong",
    "RequestTrace",
    "TelemetrySnapshot",
    "__version__",
    "batched",
]
