"""Models in steps (``carpool.core.stepwise``): run to the end off the loop, and on the
loop with the loop's other work between the steps."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool import Batcher, BatchPolicy
from carpool.core.stepwise import TURN_EVERY_S, StepGate, is_steps, run_on_loop, run_to_end

from .conftest import until

REPOSITORY_ROOT = str(Path(__file__).resolve().parents[3])


def doubled_in_steps(batch: np.ndarray) -> Generator[None, None, np.ndarray]:
    """Doubles the batch in two steps."""
    half = batch * 1.5
    yield
    return half + batch * 0.5


def test_run_to_end_returns_a_plain_result_or_what_the_steps_return() -> None:
    assert run_to_end(7) == 7
    steps = doubled_in_steps(np.array([2.0]))
    assert is_steps(steps) and not is_steps(np.array([2.0]))
    np.testing.assert_array_equal(run_to_end(steps), [4.0])


async def test_on_the_loop_other_work_runs_between_the_steps() -> None:
    seen: list[str] = []

    def steps() -> Generator[None, None, str]:
        seen.append("step 1")
        asyncio.get_running_loop().call_soon(seen.append, "loop")
        time.sleep(TURN_EVERY_S)
        yield
        seen.append("step 2")
        time.sleep(0.02)
        return "done"

    result, times = await run_on_loop(steps())
    assert result == "done"
    assert seen == ["step 1", "loop", "step 2"]  # not after the whole call
    assert 0.02 <= times.longest_s <= times.total_s < 1.0
    assert times.longest_cpu_s < times.longest_s  # the sleep is not CPU


async def test_short_steps_run_back_to_back_until_a_turns_worth_of_work() -> None:
    """Steps of a tenth of TURN_EVERY_S: the loop gets a turn about every ten of them,
    not at each (a turn costs more than such a step is worth waiting for)."""
    seen: list[str] = []
    loop = asyncio.get_running_loop()
    ticking = True

    def tick() -> None:  # one entry per turn of the loop
        if ticking:
            seen.append("loop")
            loop.call_soon(tick)

    def steps() -> Generator[None, None, None]:
        for i in range(40):
            seen.append(f"step {i}")
            deadline = time.perf_counter() + TURN_EVERY_S / 10
            while time.perf_counter() < deadline:  # busy, as a model's step is
                pass
            yield

    loop.call_soon(tick)
    await run_on_loop(steps())
    ticking = False
    turns = [i for i, event in enumerate(seen) if event == "loop"]
    assert 2 <= len(turns) <= 8, seen
    runs = [b - a - 1 for a, b in itertools.pairwise(turns)]
    assert min(runs) >= 5, runs  # steps between two turns: about ten, never one


class Recorder:
    """A model in steps that notes, at each step, whether a marker task ran meanwhile."""

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.ran_between: list[bool] = []
        self.flag = threading.Event()

    def __call__(self, batch: np.ndarray) -> Generator[None, None, np.ndarray]:
        self.threads.add(threading.get_ident())
        self.flag.clear()
        time.sleep(TURN_EVERY_S)  # a step long enough to give the loop its turn after it
        yield
        self.ran_between.append(self.flag.is_set())
        return batch * 2


@pytest.mark.parametrize("executor", ["loop", "thread"])
async def test_a_batcher_runs_a_model_in_steps_where_its_executor_says(executor: str) -> None:
    model = Recorder()
    batcher = Batcher(
        model,
        BatchPolicy(max_batch_size=4, max_delay_s=0.005),
        executor=executor,
        switch_interval_s=None,
    )

    async def mark() -> None:  # sets the flag whenever the loop gets a turn
        while True:
            model.flag.set()
            await asyncio.sleep(0)

    async with batcher:
        marker = asyncio.create_task(mark())
        try:
            inputs = [np.array([float(i)], np.float32) for i in range(8)]
            results = await asyncio.gather(*(batcher.submit(x) for x in inputs))
        finally:
            marker.cancel()
    for x, y in zip(inputs, results, strict=True):
        np.testing.assert_array_equal(y, x * 2)
    on_loop = model.threads == {threading.get_ident()}
    assert on_loop == (executor == "loop")
    if executor == "loop":  # the loop got its turn between the steps of every batch
        assert model.ran_between and all(model.ran_between)


def doubled_steps_model(batch: Any) -> Any:
    return doubled_in_steps(batch)


async def test_a_process_replica_runs_a_model_in_steps_to_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Children import this module by the name pytest gave it, from the repository's root.
    monkeypatch.syspath_prepend(REPOSITORY_ROOT)
    batcher = Batcher(
        doubled_steps_model,
        BatchPolicy(max_batch_size=4, max_delay_s=0.005),
        executor="process",
        switch_interval_s=None,
    )
    async with batcher:
        got = await asyncio.gather(*(batcher.submit(np.array([i], np.float64)) for i in range(4)))
    assert [float(g[0]) for g in got] == [0.0, 2.0, 4.0, 6.0]


async def test_the_batch_time_line_is_the_models_own_time_not_the_loops_work_between() -> None:
    """Between a model's steps the loop does other work (here 20 ms per turn); the
    controller's line must be the model's 4 ms per batch, not the span of 24 ms or more."""

    def model(batch: np.ndarray) -> Generator[None, None, np.ndarray]:
        time.sleep(0.002)
        yield
        time.sleep(0.002)
        return batch

    def hold_the_loop() -> None:  # other work on the loop's thread: 20 ms a turn
        time.sleep(0.02)

    async def busy_loop() -> None:
        while True:
            hold_the_loop()
            await asyncio.sleep(0)

    policy = BatchPolicy(max_batch_size=4, max_delay_s="auto")
    batcher = Batcher(model, policy, executor="loop", switch_interval_s=None)
    async with batcher:
        noise = asyncio.create_task(busy_loop())
        try:
            for i in range(20):  # one at a time: batches of one
                await batcher.submit(np.array([float(i)]))
        finally:
            noise.cancel()
        state = batcher.adaptive_state()
    assert state is not None and state.num_batches >= 12
    one_batch_s = state.overhead_s + state.per_item_s
    # Sleeps overshoot on a busy machine, so the bound is loose; the span is 24 ms or more.
    assert 0.003 <= one_batch_s < 0.014, state


async def test_a_step_gate_holds_a_call_while_a_more_urgent_one_is_in_progress() -> None:
    seen: list[str] = []
    gate = StepGate()

    def steps(name: str, count: int) -> Generator[None, None, str]:
        for i in range(count):
            seen.append(f"{name}{i}")
            time.sleep(TURN_EVERY_S)  # long enough that the loop gets a turn after each
            yield
        return name

    async def urgent_call() -> str:  # starts once the lower call has taken its first step
        result, _ = await run_on_loop(steps("a", 2), gate, rank=0)
        return str(result)

    lower = asyncio.ensure_future(run_on_loop(steps("b", 3), gate, rank=2))
    urgent = asyncio.ensure_future(urgent_call())
    (low, _), high = await asyncio.gather(lower, urgent)
    assert (low, high) == ("b", "a")
    # b takes its first step, then waits at its yield until a has taken all of its own.
    assert seen == ["b0", "a0", "a1", "b1", "b2"]
    assert gate.num_calls == 0


class ClassOrder:
    """A model in steps that notes when each batch starts and ends, by its first value's
    sign (negative: background); 3 ms of blocking work a step, eight steps."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __call__(self, batch: np.ndarray) -> Generator[None, None, np.ndarray]:
        name = "background" if batch[0, 0] < 0 else "interactive"
        self.events.append(f"{name} starts")
        for _ in range(8):
            time.sleep(0.003)
            yield
        self.events.append(f"{name} ends")
        return batch * 2


