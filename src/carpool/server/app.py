"""KServe v2 (Open Inference Protocol) over HTTP as a bare ASGI app.

No framework sits on the per-request path: routing is a split of the path, bodies are
read once, JSON goes through orjson. Endpoints::

    GET  /v2/health/live | /v2/health/ready
    GET  /v2                                             server metadata
    GET  /v2/models/{m}[/versions/{v}]                   model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready | /config | /stats
    POST /v2/repository/index                            every model and its state
    POST /v2/models/{m}[/versions/{v}]/infer             JSON and binary tensors
    GET | POST /v2/models/{m}[/versions/{v}]/policy      batch policy; POST changes fields
    POST /v1/embeddings | GET /v1/models                 OpenAI-compatible (server/openai.py)
    POST /v1/completions | /v1/chat/completions          generation, streamed as server-sent
                                                         events (server/completions.py)
    GET  /metrics                                        Prometheus exposition

With an API key (:mod:`carpool.server.access`) every route but ``/v2/health/*`` (and
``/metrics`` unless protected) answers a request without it 401, its body unread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from contextlib import aclosing
from typing import Any, TypeGuard

import orjson

from carpool import __version__
from carpool.config import POLICY_FIELDS
from carpool.core.policy import BatchPolicy
from carpool.errors import InvalidInput
from carpool.server import completions, openai
from carpool.server.access import DEFAULT_ACCESS, Access
from carpool.server.encoding import inflate, response_encoding
from carpool.server.errors import (
    DEFAULT_MAX_REQUEST_BYTES,
    MethodNotAllowed,
    NotFound,
    NotSupported,
    PayloadTooLarge,
    PolicyUpdatesOff,
)
from carpool.server.infer import (
    InferPlans,
    compressed,
    error_response,
    infer_response,
    prepare_infer,
)
from carpool.server.limits import InflightBytes, ServerLimits, over_inflight_bytes
from carpool.server.metrics import Metrics
from carpool.server.repository import ModelRepository, ServedModel
from carpool.server.stats import model_stats
from carpool.server.waiting import WaitingRoom

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Triton's extension names for what carpool serves: schedule_policy is the priority and
# timeout request parameters; classification is server/classification.py. Not served, each
# endpoint a 501 naming it (_UNSERVED), each request parameter a 400: model_repository
# (only its index is answered), shared memory, trace, logging, sequence.
EXTENSIONS = [
    "binary_tensor_data", "classification", "model_configuration", "statistics", "parameters",
    "schedule_policy",
]  # fmt: skip
# /v2/{first segment} of the extensions' endpoints carpool does not implement.
_UNSERVED = {
    "repository": ("model repository load/unload", "model_repository"),
    "systemsharedmemory": ("system shared memory", "system_shared_memory"),
    "cudasharedmemory": ("CUDA shared memory", "cuda_shared_memory"),
    "trace": ("trace settings", "trace"),
    "logging": ("log settings", "logging"),
}
_JSON = (b"content-type", b"application/json")
# What a batch policy set over the network may be (--allow-policy-updates): a longer delay
# leaves requests unanswered for as long, a shorter timeout fails every request.
MAX_POLICY_DELAY_S = 10.0
MIN_POLICY_TIMEOUT_S = 0.001


class KServeApp:
    """The ASGI application; starts the models' batchers on lifespan startup and drains
    them on shutdown, so every accepted request is answered before the process exits.
    ``access``: the API key it requires and whether a policy may be changed (by default
    no key, and no policy changes)."""

    def __init__(
        self,
        repository: ModelRepository,
        *,
        max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        limits: ServerLimits | None = None,
        access: Access = DEFAULT_ACCESS,
    ) -> None:
        self.repository = repository
        self.max_body_bytes = max_body_bytes
        self.limits = limits if limits is not None else ServerLimits()
        self.inflight = InflightBytes(self.limits.max_inflight_bytes)
        self.access = access
        self.waiting_room = WaitingRoom()
        self.metrics = Metrics(repository, self.inflight)
        self.plans = InferPlans()
        # The fast path's infer URLs, each with the model it names (fasthttp.py): at most
        # two a model (with and without its version), as only the served ones are kept.
        self.infer_routes: dict[bytes, ServedModel] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.repository.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.repository.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._route(scope, receive, send)
        except ClientGone:
            return  # nobody to answer
        except Exception as exc:
            status, body, headers = error_response(exc, is_openai=scope["path"].startswith("/v1/"))
            if getattr(exc, "is_unread", False):  # close, as the fast path does (uvicorn
                headers = (*headers, _CLOSE)  # honours connection: close)
            await _respond(send, status, body, headers)
        finally:
            self.inflight.release(scope.pop(_HELD, 0))

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method: str = scope["method"]
        self.access.check_http(scope["path"], _header(scope, b"authorization"))
        parts = [p for p in scope["path"].split("/") if p]
        if parts == ["metrics"]:
            _allow(method, scope["path"], "GET")
            body, headers = self.metrics.answer(
                _header(scope, b"accept"),
                _header(scope, b"accept-encoding"),
                scope.get("query_string", b""),
            )
            return await _respond(send, 200, body, headers)
        if parts[:1] == ["v1"]:
            return await self._openai(method, parts[1:], scope, receive, send)
        if not parts or parts[0] != "v2":
            raise NotFound(f"path {scope['path']!r}", ["/v2/...", "/v1/..."])
        rest = parts[1:]
        path = scope["path"]
        if rest in (["health", "live"], ["health", "ready"]):
            _allow(method, path, "GET")
            ready = rest[1] == "live" or self.repository.is_ready
            return await _respond(send, 200 if ready else 503, b"", ())
        if not rest:
            _allow(method, path, "GET")
            return await _json(send, self._server_metadata())
        if rest == ["models", "stats"]:  # every model's statistics, as Triton's extension
            _allow(method, path, "GET")
            return await _json(send, {"model_stats": [model_stats(m) for m in self.repository]})
        if rest == ["repository", "index"]:
            _allow(method, path, "POST")
            is_ready_only = _index_ready(await self._read_body(scope, receive))
            index = self.repository.index(is_ready_only=is_ready_only)
            return await _respond(send, 200, orjson.dumps(index), (_JSON,))
        if rest[0] in _UNSERVED:
            raise NotSupported(*_UNSERVED[rest[0]])
        if rest[0] == "models" and rest[-2:] == ["trace", "setting"]:
            raise NotSupported(*_UNSERVED["trace"])
        if len(rest) < 2 or rest[0] != "models":
            raise NotFound(f"path {path!r}", ["/v2/models/{model}/..."])
        name, version, action = _model_path(rest[1:], path)
        model = self.repository.get(name, version)
        if action == "infer":
            _allow(method, path, "POST")
            return await self._infer(model, scope, receive, send)
        if action == "policy":
            _allow(method, path, "GET", "POST")
            batcher = model.require_batcher()  # a generation model: no batch policy, a 400
            if method == "POST":
                if not self.access.allow_policy_updates:
                    raise PolicyUpdatesOff(model.name)
                batcher.update_policy(**_policy_changes(await self._read_body(scope, receive)))
            return await _json(send, _policy_document(batcher.policy))
        if action not in (None, "ready", "config", "stats"):
            raise NotFound(f"path {path!r}", ["ready", "config", "stats", "infer", "policy"])
        _allow(method, path, "GET")
        if action is None:
            return await _json(send, model.metadata())
        if action == "ready":
            status = 200 if model.is_ready else 503
            return await _respond(send, status, b"", ())
        if action == "config":
            return await _json(send, model.config())
        return await _json(send, {"model_stats": [model_stats(model)]})  # stats

    async def _openai(
        self, method: str, rest: list[str], scope: Scope, receive: Receive, send: Send
    ) -> None:
        path = scope["path"]
        if rest == ["embeddings"]:
            _allow(method, path, "POST")
            body = await self._read_body(scope, receive)
            work = openai.create_embeddings(self.repository, body)
            return await _respond(send, 200, await _unless_disconnected(work, receive), (_JSON,))
        if rest == ["models"]:
            _allow(method, path, "GET")
            return await _respond(send, 200, openai.list_models(self.repository), (_JSON,))
        if rest in (["completions"], ["chat", "completions"]):
            _allow(method, path, "POST")
            body = await self._read_body(scope, receive)
            call = await completions.prepare(self.repository, body, is_chat=rest[0] == "chat")
            if call.is_stream:
                return await _stream(send, receive, completions.stream(call))
            answer = await _unless_disconnected(completions.respond(call), receive)
            return await _respond(send, 200, answer, (_JSON,))
        raise NotFound(
            f"{method} {scope['path']!r}",
            ["POST /v1/embeddings", "POST /v1/completions", "POST /v1/chat/completions",
             "GET /v1/models"],
        )  # fmt: skip

    def _server_metadata(self) -> dict[str, Any]:
        return {"name": "carpool", "version": __version__, "extensions": EXTENSIONS}

    async def _infer(self, model: ServedModel, scope: Scope, receive: Receive, send: Send) -> None:
        arrival_s = time.monotonic()  # the head is in; the deadline counts from here
        body = await self._read_body(scope, receive)
        header_length = _header(scope, b"inference-header-content-length")
        call = prepare_infer(model, body, header_length, self.plans)
        running = model.run(call.payload, call.options, arrival_s)
        result = await _unless_disconnected(running, receive)
        accept = _header(scope, b"accept-encoding")
        encoding = None if accept is None else response_encoding(accept)
        await _respond(send, *compressed(infer_response(model, call, result), encoding))

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The request body, inflated when it came with ``Content-Encoding: gzip`` or
        ``deflate`` (``tritonclient``'s ``request_compression_algorithm``), within
        ``max_body_bytes`` either way. A declared ``Content-Length`` over the limit is
        refused before any of the body is read (nor ``100 Continue`` sent to ask for it)."""
        declared = declared_length(_header(scope, b"content-length"))
        if declared is not None and declared > self.max_body_bytes:
            raise PayloadTooLarge(declared, self.max_body_bytes, is_unread=True)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise PayloadTooLarge(size, self.max_body_bytes, is_unread=True)
            if not self.inflight.take(len(chunk)):
                raise over_inflight_bytes(self.limits)
            scope[_HELD] = scope.get(_HELD, 0) + len(chunk)
            chunks.append(chunk)
            if not message.get("more_body", False):
                body = b"".join(chunks)
                encoding = _header(scope, b"content-encoding")
                if encoding is None:
                    return body
                return inflate(body, encoding, self.max_body_bytes)


