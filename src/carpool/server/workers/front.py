"""A front-end worker's side of the channel: its requests to the engine, and the face of
each of the engine's batchers the worker serves its models with (:class:`RemoteFront`).

A worker's :class:`~carpool.server.repository.ServedModel` holds a :class:`RemoteFront`
where the engine's holds its :class:`~carpool.core.batcher.Batcher`: both are a
:class:`~carpool.core.front.BatchFront`, so the HTTP fast path, the gRPC servicer and the
health probes run in the worker unchanged. :meth:`RemoteFront.enqueue_many` writes the
checked payload into the ring; the engine queues it into the real batcher, with its
deadline counted from the worker's arrival time (``time.monotonic`` is one clock for
every process on Linux), and the request's future resolves when the answer comes back.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from carpool.core.policy import BatchPolicy
from carpool.core.request import Request
from carpool.errors import Closed, QueueFull
from carpool.server.workers.channel import Channel, Grouper
from carpool.server.workers.records import (
    Kind,
    Record,
    decode,
    decode_error,
    encode,
    group_key,
    split_group,
)

ENGINE = "the engine (carpool serve --workers)"  # what a Closed error names
NUM_FREE_UNKNOWN = 1 << 30  # the worker does not see the engine's queues: room as far as it knows


@dataclass(slots=True)
class Forwarded:
    """An HTTP request the engine answered: ``chunks`` is set when the answer streams."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    chunks: asyncio.Queue[bytes | None] | None = None


@dataclass(slots=True)
class _Waiting:
    future: asyncio.Future[Any]
    model: str | None = None
    chunks: asyncio.Queue[bytes | None] | None = field(default=None)


class Link:
    """The worker's requests to the engine through ``channel`` (set once connected)."""

    def __init__(self) -> None:
        self.channel: Channel | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiting] = {}
        self.fronts: dict[str, RemoteFront] = {}
        self.is_stopping = False
        # The INFER records of a loop turn, sent as INFERS at its end.
        self._infers = Grouper(
            Kind.INFERS, lambda: self.channel, lambda item, arrays: encode(Kind.INFER, item, arrays)
        )

    @property
    def is_open(self) -> bool:
        return self.channel is not None and self.channel.is_open

    def num_waiting(self, model: str) -> int:
        """Requests to ``model`` the engine has not answered yet."""
        return sum(1 for w in self._waiting.values() if w.model == model)

    def send(
        self, kind: Kind, header: dict[str, Any], arrays: Any = None, blob: bytes = b""
    ) -> None:
        channel = self.channel
        if channel is None:
            raise Closed(ENGINE)
        if self._infers.has_pending:
            self._infers.flush()  # records keep the order they were sent in
        channel.send(encode(kind, header, arrays, blob))

    def request(
        self, kind: Kind, header: dict[str, Any], arrays: Any = None, blob: bytes = b""
    ) -> tuple[int, asyncio.Future[Any]]:
        """Send a request record; its id and the future its answer resolves."""
        if not self.is_open:
            raise Closed(ENGINE)
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = _Waiting(future, header.get("model"))
        key = group_key(arrays) if kind is Kind.INFER and type(arrays) is dict else None
        if key is not None:
            self._infers.add(key, {**header, "id": request_id}, arrays)
        else:
            self.send(kind, {**header, "id": request_id}, arrays, blob)
        return request_id, future

    def cancel(self, request_id: int) -> None:
        """Withdraw a request (its client left): the engine cancels it in its batcher."""
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None:
            waiting.future.cancel()
            if self.is_open:
                self.send(Kind.CANCEL, {"id": request_id})

    def on_record(self, data: bytearray) -> None:
        record = decode(data)
        kind = record.kind
        if kind is Kind.POLICY:
            front = self.fronts.get(record.header["model"])
            if front is not None:
                front.set_policy(pickle.loads(bytes(record.blob)), record.header["version"])
            return
        if kind is Kind.RESULTS:
            for request_id, arrays in split_group(record):
                waiting = self._waiting.pop(request_id, None)
                if waiting is not None and not waiting.future.done():
                    waiting.future.set_result(arrays)
            return
        request_id = record.header["id"]
        if kind is Kind.CHUNK or kind is Kind.END:
            waiting = self._waiting.get(request_id)
            if waiting is not None and waiting.chunks is not None:
                waiting.chunks.put_nowait(bytes(record.blob) if kind is Kind.CHUNK else None)
                if kind is Kind.END:
                    del self._waiting[request_id]
            return
        waiting = self._waiting.get(request_id)
        if waiting is None or waiting.future.done():  # cancelled meanwhile
            self._waiting.pop(request_id, None)
            return
        self._resolve(request_id, waiting, record)

    def _resolve(self, request_id: int, waiting: _Waiting, record: Record) -> None:
        kind = record.kind
        if kind is Kind.ANSWER:
            headers = tuple(
                (k.encode("latin-1"), v.encode("latin-1")) for k, v in record.header["headers"]
            )
            answer = Forwarded(record.header["status"], headers, bytes(record.blob))
            if record.header.get("stream"):
                answer.chunks = waiting.chunks = asyncio.Queue()
            else:
                del self._waiting[request_id]
            waiting.future.set_result(answer)
            return
        del self._waiting[request_id]
        if kind is Kind.ERROR:
            waiting.future.set_exception(decode_error(record.blob))
        else:
            waiting.future.set_result(record.arrays)

    def lost(self) -> None:
        """The engine is gone: every request waiting fails (Closed: 503, UNAVAILABLE)."""
        waiting, self._waiting = self._waiting, {}
        for entry in waiting.values():
            if not entry.future.done():
                entry.future.set_exception(Closed(ENGINE))
            if entry.chunks is not None:
                entry.chunks.put_nowait(None)


