"""The engine's side of one worker's channel: it queues the worker's hand-offs into the
real batchers, answers its forwarded HTTP requests with the engine's router and handlers,
and sends the answers back.

::

    INFER  model, options, arrival, arrays  -> batcher.enqueue_many -> RESULT arrays | ERROR
    INFERS a group of INFER (one loop turn)  -> each as INFER        -> RESULTS (a batch's)
    RUN    the same, through model.run      -> (embeddings, generation: their own infer)
    CANCEL id                               -> batcher.cancel / the task cancelled
    FORWARD method, path, query, headers,   -> route + respond -> ANSWER (+ CHUNK..., END)
           body
    COUNTS the worker's counters            -> kept for /metrics
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from carpool.core.batcher import Batcher
from carpool.core.request import Request
from carpool.server.app import KServeApp
from carpool.server.http.handlers import Call, Stream, respond
from carpool.server.http.headers import RequestHeaders
from carpool.server.http.router import HttpRequest, route
from carpool.server.infer import Answer, error_response
from carpool.server.repository import ServedModel
from carpool.server.workers.channel import Channel, Grouper
from carpool.server.workers.records import (
    Kind,
    Record,
    decode,
    encode,
    encode_error,
    group_key,
    split_group,
)

log = logging.getLogger("carpool.server.workers")


class Peer:
    """One worker, as the engine serves it. ``on_forwarded``: called after each forwarded
    request is answered (the engine sends a changed policy to every worker)."""

    def __init__(self, index: int, app: KServeApp, on_forwarded: Callable[[], None]) -> None:
        self.index = index
        self.app = app
        self.channel: Channel | None = None
        self._on_forwarded = on_forwarded
        self._queued: dict[int, tuple[Batcher, Request]] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._models: dict[str, tuple[ServedModel, Batcher]] = {}
        self.counts: dict[str, int] = {}  # the worker's own, in its current life
        self._earlier_requests = 0  # answered in its earlier lives
        self.num_handoffs = 0  # INFER, RUN and FORWARD records, over the worker's lives
        self.is_listening = asyncio.Event()
        # The results of a loop turn (a batch's, for this worker), sent as RESULTS.
        self._results = Grouper(
            Kind.RESULTS,
            lambda: self.channel,
            lambda request_id, arrays: encode(Kind.RESULT, {"id": request_id}, arrays),
        )

    @property
    def num_requests(self) -> int:
        """HTTP requests the worker answered, over all its lives."""
        return self._earlier_requests + self.counts.get("requests", 0)

    @property
    def num_inflight(self) -> int:
        return len(self._queued) + len(self._tasks)

    def send(
        self, kind: Kind, header: dict[str, Any], arrays: Any = None, blob: bytes = b""
    ) -> None:
        if self.channel is not None:
            self.channel.send(encode(kind, header, arrays, blob))

    def on_record(self, data: bytearray) -> None:
        record = decode(data)
        kind = record.kind
        if kind is Kind.INFERS:
            for item, arrays in split_group(record):
                self.num_handoffs += 1
                self._infer(item, arrays)
        elif kind is Kind.INFER:
            self.num_handoffs += 1
            self._infer(record.header, record.arrays)
        elif kind is Kind.RUN or kind is Kind.FORWARD:
            self.num_handoffs += 1
            work = self._run(record) if kind is Kind.RUN else self._forward(record)
            self._start(record.header["id"], work)
        elif kind is Kind.CANCEL:
            self._cancel(record.header["id"])
        elif kind is Kind.COUNTS:
            counts = {k: v for k, v in record.header.items() if isinstance(v, int)}
            self._add_inflight(counts, self.counts)
            self.counts = counts
            if record.header.get("listening"):
                self.is_listening.set()

    def drop(self) -> int:
        """The worker died: its hand-offs still queued or running are withdrawn (nobody is
        left to answer). How many."""
        queued, self._queued = self._queued, {}
        tasks, self._tasks = self._tasks, {}
        for batcher, request in queued.values():
            batcher.cancel(request)
        for task in tasks.values():
            task.cancel()
        self.channel = None
        self._add_inflight({}, self.counts)  # what it held is gone; its refusals still count
        # Cleared, not replaced: the engine's start-up may be waiting on this one event.
        self.is_listening.clear()
        self._earlier_requests += self.counts.get("requests", 0)
        self.counts = {}
        return len(queued) + len(tasks)

    def _add_inflight(self, now: dict[str, int], before: dict[str, int]) -> None:
        """Carry the change in what the worker reports of ``--max-inflight-bytes`` (the
        bodies it holds, the requests it refused for them) into the engine's figures,
        which ``/metrics`` shows: their sum over the workers."""
        inflight = self.app.inflight
        inflight.held_bytes += now.get("inflight_bytes", 0) - before.get("inflight_bytes", 0)
        refused = now.get("refused_inflight", 0) - before.get("refused_inflight", 0)
        inflight.num_refused += max(0, refused)  # a worker started again counts from 0

    # -- the fast path ----------------------------------------------------------------------

    def _infer(self, header: dict[str, Any], arrays: dict[str, Any]) -> None:
        request_id = header["id"]
        try:
            model, batcher = self._batched(header["model"])
            queued = batcher.enqueue_many(
                arrays, **header["options"], arrival_s=header["arrival_s"]
            )
        except Exception as exc:
            self._fail(request_id, exc)
            return
        self._queued[request_id] = (batcher, queued)
        queued.future.add_done_callback(functools.partial(self._landed, request_id, model))

    def _batched(self, name: str) -> tuple[ServedModel, Batcher]:
        """The model ``name`` and its batcher (looked up once)."""
        found = self._models.get(name)
        if found is None:
            model = self.app.repository.get(name)
            found = self._models[name] = (model, model.require_batcher())
        return found

    def _landed(self, request_id: int, model: ServedModel, future: asyncio.Future[Any]) -> None:
        if self._queued.pop(request_id, None) is None or future.cancelled():
            return  # withdrawn: the worker's client left, or the worker died
        error = future.exception()
        if error is not None:
            self._fail(request_id, error)
            return
        try:
            outputs = model.outputs_of(future.result())
            key = group_key(outputs) if type(outputs) is dict else None
            if key is not None:
                self._results.add(key, request_id, outputs)
            else:
                self.send(Kind.RESULT, {"id": request_id}, outputs)
        except Exception as exc:
            self._fail(request_id, exc)

    def _fail(self, request_id: int, error: BaseException) -> None:
        self.send(Kind.ERROR, {"id": request_id}, None, encode_error(error))

    def _cancel(self, request_id: int) -> None:
        queued = self._queued.pop(request_id, None)
        if queued is not None:
            batcher, request = queued
            batcher.cancel(request)
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    # -- what runs in a task ---------------------------------------------------------------

    def _start(self, request_id: int, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks[request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request_id, None))

    async def _run(self, record: Record) -> None:
        header = record.header
        request_id = header["id"]
        options = {k: v for k, v in header["options"].items() if v is not None and k != "cost"}
        try:
            model = self.app.repository.get(header["model"])
            result = await model.run(dict(record.arrays), options, header["arrival_s"])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(request_id, exc)
            return
        self.send(Kind.RESULT, {"id": request_id}, dict(result))

    async def _forward(self, record: Record) -> None:
        header = record.header
        request_id = header["id"]
        fields = {
            k: None if v is None else v.encode("latin-1") for k, v in header["headers"].items()
        }
        request = HttpRequest(
            header["method"],
            header["path"],
            header["query"].encode("latin-1"),
            RequestHeaders(**fields),
            header["arrival_s"],
        )
        answer: Answer | Stream
        try:
            found = route(self.app.repository, self.app.access, request)
            answer = await respond(self.app, Call(found, request, bytes(record.blob), _unwatched))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            answer = error_response(exc, is_openai=request.is_openai)
        self._on_forwarded()
        if not isinstance(answer, Stream):
            status, body, headers = answer
            self.send(
                Kind.ANSWER,
                {"id": request_id, "status": status, "headers": _text(headers)},
                None,
                body,
            )
            return
        self.send(
            Kind.ANSWER,
            {"id": request_id, "status": 200, "headers": _text(answer.headers), "stream": True},
        )
        chunks = answer.chunks
        try:
            async for chunk in chunks:
                self.send(Kind.CHUNK, {"id": request_id}, None, chunk)
        except Exception:  # the stream is cut short, as in one process: its client sees it end
            log.exception("a streamed answer failed")
        finally:
            await chunks.aclose()
        self.send(Kind.END, {"id": request_id})


def _unwatched(work: Any) -> Any:
    """The engine's watch: the worker's CANCEL record cancels the task instead."""
    return work


def _text(headers: Any) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
