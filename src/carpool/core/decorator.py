"""``@carpool.batched``: turn a batched function into an awaitable per-item function."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, overload

from carpool.core.batcher import Batcher
from carpool.core.buffer_pool import DEFAULT_BUFFER_POOL_MB
from carpool.core.clock import Clock
from carpool.core.collate import Collator
from carpool.core.model_source import BATCHED_ATTRIBUTE
from carpool.core.policy import DEFAULT_CLASS, DEFAULT_CLASSES, BatchPolicy, ClassPolicy, CostFn
from carpool.core.replicas import BatchFn
from carpool.core.telemetry import MemoryProbe, TelemetrySnapshot, TraceHook

# What ``@batched`` decorates: a batched function ``fn(batch)``, or a method
# ``fn(self, batch)`` (bound per instance on access). ``BatchFn`` alone would refuse the
# method form under mypy, though the docs show it.
BatchTarget = Callable[..., Any]


class BatchedFunction:
    """Call it with one item and await that item's output; the batch forms behind it.

    It is an async context manager that starts and drains its batcher, and it also
    starts lazily on the first call. ``.batcher`` is the underlying :class:`Batcher`.

    On a method (``def predict(self, batch)`` in a class body) each instance gets its own
    batcher with the same policy, made on first access: ``model.predict(x)`` batches with
    the other calls on ``model``, as Ray Serve's ``@serve.batch`` keeps a queue per
    instance.
    """

    def __init__(
        self, fn: BatchTarget, batcher: Batcher, make_batcher: Callable[[BatchFn], Batcher]
    ) -> None:
        functools.update_wrapper(self, fn)
        self.batcher = batcher
        self._fn = fn
        self._make_batcher = make_batcher
        self._method_name = str(getattr(fn, "__name__", id(self)))  # __set_name__ renames

    def __set_name__(self, owner: type, name: str) -> None:
        self._method_name = name

    def __get__(self, instance: object, owner: type | None = None) -> BatchedFunction:
        if instance is None:
            return self
        attribute = f"{BATCHED_ATTRIBUTE}{self._method_name}"
        bound: BatchedFunction | None = getattr(instance, "__dict__", {}).get(attribute)
        if bound is None:
            if not hasattr(instance, "__dict__"):
                raise TypeError(
                    f"@batched method {self._method_name!r} keeps a batcher per instance in its "
                    f"__dict__; {type(instance).__name__} has __slots__ without __dict__"
                )
            method = functools.partial(self._fn, instance)
            functools.update_wrapper(method, self._fn)
            bound = BatchedFunction(method, self._make_batcher(method), self._make_batcher)
            instance.__dict__[attribute] = bound
        return bound

    async def __call__(
        self,
        item: Any,
        *,
        priority: str | None = None,
        timeout_s: float | None = None,
        cost: float | None = None,
    ) -> Any:
        """Run one item in some batch and return its own output (starting the batcher on
        the first call). The keywords and errors are :meth:`Batcher.submit`'s: InvalidInput,
        QueueFull, DeadlineExceeded, ModelError, CapacityError, Closed."""
        return await self.batcher.submit(item, priority=priority, timeout_s=timeout_s, cost=cost)

    async def many(
        self,
        items: Any,
        *,
        priority: str | None = None,
        timeout_s: float | None = None,
        cost: float | None = None,
    ) -> Any:
        """Submit k items along axis 0 as one request; returns their k outputs."""
        return await self.batcher.submit_many(
            items, priority=priority, timeout_s=timeout_s, cost=cost
        )

    async def start(self) -> None:
        """Load the replicas and start batching (:meth:`Batcher.start`). Idempotent."""
        await self.batcher.start()

    async def stop(self, drain: bool = True, *, timeout_s: float | None = None) -> None:
        """Stop accepting; with ``drain`` answer every accepted request first, without it
        fail the queued ones with Closed; past ``timeout_s`` cut off what is left
        (:meth:`Batcher.stop`)."""
        await self.batcher.stop(drain=drain, timeout_s=timeout_s)

    def cut_off(self) -> int:
        """Stop at once, failing what is queued or running with Closed; returns how many
        (:meth:`Batcher.cut_off`)."""
        return self.batcher.cut_off()

    async def __aenter__(self) -> BatchedFunction:
        await self.batcher.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.batcher.stop(drain=True)

    def snapshot(self) -> TelemetrySnapshot:
        """Everything measured so far (:meth:`Batcher.snapshot`)."""
        return self.batcher.snapshot()

    def update_policy(self, **changes: Any) -> BatchPolicy:
        """Change policy fields while running; returns the new policy. Raises ConfigError
        naming a bad field (:meth:`Batcher.update_policy`)."""
        return self.batcher.update_policy(**changes)


@overload
def batched(fn: BatchTarget, /) -> BatchedFunction: ...


@overload
def batched(
    fn: None = None,
    /,
    *,
    max_batch_size: int | str = ...,
    max_delay_s: float | str = ...,
    preferred_batch_sizes: tuple[int, ...] = ...,
    max_batch_cost: float | None = ...,
    cost_fn: CostFn | None = ...,
    max_queue_size: int | None = ...,
    max_queue_time_s: float | str | None = ...,
    timeout_s: float | None = ...,
    classes: tuple[ClassPolicy, ...] = ...,
    default_class: str = ...,
    fill_from_lower: bool = ...,
    oom_recovery_s: float = ...,
    max_batch_tokens: int | None = ...,
    length_buckets: tuple[int, ...] | str | None = ...,
    batch_timeout_s: float | None = ...,
    slo_s: float | None = ...,
    preempt: bool = ...,
    num_replicas: int | None = ...,
    devices: list[str] | None = ...,
    collate: str | Collator = ...,
    name: str | None = ...,
    clock: Clock | None = ...,
    on_trace: TraceHook | None = ...,
    slow_request_s: float | None = ...,
    memory_probe: MemoryProbe | None = ...,
    switch_interval_s: float | None = ...,
    executor: str = ...,
    replica_cpus: list[list[int]] | None = ...,
    buffer_pool: bool = ...,
    buffer_pool_mb: float = ...,
    ray_resources: dict[str, float] | None = ...,
    max_restarts: int | None = ...,
    ray_placement: dict[str, str] | None = ...,
) -> Callable[[BatchTarget], BatchedFunction]: ...


def batched(
    fn: BatchTarget | None = None,
    /,
    *,
    max_batch_size: int | str = 32,
    max_delay_s: float | str = 0.005,
    preferred_batch_sizes: tuple[int, ...] = (),
    max_batch_cost: float | None = None,
    cost_fn: CostFn | None = None,
    max_queue_size: int | None = None,
    max_queue_time_s: float | str | None = None,
    timeout_s: float | None = None,
    classes: tuple[ClassPolicy, ...] = DEFAULT_CLASSES,
    default_class: str = DEFAULT_CLASS,
    fill_from_lower: bool = True,
    oom_recovery_s: float = 30.0,
    max_batch_tokens: int | None = None,
    length_buckets: tuple[int, ...] | str | None = None,
    batch_timeout_s: float | None = 60.0,
    slo_s: float | None = None,
    preempt: bool = False,
    num_replicas: int | None = None,
    devices: list[str] | None = None,
    collate: str | Collator = "auto",
    name: str | None = None,
    clock: Clock | None = None,
    on_trace: TraceHook | None = None,
    slow_request_s: float | None = None,
    memory_probe: MemoryProbe | None = None,
    switch_interval_s: float | None = 0.0005,
    executor: str = "auto",
    replica_cpus: list[list[int]] | None = None,
    buffer_pool: bool = True,
    buffer_pool_mb: float = DEFAULT_BUFFER_POOL_MB,
    ray_resources: dict[str, float] | None = None,
    max_restarts: int | None = None,
    ray_placement: dict[str, str] | None = None,
) -> BatchedFunction | Callable[[BatchTarget], BatchedFunction]:
    """Decorate a batched function: ``await f(x)`` then runs ``x`` inside some batch.

    Used bare (``@batched``) or with policy keywords (``@batched(max_batch_size=64,
    max_delay_s=0.002)``); the keywords are the fields of :class:`BatchPolicy` plus the
    :class:`Batcher` options. The policy is validated here, at decoration time.
    """
    policy = BatchPolicy(
        max_batch_size=max_batch_size,
        max_delay_s=max_delay_s,
        preferred_batch_sizes=preferred_batch_sizes,  # BatchPolicy checks and copies it
        max_batch_cost=max_batch_cost,
        cost_fn=cost_fn,
        max_queue_size=max_queue_size,
        max_queue_time_s=max_queue_time_s,
        timeout_s=timeout_s,
        classes=classes,  # BatchPolicy checks and copies it
        default_class=default_class,
        fill_from_lower=fill_from_lower,
        oom_recovery_s=oom_recovery_s,
        max_batch_tokens=max_batch_tokens,
        length_buckets=length_buckets,
        batch_timeout_s=batch_timeout_s,
        slo_s=slo_s,
        preempt=preempt,
    )

    def make_batcher(target: BatchFn) -> Batcher:
        return Batcher(
            target,
            policy,
            name=name,
            num_replicas=num_replicas,
            devices=devices,
            collate=collate,
            clock=clock,
            on_trace=on_trace,
            slow_request_s=slow_request_s,
            memory_probe=memory_probe,
            switch_interval_s=switch_interval_s,
            executor=executor,
            replica_cpus=replica_cpus,
            buffer_pool=buffer_pool,
            buffer_pool_mb=buffer_pool_mb,
            ray_resources=ray_resources,
            max_restarts=max_restarts,
            ray_placement=ray_placement,
        )

    def wrap(target: BatchTarget) -> BatchedFunction:
        return BatchedFunction(target, make_batcher(target), make_batcher)

    return wrap if fn is None else wrap(fn)
