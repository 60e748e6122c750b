"""Where a sync model runs: its replica's thread, or the event loop's thread."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading

import numpy as np
import pytest

from carpool import Batcher, BatchPolicy
from carpool.core import replicas
from carpool.errors import ConfigError


class ThreadRecorder:
    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.sizes: list[int] = []

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        self.threads.add(threading.get_ident())
        self.sizes.append(len(batch))
        return batch * 2


async def _run(executor: str, device: str = "cpu") -> tuple[ThreadRecorder, list[float]]:
    model = ThreadRecorder()
    batcher = Batcher(
        model,
        BatchPolicy(max_batch_size=8, max_delay_s=0.01),
        devices=[device],
        executor=executor,
        switch_interval_s=None,
    )
    async with batcher:
        results = await asyncio.gather(
            *(batcher.submit(np.array([i], dtype=np.float32)) for i in range(8))
        )
    return model, [float(r[0]) for r in results]


async def test_loop_runs_the_model_on_the_event_loop_thread_and_still_batches() -> None:
    model, results = await _run("loop")
    assert model.threads == {threading.get_ident()}
    assert results == [2.0 * i for i in range(8)]
    assert model.sizes == [8]


async def test_thread_runs_the_model_on_its_replica_thread() -> None:
    model, results = await _run("thread")
    assert threading.get_ident() not in model.threads
    assert results == [2.0 * i for i in range(8)]


@pytest.mark.parametrize(
    ("cpus", "device", "on_loop"),
    [(1, "cpu", True), (2, "cpu", False), (1, "cuda:0", False)],
)
async def test_auto_uses_the_loop_only_for_a_cpu_model_confined_to_one_cpu(
    monkeypatch: pytest.MonkeyPatch, cpus: int, device: str, on_loop: bool
) -> None:
    monkeypatch.setattr(replicas, "usable_cpus", lambda: cpus)
    assert replicas.runs_on_loop("auto", device) is on_loop
    if device == "cpu":
        model, _ = await _run("auto")
        assert (model.threads == {threading.get_ident()}) is on_loop


def test_an_unknown_executor_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="executor"):
        Batcher(lambda batch: batch, executor="process")


async def test_a_model_error_on_the_loop_fails_only_its_batch() -> None:
    def fails_on_seven(batch: np.ndarray) -> np.ndarray:
        if 7 in batch:
            raise RuntimeError("seven")
        return batch

    batcher = Batcher(fails_on_seven, BatchPolicy(max_batch_size=1), executor="loop")
    async with batcher:
        ok, bad = await asyncio.gather(
            batcher.submit(np.ones(1)), batcher.submit(np.full(1, 7.0)), return_exceptions=True
        )
    assert float(ok[0]) == 1.0
    assert "seven" in str(bad)


async def test_auto_moves_a_replica_off_the_loop_when_a_batch_computes_too_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replicas, "usable_cpus", lambda: 1)
    monkeypatch.setattr(replicas, "LONGEST_BATCH_ON_LOOP_S", 0.0)  # every batch is too long
    model = ThreadRecorder()
    batcher = Batcher(model, BatchPolicy(max_batch_size=1), executor="auto")
    async with batcher:
        await batcher.submit(np.ones(1))
        assert model.threads == {threading.get_ident()}  # the first batch ran on the loop
        await batcher.submit(np.ones(1))
    assert len(model.threads) == 2  # the next one on the replica's thread


async def test_auto_stays_on_the_loop_after_batches_that_only_waited_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Too long in wall time, not in CPU time: a shared machine's hiccup, or a model that
    # waited. The loop keeps the model until SLOW_BATCHES_TO_LEAVE_LOOP such batches in a row.
    monkeypatch.setattr(replicas, "usable_cpus", lambda: 1)
    monkeypatch.setattr(replicas, "LONGEST_BATCH_ON_LOOP_S", 0.0)  # every batch is too long
    monkeypatch.setattr(replicas, "thread_cpu_s", lambda: 0.0)  # and computes nothing
    model = ThreadRecorder()
    batcher = Batcher(model, BatchPolicy(max_batch_size=1), executor="auto")
    loop_thread = threading.get_ident()
    async with batcher:
        for _ in range(replicas.SLOW_BATCHES_TO_LEAVE_LOOP):
            await batcher.submit(np.ones(1))
        assert model.threads == {loop_thread}
        await batcher.submit(np.ones(1))
    assert len(model.threads) == 2  # after that many in a row: the replica's thread


async def test_auto_counts_only_slow_batches_in_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replicas, "usable_cpus", lambda: 1)
    monkeypatch.setattr(replicas, "thread_cpu_s", lambda: 0.0)
    model = ThreadRecorder()
    batcher = Batcher(model, BatchPolicy(max_batch_size=1), executor="auto")
    async with batcher:
        for _ in range(3 * replicas.SLOW_BATCHES_TO_LEAVE_LOOP):
            # one batch within the limit after each pair that took too long
            for limit in (0.0, 0.0, 60.0):
                monkeypatch.setattr(replicas, "LONGEST_BATCH_ON_LOOP_S", limit)
                await batcher.submit(np.ones(1))
    assert model.threads == {threading.get_ident()}


async def test_loop_stays_on_the_loop_however_long_a_batch_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replicas, "LONGEST_BATCH_ON_LOOP_S", 0.0)
    model = ThreadRecorder()
    batcher = Batcher(model, BatchPolicy(max_batch_size=1), executor="loop")
    async with batcher:
        for _ in range(3):
            await batcher.submit(np.ones(1))
    assert model.threads == {threading.get_ident()}


async def test_replicas_build_one_at_a_time_and_a_build_kept_waiting_is_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Builds take turns (a factory seeding torch's global RNG drew another replica's
    # weights otherwise); a factory that never returns must not hold the others silently.
    import logging

    monkeypatch.setattr(replicas, "BUILD_WAIT_LOG_S", 0.01)
    release = threading.Event()
    building: list[str] = []
    overlapped: list[str] = []
    entered: list[str] = []

    class ReleaseOnWarning(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "has waited" in record.getMessage():
                release.set()

    def factory(device: str) -> ThreadRecorder:
        if building:
            overlapped.append(device)
        building.append(device)
        entered.append(device)
        if len(entered) == 1:  # the first build holds the other back until its wait is logged
            release.wait(30)
        building.remove(device)
        return ThreadRecorder()

    handler = ReleaseOnWarning()
    logging.getLogger("carpool.replicas").addHandler(handler)
    try:
        batcher = Batcher(fn_factory=factory, devices=["cpu", "cpu"], executor="thread")
        async with batcher:
            assert batcher.num_replicas == 2
    finally:
        logging.getLogger("carpool.replicas").removeHandler(handler)
    assert release.is_set(), "the waiting build was not logged"
    assert overlapped == []


@pytest.mark.parametrize(
    ("executor", "batch_timeout_s", "warns"),
    [("loop", 60.0, True), ("loop", None, False), ("thread", 60.0, False)],
)
async def test_a_model_on_the_loop_warns_once_that_batch_timeout_cannot_stop_it(
    caplog: pytest.LogCaptureFixture, executor: str, batch_timeout_s: float | None, warns: bool
) -> None:
    policy = BatchPolicy(batch_timeout_s=batch_timeout_s)
    batcher = Batcher(ThreadRecorder(), policy, executor=executor, switch_interval_s=None)
    with caplog.at_level(logging.WARNING, logger="carpool"):
        async with batcher:
            await batcher.submit(np.ones(1, dtype=np.float32))
    warnings = [r for r in caplog.records if "cannot stop a batch that hangs" in r.getMessage()]
    assert len(warnings) == (1 if warns else 0)


async def test_a_replica_that_auto_moves_off_the_loop_lowers_the_switch_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the loop the model needs no GIL hand-over; on its thread it does (see
    # SwitchInterval), and the loop's refusals wait out the interval otherwise.
    monkeypatch.setattr(replicas, "usable_cpus", lambda: 1)
    monkeypatch.setattr(replicas, "LONGEST_BATCH_ON_LOOP_S", 0.0)  # every batch is too long
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        batcher = Batcher(ThreadRecorder(), BatchPolicy(max_batch_size=1), executor="auto")
        async with batcher:
            assert sys.getswitchinterval() == pytest.approx(0.005)  # on the loop
            await batcher.submit(np.ones(1))  # too long: the next on the replica's thread
            await batcher.submit(np.ones(1))
            assert sys.getswitchinterval() == pytest.approx(0.0005)
        assert sys.getswitchinterval() == pytest.approx(0.005)  # restored at the stop
    finally:
        sys.setswitchinterval(saved)
