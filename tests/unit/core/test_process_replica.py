"""Process replicas (``executor="process"``): real spawned processes, small and fast."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool import Batcher, BatchPolicy, BatchTimeout, Closed, ConfigError, ModelError, batched
from carpool.core.process_replica import ProcessReplica
from carpool.core.remote_replica import RESTART_WAIT_S

SLOW_MARK = 7.0  # a batch holding this value computes for SLOW_S
SLOW_S = 0.6
HANG_MARK = -1.0  # ... this value, for ever
FAIL_MARK = 13.0  # ... this value raises
EXIT_MARK = 333.0  # ... this value ends the process with os._exit(3)
ANSWER_EXIT_MARK = 444.0  # ... this value waits for GO_ENV's file, is answered, then the
# process ends (os._exit(4))
GO_ENV = "CARPOOL_TEST_GO"  # a file the test creates when a child may go on
BUILT_ENV = "CARPOOL_TEST_BUILT"  # dying_factory's marker file


@pytest.fixture(autouse=True)
def _importable_in_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """Children find this module's functions by the name pytest imported it under
    (``tests.unit.core.test_process_replica`` in importlib mode): from the repository's
    root, which a child has on its path only when the parent has."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))


def model(batch: Any) -> Any:
    """Doubles an array, or a dict's "a" plus its "b"; slow, hung or failing on marks."""
    values = (
        np.concatenate([np.ravel(v) for v in batch.values()]) if isinstance(batch, dict) else batch
    )
    if np.any(values == EXIT_MARK):
        os._exit(3)
    if np.any(values == ANSWER_EXIT_MARK):
        _wait_for_go()
        threading.Timer(0.05, os._exit, (4,)).start()
    if np.any(values == FAIL_MARK):
        raise ValueError("thirteen is unlucky")
    if np.any(values == HANG_MARK):
        time.sleep(60)
    if np.any(values == SLOW_MARK):
        time.sleep(SLOW_S)
    if isinstance(batch, dict):
        return {"y": batch["a"] * 2 + batch["b"], "pid": np.full(len(batch["a"]), os.getpid())}
    return batch * 2


def make_model(device: str) -> Any:
    assert device == "cpu"
    return model


def _wait_for_go() -> None:
    go = Path(os.environ[GO_ENV])
    while not go.exists():
        time.sleep(0.005)


def dying_factory(device: str) -> Any:
    """The model, built once GO_ENV's file exists; the process ends (os._exit(5)) 0.1 s
    after, once it has said it is ready. The first build only (BUILT_ENV's marker)."""
    built = Path(os.environ[BUILT_ENV])
    if not built.exists():
        _wait_for_go()
        built.touch()
        threading.Timer(0.1, os._exit, (5,)).start()
    return model


FAIL_ENV = "CARPOOL_TEST_FAIL"  # flaky_factory fails while this file exists


def flaky_factory(device: str) -> Any:
    if Path(os.environ[FAIL_ENV]).exists():
        raise RuntimeError("cannot build now")
    return model


@batched(executor="process", max_batch_size=4, max_delay_s=0.005)
def decorated(batch: np.ndarray) -> np.ndarray:
    return batch + 1


def _batcher(executor: str, **kw: Any) -> Batcher:
    kw.setdefault("policy", BatchPolicy(max_batch_size=4, max_delay_s=0.005))
    kw.setdefault("num_replicas", 2)
    return Batcher(model, executor=executor, switch_interval_s=None, **kw)


def _one_from_factory(name: str) -> Batcher:
    """One process replica built by this module's factory ``name``."""
    return Batcher(
        fn_factory=f"{__name__}:{name}", executor="process", num_replicas=1, switch_interval_s=None
    )


def _replicas(batcher: Batcher) -> list[ProcessReplica]:
    replicas = batcher._dispatch.replicas
    assert all(isinstance(r, ProcessReplica) for r in replicas)
    return replicas  # type: ignore[return-value]


