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
loop's thread (``executor: loop``, or ``auto`` on one CPU) the loop gets its turn at a
``yield``: it reads, refuses and answers other requests between the model's stages instead
of only after the whole batch, so a request that arrives mid-batch waits for one stage, not
for the batch (docs/reliability.md, "Refusal time"). The model's own work is the same; what
runs between its steps is work the loop had to do anyway. Steps shorter than
:data:`TURN_EVERY_S` run back to back until that much ran since the loop's last turn: a
small batch of a model sliced for its large batches (W1 at batch 1: twelve short steps)
would otherwise pay a turn of the loop for each, where a request arriving meanwhile waits
at most that long more.
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


class StepGate:
    """Which of a replica's calls in progress may take its next step: one of the most
    urgent rank (0 is the highest class) present or held; the others wait at their
    ``yield``. A rank is *held* from when a request of it is queued for the replica until
    its batch has run (or none was formed), so that the lower call stops at its next
    step rather than a few steps later, when the higher batch starts."""

    __slots__ = ("_changed", "_held", "_ranks")

    def __init__(self) -> None:
        self._ranks: list[int] = []  # of the calls in progress, one entry each
        self._held: int | None = None
        self._changed: asyncio.Future[None] | None = None

    @property
    def num_calls(self) -> int:
        return len(self._ranks)

    def enter(self, rank: int) -> None:
        self._ranks.append(rank)

    def leave(self, rank: int) -> None:
        self._ranks.remove(rank)
        self._notify()

    def hold(self, rank: int) -> None:
        """A batch of ``rank`` is coming: calls of lower classes wait from now."""
        self._held = rank if self._held is None else min(self._held, rank)

    def release(self) -> None:
        if self._held is not None:
            self._held = None
            self._notify()

    def preempts(self, rank: int) -> bool:
        """Whether a call of ``rank`` runs ahead of a less urgent one in progress."""
        return any(r > rank for r in self._ranks)

    def most_urgent(self, default: int) -> int:
        urgent = min(self._ranks, default=default)
        return urgent if self._held is None else min(urgent, self._held)

    def _notify(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None and not changed.done():
            changed.set_result(None)

    async def turn(self, rank: int) -> None:
        """Return once no call more urgent than ``rank`` is in progress or held."""
        while self.most_urgent(rank) < rank:
            if self._changed is None:
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._changed)


TURN_EVERY_S = 0.001  # the loop gets a turn at the first yield after this much work


async def run_on_loop(
    steps: Generator[Any, None, Any], gate: StepGate | None = None, rank: int = 0
) -> tuple[Any, StepTimes]:
    """Run ``steps`` on the loop's thread, letting the loop run between them (once
    :data:`TURN_EVERY_S` of them ran since its last turn): the outputs, and how long the
    steps held the loop. With a ``gate``, each step after a turn waits its turn there (a
    call of a more urgent ``rank`` in progress goes first), and a call that runs ahead of
    a less urgent one takes its steps back to back: the loop's work between them, mostly
    the lower classes' traffic, waits for it as their batch does."""
    if gate is None:
        return await _run_steps(steps, None, rank)
    gate.enter(rank)
    try:
        return await _run_steps(steps, gate, rank)
    finally:
        gate.leave(rank)


async def _run_steps(
    steps: Generator[Any, None, Any], gate: StepGate | None, rank: int
) -> tuple[Any, StepTimes]:
    wall_s = cpu_s = total_s = since_turn_s = 0.0
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
        since_turn_s += step_s
        wall_s = max(wall_s, step_s)
        cpu_s = max(cpu_s, time.thread_time() - cpu_started)
        if result is not _NOT_DONE:
            return result, StepTimes(wall_s, cpu_s, total_s)
        if since_turn_s < TURN_EVERY_S or (gate is not None and gate.preempts(rank)):
            continue
        since_turn_s = 0.0
        await asyncio.sleep(0)
        if gate is not None:
            await gate.turn(rank)


_NOT_DONE = object()  # a step that was not the last