def declared_length(value: bytes | None) -> int | None:
    """A ``Content-Length`` value as a number; None when there is none or it is not one.
    llhttp lets through any number of leading zeros (and whitespace around the digits),
    which ``int()`` alone refuses past 4300 digits; it refuses values over 2**64 - 1."""
    if value is None:
        return None
    digits = value.strip().lstrip(b"0") or b"0"
    return int(digits) if len(digits) <= 20 and digits.isdigit() else None


def _allow(method: str, path: str, *allowed: str) -> None:
    """Raises MethodNotAllowed (405, with ``Allow``) unless ``method`` is one of
    ``allowed``; HEAD goes with GET, as HTTP has it."""
    if method not in allowed and not (method == "HEAD" and "GET" in allowed):
        raise MethodNotAllowed(method, path, allowed)


_HELD = "carpool.held_bytes"  # scope key: the request's body bytes held in the budget


class ClientGone(Exception):
    """The client disconnected before its request was read."""


async def _unless_disconnected(work: Awaitable[Any], receive: Receive) -> Any:
    """Await ``work`` in this task; if the client disconnects first, cancel this task (a
    queued request is then dropped before it reaches the model) and raise
    :class:`ClientGone`. One watcher task per request, nothing else on the hot path."""
    current = asyncio.current_task()
    assert current is not None, "called from a task"
    watcher = asyncio.ensure_future(_cancel_on_disconnect(receive, current))
    try:
        return await work
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            current.uncancel()  # our own cancellation: it ends here, as ClientGone
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