def _hold_loop(seconds: float, until: Any = None) -> None:
    """Block the event loop (on purpose: what a child sends meanwhile reaches it in one
    turn) until ``until()`` holds, if given (30 s at most), then ``seconds`` more."""
    end = time.monotonic() + 30.0
    while until is not None and not until():
        assert time.monotonic() < end, "the child did not get there in time"
        time.sleep(0.01)
    time.sleep(seconds)


async def _until(condition: Any, limit_s: float = 5.0) -> None:
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_results_equal_the_thread_executors_for_dicts_and_arrays() -> None:
    arrays = [np.arange(3, dtype=np.float32) + i for i in range(6)]
    dicts = [{"a": np.full(2, i, np.int64), "b": np.arange(2, dtype=np.int64)} for i in range(6)]
    answers = {}
    for executor in ("thread", "process"):
        async with _batcher(executor, num_replicas=1) as batcher:
            got_arrays = await asyncio.gather(*(batcher.submit(a) for a in arrays))
        async with _batcher(executor, num_replicas=1, collate="dict") as batcher:
            got_dicts = await asyncio.gather(*(batcher.submit(d) for d in dicts))
        answers[executor] = (got_arrays, [d["y"] for d in got_dicts])
    for thread, process in zip(answers["thread"], answers["process"], strict=True):
        for t, p in zip(thread, process, strict=True):
            np.testing.assert_array_equal(t, p)


async def test_two_replicas_both_run_batches_in_their_own_processes() -> None:
    async with _batcher("process", collate="dict") as batcher:
        payloads = [{"a": np.full(1, SLOW_MARK), "b": np.zeros(1)} for _ in range(8)]
        results = await asyncio.gather(*(batcher.submit(p) for p in payloads))
        replicas = _replicas(batcher)
        pids = {r.pid for r in replicas}
        assert os.getpid() not in pids and len(pids) == 2
        assert {int(np.ravel(r["pid"])[0]) for r in results} == pids
        assert all(s.num_batches > 0 for s in batcher.snapshot().replicas)


async def test_a_child_killed_mid_batch_has_its_batch_run_again_and_is_restarted() -> None:
    async with _batcher("process") as batcher:
        replicas = _replicas(batcher)
        futures = [asyncio.ensure_future(batcher.submit(np.full(2, SLOW_MARK))) for _ in range(4)]
        await _until(lambda: any(r._pending is not None for r in replicas))
        busy = next(r for r in replicas if r._pending is not None)
        killed_pid = busy.pid
        assert killed_pid is not None
        await asyncio.sleep(0.1)  # the child has the batch
        os.kill(killed_pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*futures), 10)
        assert all(np.array_equal(r, np.full(2, 2 * SLOW_MARK)) for r in results)
        await _until(lambda: busy.is_healthy and busy.pid != killed_pid)
        assert busy.counters.num_restarts == 1
        again = await batcher.submit(np.ones(2))  # the restarted replica serves
        np.testing.assert_array_equal(again, np.full(2, 2.0))


async def test_a_lone_child_killed_mid_batch_fails_its_batch_naming_the_signal() -> None:
    async with _batcher("process", num_replicas=1) as batcher:
        (replica,) = _replicas(batcher)
        future = asyncio.ensure_future(batcher.submit(np.full(2, SLOW_MARK)))
        await _until(lambda: replica._pending is not None)
        await asyncio.sleep(0.1)
        assert replica.pid is not None
        os.kill(replica.pid, signal.SIGKILL)
        with pytest.raises(ModelError, match="killed by signal 9"):
            await asyncio.wait_for(future, 5)
        await _until(lambda: replica.is_healthy)
        np.testing.assert_array_equal(await batcher.submit(np.ones(1)), [2.0])


async def test_a_child_that_exits_fails_its_batch_naming_the_exit_code() -> None:
    async with _batcher("process", num_replicas=1) as batcher:
        (replica,) = _replicas(batcher)
        with pytest.raises(ModelError, match="exit code 3"):
            await asyncio.wait_for(batcher.submit(np.full(1, EXIT_MARK)), 5)
        await _until(lambda: replica.is_healthy)
        assert replica.counters.num_restarts == 1


