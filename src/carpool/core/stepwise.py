"""Models that compute in steps: a generator that yields between them.

A batched model may be a generator function: it yields (nothing) between stages of its
work (a network's layers, say) and returns its outputs::

    def model(batch):
        hidden = layer1(batch)
        yield
        hidden = layer2(hidden)
        yield
        return layer3(hidden)

On a replica thread, a process or a Ray actor it is run to the end in one go. On the event
loop's thread (``executor: loop``, or ``auto`` on one CPU) the loop gets its turn at each
``yield``: it reads, refuses and answers other requests between the model's stages instead
of only after the whole batch, so a request that arrives mid-batch waits for one stage, not
for the batch (docs/reliability.md, "Refusal time"). The model's own work is the same; what
runs between its steps is work the loop had to do anyway.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any


def is_steps(result: object) -> bool:
    """Whether a model call returned steps (a generator) rather than its outputs."""
    return inspect.isgenerator(result)


def run_to_end(result: Any) -> Any:
    """The outputs of a model call: ``result`` itself, or the value a generator of steps
    returns once run through."""
    if not is_steps(result):
        return result
    steps: Generator[Any, None, Any] = result
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value


@dataclass(frozen=True, slots=True)
class StepTimes:
    """How long a model in steps held the loop: its longest step, in wall and CPU seconds,
    and all its steps together (its own time, without the loop's work between them)."""

    longest_s: float
    longest_cpu_s: float
    total_s: float


async def run_on_loop(steps: Generator[Any, None, Any]) -> tuple[Any, StepTimes]:
    """Run ``steps`` on the loop's thread, letting the loop run between them: the outputs,
    and how long the steps held the loop."""
    wall_s = cpu_s = total_s = 0.0
    while True:
        wall_started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            next(steps)
        except StopIteration as done:
            result = done.value
        else:
            result = _NOT_DONE
        step_s = time.perf_counter() - wall_started
        total_s += step_s
        wall_s = max(wall_s, step_s)
        cpu_s = max(cpu_s, time.thread_time() - cpu_started)
        if result is not _NOT_DONE:
            return result, StepTimes(wall_s, cpu_s, total_s)
        await asyncio.sleep(0)


_NOT_DONE = object()  # a step that was not the last
