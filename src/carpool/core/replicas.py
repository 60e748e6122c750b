"""Where batches run: one replica per copy of the model, each pulling batches when free.

A synchronous model runs on its replica's own thread, so the event loop keeps accepting
requests while a batch computes (NumPy and torch release the GIL in their kernels);
collation and splitting run on that thread too. An ``async`` model runs on the loop.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from carpool.core.collate import Collator
from carpool.core.telemetry import ReplicaCounters

BatchFn = Callable[[Any], Any]
FnFactory = Callable[[str], BatchFn]


def is_async_callable(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's async __call__
    )


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, torch's OutOfMemoryError (CUDA or not), or an OOM RuntimeError."""
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class Replica:
    """One copy of the model. ``idle_since_s`` is set while it waits for a batch."""

    def __init__(
        self,
        replica_id: int,
        device: str,
        name: str,
        fn: BatchFn | None,
        factory: FnFactory | None,
    ) -> None:
        self.replica_id = replica_id
        self.device = device
        self.counters = ReplicaCounters(replica_id, device)
        self.idle_since_s: float | None = None
        self._fn = fn
        self._factory = factory
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"carpool-{name}-r{replica_id}"
        )
        self._is_async = fn is not None and is_async_callable(fn)

    async def load(self) -> None:
        """Build this replica's model with the factory, on the replica's own thread."""
        if self._factory is not None:
            loop = asyncio.get_running_loop()
            self._fn = await loop.run_in_executor(self._executor, self._factory, self.device)
            self._is_async = is_async_callable(self._fn)

    async def run(
        self, collator: Collator, payloads: list[Any], is_many: list[bool], counts: list[int]
    ) -> list[Any]:
        """Collate, call the model and split its outputs; one result per payload."""
        fn = self._fn
        assert fn is not None, "a replica runs only after load()"
        if self._is_async:
            outputs = await fn(collator.collate(payloads, is_many))
            return collator.split(outputs, counts, is_many)

        def job() -> list[Any]:
            return collator.split(fn(collator.collate(payloads, is_many)), counts, is_many)

        return await asyncio.get_running_loop().run_in_executor(self._executor, job)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