async def test_an_answer_sent_just_before_the_child_died_still_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer and the exit reach the loop in one turn (the loop held meanwhile): the
    batch is answered with the child's outputs, not failed nor run again, and the
    replica is started again."""
    go = tmp_path / "go"
    monkeypatch.setenv(GO_ENV, str(go))
    async with _batcher("process", num_replicas=1) as batcher:
        (replica,) = _replicas(batcher)
        # A first answer: this side now maps the child's output region, which the
        # child's death unlinks (the answer below is written to the same region).
        np.testing.assert_array_equal(await batcher.submit(np.ones(2)), [2.0, 2.0])
        future = asyncio.ensure_future(batcher.submit(np.full(2, ANSWER_EXIT_MARK)))
        await _until(lambda: replica._pending is not None)  # the child waits for go
        first_pid = replica.pid
        go.touch()
        _hold_loop(0.5)  # meanwhile the child answers, then exits 50 ms later
        result = await asyncio.wait_for(future, 5)
        np.testing.assert_array_equal(result, np.full(2, 2 * ANSWER_EXIT_MARK))
        await _until(lambda: replica.is_healthy and replica.pid != first_pid)
        assert replica.counters.num_restarts == 1
        np.testing.assert_array_equal(await batcher.submit(np.ones(1)), [2.0])


async def test_a_child_that_dies_right_after_saying_ready_fails_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "ready" and the exit reach the loop in one turn: the start fails naming the exit,
    rather than reporting a dead replica healthy (its batches would all fail, and nothing
    would start it again)."""
    built, go = tmp_path / "built", tmp_path / "go"
    monkeypatch.setenv(BUILT_ENV, str(built))
    monkeypatch.setenv(GO_ENV, str(go))
    batcher = _one_from_factory("dying_factory")
    starting = asyncio.ensure_future(batcher.start())
    await _until(lambda: bool(multiprocessing.active_children()), 30.0)  # it is building
    go.touch()
    _hold_loop(0.5, until=built.exists)  # meanwhile it says ready, then exits 0.1 s later
    with pytest.raises(RuntimeError, match="exit code 5"):
        await asyncio.wait_for(starting, 10)


