"""What answers each route: a request, its body, and the served state in; an answer out.

A handler knows nothing of sockets or ASGI: it takes a :class:`Call` and returns an
:data:`Answer` (status, body, headers; the content length is the writer's), or a
:class:`Stream` of server-sent events. Errors it raises are answered by the caller through
:func:`carpool.server.infer.error_response`, the one mapping of errors to the wire. The
model's work it awaits through the call's :class:`Watch`: cancelled when the client
leaves, and the queued request dropped before the model sees it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, TypeVar

import orjson

from carpool import __version__
from carpool.config import POLICY_FIELDS
from carpool.core.adaptive import AdaptiveState
from carpool.core.policy import BatchPolicy
from carpool.errors import InvalidInput
from carpool.server import completions, openai
from carpool.server.dashboard import Dashboard, static_file
from carpool.server.encoding import inflate, response_encoding
from carpool.server.errors import NotFound
from carpool.server.http.router import HttpRequest, Route, RouteKind
from carpool.server.infer import (
    Answer,
    Headers,
    InferPlans,
    compressed,
    infer_response,
    prepare_infer,
)
from carpool.server.live import live_figures
from carpool.server.metrics import Metrics
from carpool.server.openai_fields import IgnoredFields
from carpool.server.repository import ModelRepository, ServedModel
from carpool.server.stats import model_stats
from carpool.server.timelines import TraceHub, capture, capture_seconds

# Triton's extension names for what carpool serves: schedule_policy is the priority and
# timeout request parameters; classification is server/classification.py. Not served, each
# endpoint a 501 (server/http/router.py), each request parameter a 400: model_repository
# (only its index is answered), shared memory, trace, logging, sequence.
EXTENSIONS = [
    "binary_tensor_data", "classification", "model_configuration", "statistics", "parameters",
    "schedule_policy",
]  # fmt: skip
JSON = (b"content-type", b"application/json")
SSE_HEADERS: Headers = ((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"))
# What a batch policy set over the network may be (--allow-policy-updates): a longer delay
# leaves requests unanswered for as long, a shorter timeout fails every request.
MAX_POLICY_DELAY_S = 10.0
MIN_POLICY_TIMEOUT_S = 0.001
T = TypeVar("T")


class Served(Protocol):
    """What the handlers read of the server (:class:`carpool.server.app.KServeApp`)."""

    repository: ModelRepository
    metrics: Metrics
    plans: InferPlans
    max_body_bytes: int
    dashboard: Dashboard | None  # None: served with --no-dashboard
    timelines: TraceHub
    openai_fields: IgnoredFields


@dataclass(frozen=True, slots=True)
class Stream:
    """A 200 whose body is sent as it comes (chunked): server-sent events. Closing
    ``chunks`` (its client left) aborts what produces them."""

    chunks: AsyncGenerator[bytes, None]
    headers: Headers = SSE_HEADERS


class Watch(Protocol):
    """Awaits a model's ``work`` for a request, cancelled when its client leaves (its queued
    request is then withdrawn; raised as the caller's cancellation). Only the model's work
    is watched: a request whose client left while it was being read and prepared still
    reaches its model, and is withdrawn from there (as it is counted: an abort)."""

    def __call__(self, work: Awaitable[T], /) -> Awaitable[T]: ...


@dataclass(frozen=True, slots=True)
class Call:
    """A routed request, as its handler takes it: ``body`` is empty unless the route
    reads it (:attr:`Route.reads_body`)."""

    route: Route
    request: HttpRequest
    body: bytes
    watch: Watch


Handler = Callable[[Served, Call], Awaitable["Answer | Stream"]]


async def respond(served: Served, call: Call) -> Answer | Stream:
    """The answer to ``call``. Raises what the answer is an error for."""
    return await _HANDLERS[call.route.kind](served, call)


def _json(document: Any) -> Answer:
    return 200, orjson.dumps(document), (JSON,)


def _model(call: Call) -> ServedModel:
    model = call.route.model
    assert model is not None, "the router names a model for this route"
    return model


def _inflated(served: Served, call: Call) -> bytes:
    """The body, inflated when it came with ``Content-Encoding: gzip`` or ``deflate``
    (``tritonclient``'s ``request_compression_algorithm``), within the same limit."""
    encoding = call.request.headers.content_encoding
    body = call.body
    return body if encoding is None else inflate(body, encoding, served.max_body_bytes)


async def _metrics(served: Served, call: Call) -> Answer:
    request = call.request
    headers = request.headers
    scrape, fields = served.metrics.answer(headers.accept, headers.accept_encoding, request.query)
    return 200, scrape, fields


async def _live(served: Served, call: Call) -> Answer:
    return 200, b"", ()


async def _ready(served: Served, call: Call) -> Answer:
    return (200 if served.repository.is_ready else 503), b"", ()


async def _version(served: Served, call: Call) -> Answer:
    return _json({"version": __version__})


async def _server_metadata(served: Served, call: Call) -> Answer:
    return _json({"name": "carpool", "version": __version__, "extensions": EXTENSIONS})


def _stats(model: ServedModel) -> dict[str, Any]:
    """Triton's statistics of ``model``, and under ``"carpool"`` what it is doing now
    (server/live.py: what carpool top shows)."""
    return model_stats(model) | {"carpool": live_figures(model)}


async def _models_stats(served: Served, call: Call) -> Answer:
    return _json({"model_stats": [_stats(m) for m in served.repository]})


async def _timelines(served: Served, call: Call) -> Answer:
    seconds = capture_seconds(call.request.query)
    return _json(await call.watch(capture(served.timelines, seconds)))


async def _index(served: Served, call: Call) -> Answer:
    is_ready_only = _index_ready(_inflated(served, call))
    return _json(served.repository.index(is_ready_only=is_ready_only))


async def _infer(served: Served, call: Call) -> Answer:
    model, headers = _model(call), call.request.headers
    infer = prepare_infer(model, _inflated(served, call), headers.header_length, served.plans)
    result = await call.watch(model.run(infer.payload, infer.options, call.request.arrival_s))
    accept = headers.accept_encoding
    encoding = None if accept is None else response_encoding(accept)
    return compressed(infer_response(model, infer, result), encoding)


async def _policy(served: Served, call: Call) -> Answer:
    batcher = _model(call).require_batcher()
    if call.route.kind is RouteKind.POLICY_SET:
        changes = _policy_changes(_inflated(served, call), batcher.first_policy)
        batcher.update_policy(**changes)
    document = _policy_document(batcher.policy)
    adaptive = batcher.adaptive_state()
    if adaptive is not None:
        document["adaptive"] = adaptive_document(adaptive)
    return _json(document)


async def _model_metadata(served: Served, call: Call) -> Answer:
    return _json(_model(call).metadata())


async def _model_ready(served: Served, call: Call) -> Answer:
    return (200 if _model(call).is_ready else 503), b"", ()


async def _model_config(served: Served, call: Call) -> Answer:
    return _json(_model(call).config())


async def _model_stats(served: Served, call: Call) -> Answer:
    return _json({"model_stats": [_stats(_model(call))]})


async def _dashboard(served: Served, call: Call) -> Answer:
    """``/dashboard`` (the page), ``/dashboard/series`` (its data), ``/dashboard/{file}``."""
    path = call.request.path
    if served.dashboard is None:
        raise NotFound(
            f"path {path!r} (the server runs with --no-dashboard)", ["/v2/...", "/metrics"]
        )
    name = path.rstrip("/").removeprefix("/dashboard").lstrip("/") or "dashboard.html"
    if name == "series":
        return _json(served.dashboard.series())
    found = static_file(name)
    if found is None:
        raise NotFound(f"path {path!r}", ["/dashboard", "/dashboard/series"])
    data, content_type = found
    return 200, data, ((b"content-type", content_type),)


async def _embeddings(served: Served, call: Call) -> Answer:
    work = openai.create_embeddings(served.repository, _inflated(served, call))
    return 200, await call.watch(work), (JSON,)


async def _openai_models(served: Served, call: Call) -> Answer:
    return 200, openai.list_models(served.repository), (JSON,)


async def _openai_model(served: Served, call: Call) -> Answer:
    assert call.route.name is not None, "the router names the model"
    return 200, openai.retrieve_model(served.repository, call.route.name), (JSON,)


async def _completions(served: Served, call: Call) -> Answer | Stream:
    is_chat = call.route.kind is RouteKind.CHAT_COMPLETIONS
    document = _inflated(served, call)
    prepared = await completions.prepare(
        served.repository, document, is_chat=is_chat, fields=served.openai_fields
    )
    if prepared.is_stream:  # watched by the caller, as it pumps the chunks
        return Stream(completions.stream(prepared))
    return 200, await call.watch(completions.respond(prepared)), (JSON,)


_HANDLERS: dict[RouteKind, Handler] = {
    RouteKind.METRICS: _metrics,
    RouteKind.HEALTH_LIVE: _live,
    RouteKind.HEALTH_READY: _ready,
    RouteKind.SERVER_METADATA: _server_metadata,
    RouteKind.MODELS_STATS: _models_stats,
    RouteKind.TIMELINES: _timelines,
    RouteKind.REPOSITORY_INDEX: _index,
    RouteKind.INFER: _infer,
    RouteKind.POLICY_GET: _policy,
    RouteKind.POLICY_SET: _policy,
    RouteKind.MODEL_METADATA: _model_metadata,
    RouteKind.MODEL_READY: _model_ready,
    RouteKind.MODEL_CONFIG: _model_config,
    RouteKind.MODEL_STATS: _model_stats,
    RouteKind.EMBEDDINGS: _embeddings,
    RouteKind.OPENAI_MODELS: _openai_models,
    RouteKind.OPENAI_MODEL: _openai_model,
    RouteKind.COMPLETIONS: _completions,
    RouteKind.CHAT_COMPLETIONS: _completions,
    RouteKind.DASHBOARD: _dashboard,
    RouteKind.VERSION: _version,
}


def _index_ready(body: bytes) -> bool:
    """A repository index body: empty (what ``tritonclient`` sends) or a JSON object with
    an optional boolean ``ready`` (only the models ready for inference)."""
    try:
        request = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError as error:
        raise InvalidInput(f"repository index body: expected a JSON object ({error})") from None
    ready = request.get("ready", False) if isinstance(request, dict) else None
    if not isinstance(ready, bool):
        raise InvalidInput(
            f"repository index body {body[:100]!r}: expected a JSON object whose optional "
            f"'ready' is true or false"
        )
    return ready


def _policy_changes(body: bytes, configured: BatchPolicy) -> dict[str, Any]:
    """A policy POST body: a JSON object of BatchPolicy fields (lists become tuples).
    ``configured``: the model's policy as its config set it, whose values are taken back
    whatever the bounds (what ``carpool tune`` restores, what a GET gave)."""
    try:
        changes = orjson.loads(body or b"{}")
    except orjson.JSONDecodeError as error:
        raise InvalidInput(f"policy body: expected a JSON object ({error})") from None
    if not isinstance(changes, dict):
        raise InvalidInput(f"policy body: expected a JSON object, got {type(changes).__name__}")
    unknown = sorted(set(changes) - set(POLICY_FIELDS))
    if unknown:
        raise InvalidInput(f"policy body: unknown field(s) {unknown}; expected {POLICY_FIELDS}")
    _check_bounds(changes, configured)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()}


