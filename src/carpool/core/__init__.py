"""The batching engine: pure Python and NumPy, no HTTP, no torch import."""

from carpool.core.batcher import Batcher
from carpool.core.clock import Clock, FakeClock, MonotonicClock
from carpool.core.decorator import BatchedFunction, batched
from carpool.core.policy import BatchPolicy, ClassPolicy
from carpool.core.request import RequestTrace
from carpool.core.telemetry import TelemetrySnapshot

__all__ = [
    "BatchPolicy",
    "BatchedFunction",
    "Batcher",
    "ClassPolicy",
    "Clock",
    "FakeClock",
    "MonotonicClock",
    "RequestTrace",
    "TelemetrySnapshot",
    "batched",
]