async def _cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


async def _stream(send: Send, receive: Receive, chunks: AsyncGenerator[bytes, None]) -> None:
    """Server-sent events: each chunk is sent as it comes. A client that disconnects
    cancels the pump, which closes ``chunks`` (and so aborts the generation)."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
        }
    )

    async def pump() -> None:
        async with aclosing(chunks):
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    await _unless_disconnected(pump(), receive)


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


def _policy_changes(body: bytes) -> dict[str, Any]:
    """A policy POST body: a JSON object of BatchPolicy fields (lists become tuples)."""
    try:
        changes = orjson.loads(body or b"{}")
    except orjson.JSONDecodeError as error:
        raise InvalidInput(f"policy body: expected a JSON object ({error})") from None
    if not isinstance(changes, dict):
        raise InvalidInput(f"policy body: expected a JSON object, got {type(changes).__name__}")
    unknown = sorted(set(changes) - set(POLICY_FIELDS))
    if unknown:
        raise InvalidInput(f"policy body: unknown field(s) {unknown}; expected {POLICY_FIELDS}")
    _check_bounds(changes)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()}


def _check_bounds(changes: dict[str, Any]) -> None:
    """Refuse a ``max_delay_s`` over MAX_POLICY_DELAY_S and a ``timeout_s`` under
    MIN_POLICY_TIMEOUT_S; values of another kind are the policy's to refuse. Priority
    classes are not taken over the network (POLICY_FIELDS), so these are all there is."""
    delay, timeout = changes.get("max_delay_s"), changes.get("timeout_s")
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


def _policy_document(policy: BatchPolicy) -> dict[str, Any]:
    document = {name: getattr(policy, name) for name in POLICY_FIELDS}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in document.items()}


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def _json(send: Send, document: dict[str, Any]) -> None:
    await _respond(send, 200, orjson.dumps(document), (_JSON,))


_CLOSE = (b"connection", b"close")


async def _respond(
    send: Send, status: int, body: bytes, headers: tuple[tuple[bytes, bytes], ...]
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