class RemoteFront:
    """The engine's batcher of model ``name``, as a worker queues into it (a
    :class:`~carpool.core.front.BatchFront`). ``run``: the engine answers through the
    model's own ``run`` (an embeddings or generation model), not its batcher's queue.
    ``ready``: reads the engine's readiness flag for the model, in shared memory."""

    def __init__(
        self,
        name: str,
        link: Link,
        policy: BatchPolicy,
        policy_version: int,
        devices: tuple[str, ...],
        ready: Callable[[], bool],
        *,
        run: bool = False,
    ) -> None:
        self._name = name
        self._link = link
        self._policy = policy
        self._policy_version = policy_version
        self._devices = devices
        self._ready = ready
        self._kind = Kind.RUN if run else Kind.INFER
        link.fronts[name] = self

    @property
    def name(self) -> str:
        return self._name

    @property
    def policy(self) -> BatchPolicy:
        return self._policy

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def set_policy(self, policy: BatchPolicy, version: int) -> None:
        """The engine's batcher took ``policy`` (``POST .../policy`` on any worker)."""
        self._policy, self._policy_version = policy, version

    @property
    def is_running(self) -> bool:
        return self._link.is_open and not self._link.is_stopping

    @property
    def is_ready(self) -> bool:
        return self._link.is_open and self._ready()

    @property
    def num_pending(self) -> int:
        return self._link.num_waiting(self._name)

    @property
    def num_free(self) -> int:
        return NUM_FREE_UNKNOWN

    @property
    def num_replicas(self) -> int:
        return len(self._devices)

    @property
    def devices(self) -> tuple[str, ...]:
        return self._devices

    async def start(self) -> None:
        """The engine started its batcher before the worker was spawned."""

    async def stop(self, *, drain: bool = True) -> None:
        """The engine drains its batcher; the worker only stops sending."""

    def cut_off(self) -> int:
        return 0

    def enqueue_many(
        self,
        payloads: Any,
        *,
        priority: str | None = None,
        timeout_s: float | None = None,
        cost: float | None = None,
        arrival_s: float | None = None,
    ) -> Request:
        """Hand a checked request to the engine; its future resolves to the outputs.

        Raises:
            Closed: the engine is gone or the worker is stopping.
        """
        if not self.is_running:
            raise Closed(self._name)
        options = {"priority": priority, "timeout_s": timeout_s, "cost": cost}
        header = {"model": self._name, "options": options, "arrival_s": arrival_s}
        request_id, future = self._link.request(self._kind, header, payloads)
        return Request(
            request_id, None, 0, True, 0.0, priority or "", 0, arrival_s or 0.0, None, future
        )

    async def submit_many(
        self,
        payloads: Any,
        *,
        priority: str | None = None,
        timeout_s: float | None = None,
        cost: float | None = None,
        arrival_s: float | None = None,
    ) -> Any:
        request = self.enqueue_many(
            payloads, priority=priority, timeout_s=timeout_s, cost=cost, arrival_s=arrival_s
        )
        try:
            return await request.future
        except asyncio.CancelledError:
            self.cancel(request)
            raise

    async def run(self, payload: dict[str, np.ndarray], options: dict[str, Any]) -> Any:
        """A model's own ``infer`` (embeddings, generation), run by the engine."""
        return await self.submit_many(payload, **options)

    def refuse_early(self, num_reserved: int = 0) -> QueueFull | None:
        """None: the engine's queues decide, once the body is in (its 429 is answered)."""
        return None

    def cancel(self, request: Request) -> None:
        self._link.cancel(request.request_id)