@pytest.mark.parametrize("preempt", [True, False])
async def test_a_higher_class_runs_between_the_steps_of_a_lower_class_batch(
    preempt: bool,
) -> None:
    model = ClassOrder()
    policy = BatchPolicy(max_batch_size=4, max_delay_s=0.0, preempt=preempt)
    batcher = Batcher(model, policy, executor="loop", switch_interval_s=None)
    answered: list[str] = []

    async def ask(x: float, priority: str) -> np.ndarray:
        result: np.ndarray = await batcher.submit(np.array([x], np.float32), priority=priority)
        answered.append(priority)
        return result

    async with batcher:
        background = [asyncio.ensure_future(ask(-1.0 - i, "background")) for i in range(4)]
        await asyncio.sleep(0.005)  # the background batch is in its steps by now
        interactive = await ask(5.0, "interactive")
        results = await asyncio.gather(*background)
    np.testing.assert_array_equal(interactive, [10.0])
    assert [float(r[0]) for r in results] == [-2.0, -4.0, -6.0, -8.0]
    if preempt:
        assert model.events == [
            "background starts",
            "interactive starts",
            "interactive ends",
            "background ends",
        ]
        assert answered[0] == "interactive"
    else:
        assert model.events[:2] == ["background starts", "background ends"]
        assert answered[-1] == "interactive"


class StepCounter:
    """A model in steps counting the steps taken by every batch (5 ms of blocking work
    each, thirty of them) and noting how many had been taken when each batch started."""

    def __init__(self) -> None:
        self.steps = 0
        self.started_at: dict[str, int] = {}

    def __call__(self, batch: np.ndarray) -> Generator[None, None, np.ndarray]:
        name = "background" if batch[0, 0] < 0 else "interactive"
        self.started_at[name] = self.steps
        for _ in range(30 if name == "background" else 1):
            time.sleep(0.005)
            self.steps += 1
            yield
        return batch * 2


async def test_a_higher_class_window_that_runs_out_preempts_at_the_next_step() -> None:
    """An interactive request with a 10 ms window starts after about two 5 ms steps of the
    background batch (the window) and the one in progress, not several steps later."""
    model = StepCounter()
    policy = BatchPolicy(max_batch_size=4, max_delay_s=0.01, preempt=True)
    batcher = Batcher(model, policy, executor="loop", switch_interval_s=None)
    async with batcher:
        background = [
            asyncio.ensure_future(
                batcher.submit(np.array([-1.0], np.float32), priority="background")
            )
            for _ in range(4)
        ]
        await until(lambda: "background" in model.started_at)
        submitted_at = model.steps
        await batcher.submit(np.array([1.0], np.float32), priority="interactive")
        await asyncio.gather(*background)
    # Each step takes at least 5 ms, so at most two end within the window; one more may be
    # in progress when it ends. Without the gate held then, the loop's turns to wake the
    # replica's task let the background batch take about four more.
    assert model.started_at["interactive"] - submitted_at <= 4