def _check_bounds(changes: dict[str, Any], configured: BatchPolicy) -> None:
    """Refuse a ``max_delay_s`` over MAX_POLICY_DELAY_S and a ``timeout_s`` under
    MIN_POLICY_TIMEOUT_S, unless it is the value the model's config set; values of another
    kind are the policy's to refuse. Priority classes are not taken over the network
    (POLICY_FIELDS), so these are all there is."""
    delay, timeout = changes.get("max_delay_s"), changes.get("timeout_s")
    if delay == configured.max_delay_s:
        delay = None
    if timeout == configured.timeout_s:
        timeout = None
    if _is_number(delay) and delay > MAX_POLICY_DELAY_S:
        raise InvalidInput(
            f"policy body: max_delay_s {delay!r} is over {MAX_POLICY_DELAY_S} s, the most a "
            "policy set over the network may wait (a serve config may set more)"
        )
    if _is_number(timeout) and timeout < MIN_POLICY_TIMEOUT_S:
        raise InvalidInput(
            f"policy body: timeout_s {timeout!r} is under {MIN_POLICY_TIMEOUT_S} s, the least "
            "a policy set over the network may give a request (null: no timeout)"
        )


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def adaptive_document(state: AdaptiveState) -> dict[str, Any]:
    """What ``max_delay_s``/``max_batch_size`` "auto" has in force (the policy's
    ``adaptive`` key): per class, and the fitted batch-time line; sizes, the company
    rate and ``per_item_s`` count ``unit`` (items, or tokens/cost under a budget)."""
    return {
        "classes": {
            c.name: {
                "delay_s": c.delay_s,
                "batch_size": c.batch_size,
                "max_batch_size": c.max_batch_size,
                "arrival_rate_rps": c.arrival_rate_rps,
                "company_rate_rps": c.company_rate_rps,
                "closed_loop_share": c.closed_loop_share,
                "refusing": c.refusing,
            }
            for c in state.classes
        },
        "batch_time_fit": {
            "overhead_s": state.overhead_s,
            "per_item_s": state.per_item_s,
            "num_batches": state.num_batches,
            "stretch": state.stretch,
        },
        "unit": state.unit,
    }


def _policy_document(policy: BatchPolicy) -> dict[str, Any]:
    document = {name: getattr(policy, name) for name in POLICY_FIELDS}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in document.items()}
