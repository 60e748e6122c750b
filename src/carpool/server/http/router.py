"""The one router: a request's method and path to the :class:`Route` that answers it.

Every path carpool serves is told apart here, for requests read by carpool's own protocol
(:mod:`carpool.server.http.connection`) and by the ASGI app alike::

    GET  /v2/health/live | /v2/health/ready
    GET  /health | GET, POST /ping                       readiness, as vLLM's server answers it
    GET  /version                                        {"version": ...}, as vLLM's
    GET  /v2                                             server metadata
    GET  /v2/models/{m}[/versions/{v}]                   model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready | /config | /stats
    GET  /v2/models/stats                                every model's statistics
    GET  /v2/timelines?seconds=S                         requests finished in the next S s
    POST /v2/repository/index                            every model and its state
    POST /v2/models/{m}[/versions/{v}]/infer             JSON and binary tensors
    GET | POST /v2/models/{m}[/versions/{v}]/policy      batch policy; POST changes fields
    POST /v1/embeddings | GET /v1/models[/{m}]           OpenAI-compatible (server/openai.py)
    POST /v1/completions | /v1/chat/completions          generation (server/completions.py)
    GET  /metrics                                        Prometheus exposition
    GET  /dashboard | /dashboard/series | /dashboard/{file}   live charts (server/dashboard.py)

Whatever can be refused from the head alone is refused here, before the body is read: a
missing API key (401), an unknown path or model (404), another method (405), an endpoint
carpool does not implement (501), a policy change while they are off (403).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from carpool.server.access import Access
from carpool.server.errors import MethodNotAllowed, NotFound, NotSupported, PolicyUpdatesOff
from carpool.server.http.headers import RequestHeaders
from carpool.server.repository import ModelRepository, ServedModel

# /v2/{first segment} of Triton extensions' endpoints carpool does not implement.
_UNSERVED = {
    "repository": ("model repository load/unload", "model_repository"),
    "systemsharedmemory": ("system shared memory", "system_shared_memory"),
    "cudasharedmemory": ("CUDA shared memory", "cuda_shared_memory"),
    "trace": ("trace settings", "trace"),
    "logging": ("log settings", "logging"),
}
_OPENAI_ROUTES = [
    "POST /v1/embeddings", "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
    "GET /v1/models/{model}",
]  # fmt: skip


class RouteKind(enum.Enum):
    METRICS = "metrics"
    HEALTH_LIVE = "health live"
    HEALTH_READY = "health ready"
    SERVER_METADATA = "server metadata"
    MODELS_STATS = "every model's statistics"
    TIMELINES = "request timelines"
    REPOSITORY_INDEX = "repository index"
    INFER = "infer"
    POLICY_GET = "policy"
    POLICY_SET = "policy update"
    MODEL_METADATA = "model metadata"
    MODEL_READY = "model ready"
    MODEL_CONFIG = "model config"
    MODEL_STATS = "model statistics"
    EMBEDDINGS = "embeddings"
    OPENAI_MODELS = "models"
    OPENAI_MODEL = "model"
    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat completions"
    DASHBOARD = "dashboard"
    VERSION = "version"


# The routes whose answer needs the request's body; the others are answered from the head.
_READS_BODY = frozenset(
    {
        RouteKind.REPOSITORY_INDEX,
        RouteKind.INFER,
        RouteKind.POLICY_SET,
        RouteKind.EMBEDDINGS,
        RouteKind.COMPLETIONS,
        RouteKind.CHAT_COMPLETIONS,
    }
)


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: what answers it, and the model it names (if any)."""

    kind: RouteKind
    model: ServedModel | None = None
    name: str | None = None  # the model a route names that is not a ServedModel (/v1/models/m)

    @property
    def reads_body(self) -> bool:
        return self.kind in _READS_BODY


@dataclass(slots=True)
class HttpRequest:
    """A request as the route handlers see it: the head, read once."""

    method: str
    path: str  # percent-decoded, without the query
    query: bytes
    headers: RequestHeaders
    arrival_s: float  # when its first byte was read (time.monotonic)

    @property
    def is_openai(self) -> bool:
        """On ``/v1/``: errors are answered as OpenAI's error object."""
        return self.path.startswith("/v1/")


def route(repository: ModelRepository, access: Access, request: HttpRequest) -> Route:
    """The route answering ``request``.

    Raises:
        Unauthorized: the API key is required and missing or wrong.
        NotFound, MethodNotAllowed, NotSupported, PolicyUpdatesOff: as its name says;
        ConfigError: a policy asked of a model without one (generation).
    """
    access.check_http(request.path, request.headers.authorization)
    return route_path(repository, access, request.method, request.path)


