"""What one server holds for its clients: connections, request bytes, and the time a
request's body may take to arrive.

Past a limit the server refuses rather than grows: a connection over
``max_connections`` gets a 503 with ``Retry-After`` for its first request and is closed;
a request whose body would take the bytes held across all connections past
``max_inflight_bytes`` gets a 503 with ``Retry-After`` (its body read and dropped, the
connection kept). The bytes of a request are held from its head (its declared length, or
its chunks as they come) until its answer is written or its connection is lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from carpool.errors import ConfigError
from carpool.server.errors import Overloaded

DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_INFLIGHT_BYTES = 256 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """``carpool serve --max-connections``, ``--max-inflight-bytes``, ``--body-timeout-s``."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_inflight_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "an integer >= 1")
        timeout = self.body_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not (timeout > 0 and math.isfinite(timeout))
        ):
            raise ConfigError("body_timeout_s", timeout, "a finite number of seconds > 0")


class InflightBytes:
    """The request bytes the server's connections hold, against ``max_bytes``."""

    __slots__ = ("held_bytes", "max_bytes", "num_refused")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self.num_refused = 0  # requests refused for it (carpool_refused_inflight_bytes_total)

    def take(self, size_bytes: int) -> bool:
        """Hold ``size_bytes`` more, or refuse (False) when that passes the budget. A
        request alone larger than the budget is still taken when nothing else is held:
        ``--max-request-bytes`` is the per-request limit, not this."""
        held = self.held_bytes + size_bytes
        if held > self.max_bytes and self.held_bytes:
            self.num_refused += 1
            return False
        self.held_bytes = held
        return True

    def release(self, size_bytes: int) -> None:
        self.held_bytes -= size_bytes


def over_inflight_bytes(limits: ServerLimits) -> Overloaded:
    return Overloaded(
        f"{limits.max_inflight_bytes} bytes of requests held across all connections "
        "(carpool serve --max-inflight-bytes)"
    )


def over_connections(limits: ServerLimits) -> Overloaded:
    return Overloaded(
        f"{limits.max_connections} open connections (carpool serve --max-connections)"
    )