async def test_the_restart_wait_doubles_only_while_starts_fail_and_only_starts_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: each death doubled the wait before the next start though every start had
    worked (5 s of downtime by the seventh idle crash), and each failed start counted as
    a restart."""
    failing = tmp_path / "fail"
    monkeypatch.setenv(FAIL_ENV, str(failing))
    batcher = _one_from_factory("flaky_factory")
    async with batcher:
        (replica,) = _replicas(batcher)
        for deaths in (1, 2, 3):  # idle deaths, each start working
            pid = replica.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await _until(lambda: replica.is_healthy and replica.pid != pid)  # noqa: B023
            assert replica.counters.num_restarts == deaths
            assert replica._restart_wait_s == RESTART_WAIT_S
        failing.touch()  # the next starts fail: the wait grows meanwhile
        pid = replica.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await _until(lambda: replica._restart_wait_s >= 4 * RESTART_WAIT_S)
        failing.unlink()
        await _until(lambda: replica.is_healthy)
        assert replica.counters.num_restarts == 4  # the failed starts restarted nothing
        assert replica._restart_wait_s == RESTART_WAIT_S
        np.testing.assert_array_equal(await batcher.submit(np.ones(1)), [2.0])


async def test_large_batches_grow_the_region_and_other_payloads_are_pickled() -> None:
    async with _batcher("process", num_replicas=1) as batcher:
        big = np.linspace(0.5, 1.5, 600_000)  # 4.8 MB: past the first region; no mark
        np.testing.assert_array_equal(await batcher.submit(big), big * 2)
    async with Batcher(upper, executor="process", collate="list") as batcher:
        assert await asyncio.gather(batcher.submit("a"), batcher.submit("b")) == ["A", "B"]


def upper(batch: list[str]) -> list[str]:
    return [text.upper() for text in batch]


async def test_a_hung_child_past_batch_timeout_is_killed_and_replaced() -> None:
    policy = BatchPolicy(max_batch_size=4, max_delay_s=0.005, batch_timeout_s=0.5)
    async with _batcher("process", num_replicas=1, policy=policy) as batcher:
        (replica,) = _replicas(batcher)
        hung_pid = replica.pid
        with pytest.raises(BatchTimeout):
            await asyncio.wait_for(batcher.submit(np.full(1, HANG_MARK)), 5)
        await _until(lambda: replica.is_healthy and replica.pid != hung_pid)
        assert replica.counters.num_restarts == 1
        np.testing.assert_array_equal(await batcher.submit(np.ones(1)), [2.0])


async def test_a_model_exception_fails_only_its_batch_and_the_process_serves_on() -> None:
    async with _batcher("process", num_replicas=1) as batcher:
        (replica,) = _replicas(batcher)
        pid = replica.pid
        with pytest.raises(ModelError, match="ValueError: thirteen is unlucky"):
            await batcher.submit(np.full(1, FAIL_MARK))
        np.testing.assert_array_equal(await batcher.submit(np.ones(1)), [2.0])
        assert replica.pid == pid and replica.counters.num_restarts == 0


async def test_children_outlive_sigint_and_sigterm_but_not_stop() -> None:
    batcher = _batcher("process")
    await batcher.start()
    processes = [r._process for r in _replicas(batcher)]
    assert all(p is not None and p.pid is not None for p in processes)
    for process in processes:
        assert process is not None and process.pid is not None
        os.kill(process.pid, signal.SIGINT)  # the server drains: stop() ends them
        os.kill(process.pid, signal.SIGTERM)
    np.testing.assert_array_equal(await batcher.submit(np.ones(1)), [2.0])
    assert all(p is not None and p.is_alive() for p in processes)
    await batcher.stop()
    assert not any(p is not None and p.is_alive() for p in processes)


async def test_a_bounded_stop_kills_a_child_mid_batch() -> None:
    batcher = _batcher("process", num_replicas=1)
    await batcher.start()
    (replica,) = _replicas(batcher)
    process = replica._process
    future = asyncio.ensure_future(batcher.submit(np.full(1, HANG_MARK)))
    await _until(lambda: replica._pending is not None)
    await batcher.stop(timeout_s=0.2)
    with pytest.raises(Closed):
        await future
    assert process is not None and not process.is_alive()


async def test_a_module_attr_factory_and_a_decorated_function_run_in_processes() -> None:
    async with Batcher(
        fn_factory=f"{__name__}:make_model", executor="process", num_replicas=1
    ) as batcher:
        np.testing.assert_array_equal(await batcher.submit(np.ones(2)), [2.0, 2.0])
    async with decorated:
        np.testing.assert_array_equal(await decorated(np.ones(2)), [2.0, 2.0])


def test_a_function_that_cannot_be_pickled_is_refused_saying_what_is_expected() -> None:
    with pytest.raises(ConfigError, match="picklable function"):
        Batcher(lambda batch: batch, executor="process")
    with pytest.raises(ConfigError, match="replica_cpus"):
        Batcher(model, executor="process", num_replicas=2, replica_cpus=[[0]])
    with pytest.raises(ConfigError, match="module:attr"):
        Batcher(fn_factory="no_colon", executor="process")


async def test_replicas_are_pinned_to_their_cpus() -> None:
    cpu = sorted(os.sched_getaffinity(0))[0]
    async with Batcher(
        affinity, executor="process", num_replicas=1, replica_cpus=[[cpu]]
    ) as batcher:
        np.testing.assert_array_equal(await batcher.submit(np.zeros(1)), [1])


def test_a_cpu_no_process_may_be_pinned_to_is_refused_before_any_replica_starts() -> None:
    """Was: the child's sched_setaffinity failed (EINVAL) and the start ended in a
    traceback, exit 1, not naming replica_cpus."""
    missing = max(os.cpu_count() or 1, *os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match=rf"replica_cpus.*\[{missing}\] are not among them"):
        Batcher(affinity, executor="process", num_replicas=1, replica_cpus=[[missing]])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin apart")
async def test_a_server_pinned_by_taskset_may_pin_its_replicas_to_other_cpus() -> None:
    """A taskset mask binds the server, not its replicas (a child may widen its own), so
    the server on one CPU with a replica on another is taken. Was: refused, as outside
    the server's mask."""
    mask = os.sched_getaffinity(0)
    first, other = sorted(mask)[:2]
    os.sched_setaffinity(0, {first})  # as `taskset -c first` would start it
    try:
        batcher = Batcher(affinity, executor="process", num_replicas=1, replica_cpus=[[other]])
        assert os.sched_getaffinity(0) == {first}  # the check put this thread back
    finally:
        os.sched_setaffinity(0, mask)
    async with batcher:
        np.testing.assert_array_equal(await batcher.submit(np.zeros(1)), [1])


