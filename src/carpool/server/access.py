"""Who may use a running server, and what the network may change in it.

``carpool serve --api-key KEY`` (or ``CARPOOL_API_KEY``; the flag wins) makes every HTTP
route and gRPC call need the key, as ``Authorization: Bearer KEY`` (gRPC: the
``authorization`` metadata), except what probes and scrapers call without one::

    HTTP  /v2/health/*, /health, /ping              always open
          /metrics                                  open unless --protect-metrics
    gRPC  ServerLive, ServerReady, ModelReady       always open (Triton's and KServe's probes)

A request without the key is refused before its body is read or decoded, on both ways
in: HTTP, through carpool's protocol or the ASGI app alike (the router,
``carpool.server.http.router.route``: 401, ``WWW-Authenticate: Bearer``; the infer fast
path takes only a request that has the key), and gRPC (:class:`ApiKeyInterceptor`:
UNAUTHENTICATED, before the message is parsed). The key
is compared in constant time and never repeated in an answer or a log line.

``--allow-policy-updates`` (off by default, as Triton's control APIs are) lets
``POST /v2/models/{m}/policy`` change a batch policy while serving; without it that route
is a 403 (:class:`~carpool.server.errors.PolicyUpdatesOff`).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints

from carpool.errors import ConfigError
from carpool.server.errors import Unauthorized

API_KEY_ENV = "CARPOOL_API_KEY"
# The gRPC calls a probe makes, answered without the key (as /v2/health/* over HTTP).
_PROBES = ("ServerLive", "ServerReady", "ModelReady")
OPEN_GRPC_METHODS = frozenset(f"/inference.GRPCInferenceService/{name}" for name in _PROBES)
_BEARER = b"bearer"


class _Hidden:
    """Stands for the key in an error message, which must not repeat it."""

    def __init__(self, key: str) -> None:
        self.length = len(key)

    def __repr__(self) -> str:
        return f"<a key of {self.length} characters, not shown>"


def check_api_key(key: str, source: str = "--api-key") -> None:
    """Raises ConfigError unless ``key`` can be sent as a bearer token: at least one
    character, printable ASCII without spaces. An empty key would serve without one."""
    if not key:
        raise ConfigError(
            source,
            "",
            f"a non-empty key; leave out --api-key and {API_KEY_ENV} to serve without one",
        )
    if not all("!" <= char <= "~" for char in key):
        raise ConfigError(
            source,
            _Hidden(key),
            "printable ASCII characters without spaces (as `openssl rand -hex 32` writes), "
            "which an Authorization header carries as they are",
        )


def api_key_from(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key to serve with: ``flag`` (``--api-key``), else ``CARPOOL_API_KEY``, else
    None (no key).

    Raises:
        ConfigError: the key given is empty or not printable ASCII (naming its source).
    """
    if flag is not None:
        check_api_key(flag)
        return flag
    key = environ.get(API_KEY_ENV)
    if key is not None:
        check_api_key(key, API_KEY_ENV)
    return key


@dataclass(frozen=True, slots=True)
class Access:
    """What a server requires of a request, and what the network may change.

    Args:
        api_key: the key every request must carry (None: none needed).
        protect_metrics: ``/metrics`` needs the key too.
        allow_policy_updates: ``POST .../policy`` may change a batch policy.

    Raises:
        ConfigError: ``api_key`` is empty or not printable ASCII (it is not shown).
    """

    api_key: str | None = field(default=None, repr=False)
    protect_metrics: bool = False
    allow_policy_updates: bool = False
    _key: bytes | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.api_key is not None:
            check_api_key(self.api_key)
        object.__setattr__(self, "_key", None if self.api_key is None else self.api_key.encode())

    def allows(self, authorization: bytes | None) -> bool:
        """Whether a request whose ``Authorization`` value is ``authorization`` (None:
        none sent) may be served; always, when there is no key."""
        key = self._key
        if key is None:
            return True
        token = b"" if authorization is None else _bearer_token(authorization)
        return hmac.compare_digest(token, key)

    def is_open(self, path: str) -> bool:
        """Whether the HTTP ``path`` is answered without the key: ``/v2/health/*``,
        ``/health`` and ``/ping``, and ``/metrics`` unless ``protect_metrics``. Split as
        ``KServeApp`` routes it (empty segments dropped), so no path reaches a route
        other than the one checked."""
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["v2", "health"] or parts in (["health"], ["ping"]):
            return True
        return parts == ["metrics"] and not self.protect_metrics

    def check_http(self, path: str, authorization: bytes | None) -> None:
        """Raises Unauthorized (401) unless the request may be served."""
        if not (self.allows(authorization) or self.is_open(path)):
            raise refusal(authorization)


# No key, /metrics open, no policy changes: what a KServeApp serves with unless told.
DEFAULT_ACCESS = Access()


def _bearer_token(authorization: bytes) -> bytes:
    """The token of ``Bearer <token>`` (the scheme in any case, RFC 9110 11.1); empty
    for another scheme."""
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip() if scheme.lower() == _BEARER else b""


def refusal(authorization: bytes | None) -> Unauthorized:
    """Why a request with this ``Authorization`` value was refused, without its value."""
    if authorization is None:
        return Unauthorized("no API key was sent")
    if _bearer_token(authorization) == b"":
        return Unauthorized("the Authorization header is not 'Bearer <key>'")
    return Unauthorized("the API key sent is not this server's")


def _metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    """The first ``authorization`` metadata value, as bytes (as HTTP's header)."""
    for name, value in metadata or ():
        if name == "authorization":
            return value if isinstance(value, bytes) else value.encode()
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # no grpc hints
    """Refuses a gRPC call without the key with UNAUTHENTICATED before its message is
    parsed; the probes' calls (:data:`OPEN_GRPC_METHODS`) go through without one. The
    refusal sets the status and returns, as ``grpc.refused_call`` does: ``context.abort()``
    kept every refused call's request alive."""

    def __init__(self, access: Access) -> None:
        self.access = access

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        authorization = _metadata_value(details.invocation_metadata)
        if handler is None or details.method in OPEN_GRPC_METHODS:
            return handler  # an unknown method: grpcio's UNIMPLEMENTED, which tells nothing
        if self.access.allows(authorization):
            return handler
        message = str(refusal(authorization))

        def refuse(context: grpc.aio.ServicerContext[Any, Any]) -> None:
            context.set_code(grpc.StatusCode.UNAUTHENTICATED)
            context.set_details(message)

        if handler.request_streaming:  # ModelStreamInfer

            async def refuse_stream(requests: Any, context: Any) -> Any:
                refuse(context)
                return
                yield  # an async generator that answers nothing

            return grpc.stream_stream_rpc_method_handler(refuse_stream)

        async def refuse_unary(request: bytes, context: Any) -> bytes:
            refuse(context)
            return b""

        return grpc.unary_unary_rpc_method_handler(refuse_unary)


def grpc_interceptors(access: Access | None) -> list[ApiKeyInterceptor]:
    """The interceptors a gRPC server serving with ``access`` needs: none without a key
    (no cost per call)."""
    return [] if access is None or access.api_key is None else [ApiKeyInterceptor(access)]
