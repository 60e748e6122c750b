"""What carpool's fast HTTP path needs from uvicorn's private httptools protocol.

:mod:`carpool.server.fasthttp` subclasses ``uvicorn.protocols.http.httptools_impl.
HttpToolsProtocol``, calls and overrides its methods, reads the attributes its
``__init__`` and ``connection_made`` set, and stands a :class:`~carpool.server.cycles.
FastCycle` in its ``self.cycle``. None of that is uvicorn's public API. This module names
every piece of it, so that :func:`check` can fail at start-up (and a test in CI) with a
message naming the uvicorn version, instead of a request failing at run time.

``pyproject.toml`` bounds uvicorn to the minor versions this was checked on (and the lock
file pins one); on an upgrade, run ``tests/unit/server/test_uvicorn_contract.py`` first.
"""

from __future__ import annotations

import inspect
import re
from importlib import metadata

from carpool.errors import ConfigError

CHECKED_UVICORN = "0.55"

# Methods fasthttp overrides, calls through super() or calls on itself.
PROTOCOL_METHODS = (
    "connection_made",
    "connection_lost",
    "data_received",
    "on_message_begin",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "resume_writing",
    "timeout_keep_alive_handler",
    "_start_asgi_task",
    "_unset_keepalive_if_required",
    "on_url",
    "on_header",
)
# Attributes set by HttpToolsProtocol.__init__ that fasthttp reads or writes.
PROTOCOL_ATTRIBUTES = (
    "app",
    "loop",
    "logger",
    "access_logger",
    "access_log",
    "parser",
    "server_state",
    "timeout_keep_alive",
    "transport",
    "flow",
    "client",
    "pipeline",
    "headers",
    "cycle",
    "url",
    "expect_100_continue",
)
# Attributes uvicorn's protocol reads from ``self.cycle``, as of CHECKED_UVICORN; FastCycle
# provides each of them. A new one in a later uvicorn is read from a FastCycle that lacks it.
CYCLE_READS = frozenset(
    {"disconnected", "keep_alive", "message_event", "more_body", "response_complete"}
)
# Read only where fasthttp keeps FastCycles away: ``run_asgi`` by _start_asgi_task, which
# gets ASGI cycles only, and ``body`` by on_body, which takes a fast request's body itself.
_CYCLE_READS_IGNORED = frozenset({"run_asgi", "body"})


def uvicorn_version() -> str:
    """The installed uvicorn's version."""
    return metadata.version("uvicorn")


def missing() -> list[str]:
    """What fasthttp needs from the installed uvicorn and does not find there, in words;
    empty when everything is in place."""
    from uvicorn.protocols.http import httptools_impl

    gaps: list[str] = []
    for name in ("HttpToolsProtocol", "RequestResponseCycle", "STATUS_LINE"):
        if not hasattr(httptools_impl, name):
            gaps.append(f"uvicorn.protocols.http.httptools_impl.{name}")
    protocol = getattr(httptools_impl, "HttpToolsProtocol", None)
    if protocol is None:
        return gaps
    for name in PROTOCOL_METHODS:
        if not callable(getattr(protocol, name, None)):
            gaps.append(f"method HttpToolsProtocol.{name}")
    try:
        source = inspect.getsource(protocol)
    except (OSError, TypeError):  # installed without its .py sources
        return [*gaps, "the source of HttpToolsProtocol, to check its attributes"]
    for name in PROTOCOL_ATTRIBUTES:
        if not re.search(rf"self\.{name}\b\s*(:[^=\n]*)?=[^=]", source):
            gaps.append(f"attribute HttpToolsProtocol.{name} (set by its methods)")
    for name in sorted(cycle_reads(source) - CYCLE_READS - _CYCLE_READS_IGNORED):
        gaps.append(f"cycle.{name}, read by HttpToolsProtocol and not provided by FastCycle")
    return gaps


def cycle_reads(protocol_source: str) -> set[str]:
    """The attribute names the protocol's source reads from a cycle (``cycle.x``)."""
    return set(re.findall(r"\bcycle\.([A-Za-z_]\w*)", protocol_source))


def check() -> None:
    """Raises ``ConfigError`` naming the uvicorn version and what is missing when the
    installed uvicorn lacks what the fast path needs."""
    gaps = missing()
    if gaps:
        raise ConfigError(
            "uvicorn",
            uvicorn_version(),
            f"uvicorn {CHECKED_UVICORN}.x, whose httptools protocol carpool's fast path "
            f"extends; missing here: {'; '.join(gaps)} (install the version in "
            f"requirements.lock)",
        )
