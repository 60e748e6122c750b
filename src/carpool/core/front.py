"""What a server's request path needs of a batcher: :class:`BatchFront`.

A :class:`~carpool.core.batcher.Batcher` is one. So is a front-end worker's remote face
of the engine's batcher (:mod:`carpool.server.workers.front`): with ``carpool serve
--workers N`` a worker decodes and checks a request, then queues it through shared memory
into the one batcher the engine owns. The server's infer fast path, its waiting room and
its health probes read only what is declared here, so both serve them alike.
"""

from __future__ import annotations

from typing import Any, Protocol

from carpool.core.policy import BatchPolicy
from carpool.core.request import Request
from carpool.errors import QueueFull


class BatchFront(Protocol):
    """Where a served model's requests are queued (see the module's docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def policy(self) -> BatchPolicy: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def num_pending(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def num_replicas(self) -> int: ...

    @property
    def devices(self) -> tuple[str, ...]: ...

    async def start(self) -> None: ...

    async def stop(self, *, drain: bool = True) -> None: ...

    def cut_off(self) -> int: ...

    def enqueue_many(
        self,
        payloads: Any,
        *,
        priority: str | None = None,
        timeout_s: float | None = None,
        cost: float | None = None,
        arrival_s: float | None = None,
    ) -> Request: ...

    async def submit_many(
        self,
        payloads: Any,
        *,
        priority: str | None = None,
        timeout_s: float | None = None,
        cost: float | None = None,
        arrival_s: float | None = None,
    ) -> Any: ...

    def refuse_early(self, num_reserved: int = 0) -> QueueFull | None: ...

    def cancel(self, request: Request) -> None: ...