def affinity(batch: np.ndarray) -> np.ndarray:
    return np.full(len(batch), len(os.sched_getaffinity(0)))


class Scaled:
    """Two batched methods run in child processes: each call needs its own instance."""

    def __init__(self, k: float) -> None:
        self.k = k

    @batched(executor="process", max_delay_s=0.001)
    def times(self, batch: np.ndarray) -> np.ndarray:
        return batch * self.k

    @batched(executor="process", max_delay_s=0.001)
    def plus(self, batch: np.ndarray) -> np.ndarray:
        return batch + self.k


async def test_a_batched_method_runs_in_a_process_on_its_own_instance() -> None:
    """Was: the child got the function by name without its instance, and every request
    failed with "missing 1 required positional argument". The second method starts while
    the first's batcher sits in the instance's __dict__ (which no pickle takes)."""
    three, five = Scaled(3.0), Scaled(5.0)
    try:
        np.testing.assert_array_equal(await three.times(np.ones(2)), [3.0, 3.0])
        np.testing.assert_array_equal(await five.times(np.ones(2)), [5.0, 5.0])
        np.testing.assert_array_equal(await three.plus(np.ones(2)), [4.0, 4.0])
    finally:
        for method in (three.times, five.times, three.plus):
            await method.stop()


def test_a_methods_reference_pickles_its_instance_without_the_batchers_it_holds_later() -> None:
    """Ray pickles the reference when its actor starts, after the instance stored its
    batcher (the reference held the live instance, and Ray's pickle met a lock); and the
    instance itself keeps its batcher (a copy that shared its __dict__ lost it, and each
    call then started another child)."""
    import pickle

    from carpool.core.model_source import BATCHED_ATTRIBUTE, process_source

    scaled = Scaled(7.0)
    bound = functools.partial(Scaled.__dict__["times"]._fn, scaled)
    _, ref = process_source(bound, None)
    scaled.__dict__[f"{BATCHED_ATTRIBUTE}times"] = threading.Lock()  # as __get__ does next
    copy = pickle.loads(pickle.dumps(ref)).args[0]
    assert type(copy) is Scaled and vars(copy) == {"k": 7.0}
    assert f"{BATCHED_ATTRIBUTE}times" in vars(scaled)


class Stated:
    def __init__(self) -> None:
        self.k = 1.0

    def __getstate__(self) -> dict[str, float]:
        return {"k": self.k}

    @batched(executor="process")
    def times(self, batch: np.ndarray) -> np.ndarray:
        return batch * self.k


def test_a_method_of_a_class_with_its_own_pickling_is_refused_saying_why() -> None:
    with pytest.raises(ConfigError, match="defines __reduce__, __getstate__ or __slots__"):
        Stated().times.batcher  # noqa: B018 - built on first access