def route_path(repository: ModelRepository, access: Access, method: str, path: str) -> Route:
    """The route of ``method`` and ``path``, the API key aside (raises as :func:`route`)."""
    parts = [p for p in path.split("/") if p]
    if parts == ["metrics"]:
        _allow(method, path, "GET")
        return Route(RouteKind.METRICS)
    if parts[:1] == ["dashboard"]:  # the page, its series and files: the handler tells them
        _allow(method, path, "GET")
        return Route(RouteKind.DASHBOARD)
    if parts[:1] == ["v1"]:
        return _openai(method, path, parts[1:])
    if parts in (["health"], ["ping"]):  # vLLM's probes: what its clients check first
        _allow(method, path, *(("GET", "POST") if parts[0] == "ping" else ("GET",)))
        return Route(RouteKind.HEALTH_READY)
    if parts == ["version"]:
        _allow(method, path, "GET")
        return Route(RouteKind.VERSION)
    if not parts or parts[0] != "v2":
        raise NotFound(
            f"path {path!r}", ["/v2/...", "/v1/...", "/metrics", "/dashboard", "/health"]
        )
    rest = parts[1:]
    if rest in (["health", "live"], ["health", "ready"]):
        _allow(method, path, "GET")
        return Route(RouteKind.HEALTH_LIVE if rest[1] == "live" else RouteKind.HEALTH_READY)
    if not rest:
        _allow(method, path, "GET")
        return Route(RouteKind.SERVER_METADATA)
    if rest == ["models", "stats"]:  # every model's statistics, as Triton's extension
        _allow(method, path, "GET")
        return Route(RouteKind.MODELS_STATS)
    if rest == ["timelines"]:  # server/timelines.py
        _allow(method, path, "GET")
        return Route(RouteKind.TIMELINES)
    if rest == ["repository", "index"]:
        _allow(method, path, "POST")
        return Route(RouteKind.REPOSITORY_INDEX)
    if rest[0] in _UNSERVED:
        raise NotSupported(*_UNSERVED[rest[0]])
    if rest[0] == "models" and rest[-2:] == ["trace", "setting"]:
        raise NotSupported(*_UNSERVED["trace"])
    if len(rest) < 2 or rest[0] != "models":
        raise NotFound(f"path {path!r}", ["/v2/models/{model}/..."])
    name, version, action = _model_path(rest[1:], path)
    model = repository.get(name, version)
    return _model_route(model, action, method, path, access)


def _model_route(
    model: ServedModel, action: str | None, method: str, path: str, access: Access
) -> Route:
    if action == "infer":
        _allow(method, path, "POST")
        return Route(RouteKind.INFER, model)
    if action == "policy":
        _allow(method, path, "GET", "POST")
        model.require_policy()  # a generation model: no batch policy to show or set, a 400
        if method != "POST":
            return Route(RouteKind.POLICY_GET, model)
        if not access.allow_policy_updates:
            raise PolicyUpdatesOff(model.name)
        return Route(RouteKind.POLICY_SET, model)
    if action not in (None, "ready", "config", "stats"):
        raise NotFound(f"path {path!r}", ["ready", "config", "stats", "infer", "policy"])
    _allow(method, path, "GET")
    kinds = {
        None: RouteKind.MODEL_METADATA,
        "ready": RouteKind.MODEL_READY,
        "config": RouteKind.MODEL_CONFIG,
        "stats": RouteKind.MODEL_STATS,
    }
    return Route(kinds[action], model)


def _openai(method: str, path: str, rest: list[str]) -> Route:
    if rest == ["embeddings"]:
        _allow(method, path, "POST")
        return Route(RouteKind.EMBEDDINGS)
    if rest == ["models"]:
        _allow(method, path, "GET")
        return Route(RouteKind.OPENAI_MODELS)
    if rest[:1] == ["models"]:  # an id may hold slashes ("org/name"), as vLLM's served names do
        _allow(method, path, "GET")
        return Route(RouteKind.OPENAI_MODEL, name="/".join(rest[1:]))
    if rest in (["completions"], ["chat", "completions"]):
        _allow(method, path, "POST")
        return Route(
            RouteKind.COMPLETIONS if rest[0] == "completions" else RouteKind.CHAT_COMPLETIONS
        )
    raise NotFound(f"{method} {path!r}", _OPENAI_ROUTES)


def _allow(method: str, path: str, *allowed: str) -> None:
    """Raises MethodNotAllowed (405, with ``Allow``) unless ``method`` is one of
    ``allowed``; HEAD goes with GET, as HTTP has it."""
    if method not in allowed and not (method == "HEAD" and "GET" in allowed):
        raise MethodNotAllowed(method, path, allowed)


def _model_path(parts: list[str], path: str) -> tuple[str, str | None, str | None]:
    name, rest = parts[0], parts[1:]
    version = None
    if rest[:1] == ["versions"]:
        if len(rest) < 2:
            raise NotFound(f"path {path!r}", ["/v2/models/{model}/versions/{version}"])
        version, rest = rest[1], rest[2:]
    if len(rest) > 1:
        raise NotFound(f"path {path!r}", ["ready", "config", "stats", "infer"])
    return name, version, (rest[0] if rest else None)


def infer_model(repository: ModelRepository, access: Access, url: bytes) -> ServedModel | None:
    """The model ``POST url`` infers with, when ``url`` (a raw request target) is plain: no
    query, no escapes, no empty segment (routed as every other path, they reach the same
    model by the handlers); None for any other route, or none."""
    if b"?" in url or b"%" in url or b"//" in url or not url.endswith(b"/infer"):
        return None
    try:
        found = route_path(repository, access, "POST", url.decode("latin-1"))
    except (NotFound, NotSupported, MethodNotAllowed):
        return None
    return found.model if found.kind is RouteKind.INFER else None
