"""The in-process runner on a tiny NumPy model with very short trials, and the load driver.

These run real (short) load: they assert what happened, never how fast.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import types
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool import batched
from carpool.core.clock import FakeClock
from carpool.errors import ConfigError
from carpool.tools.modelref import resolve
from carpool.tools.tune_runners import InProcessRunner, LoadDriver, LoadSpec, load_window, rss_bytes
from carpool.tools.tune_trial import MeasureSettings, TrialConfig, measure_trial

SHORT = MeasureSettings(warmup_s=0.0, window_s=0.02, max_windows=2, num_stable_windows=1)
# For trials that must answer something: a window no busy 2-core CI machine stalls through
# (a 20 ms one measured nothing once, in the full suite), after a warm-up for the start.
ANSWERING = MeasureSettings(warmup_s=0.05, window_s=0.25, max_windows=2, num_stable_windows=1)
ITEM = np.ones(4, dtype=np.float32)


def double(batch: np.ndarray) -> np.ndarray:
    return batch * 2


class Doubler:
    def __call__(self, batch: np.ndarray) -> np.ndarray:
        return batch * 2


def make_doubler(device: str) -> Any:
    return double


def build_doubler() -> Any:
    return double


def build_twice() -> Any:
    """A zero-argument factory of an ``nn.Module``, as a serve torch source."""
    from torch import nn

    class Twice(nn.Module):
        def forward(self, x: Any) -> Any:
            return x * 2

    return Twice()


def by_name(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": inputs["x"] * 2}


@pytest.fixture
def models(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    module = types.ModuleType("tune_test_models")
    module.double = double  # type: ignore[attr-defined]
    module.Doubler = Doubler  # type: ignore[attr-defined]
    module.make_doubler = make_doubler  # type: ignore[attr-defined]
    module.build_doubler = build_doubler  # type: ignore[attr-defined]
    module.build_twice = build_twice  # type: ignore[attr-defined]
    module.by_name = by_name  # type: ignore[attr-defined]
    module.batched_double = batched(double, max_batch_size=8, max_delay_s=0.0)  # type: ignore[attr-defined]
    module.number = 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tune_test_models", module)
    yield "tune_test_models"


@pytest.mark.parametrize(
    "attr", ["double", "Doubler", "make_doubler", "build_doubler", "build_twice", "batched_double"]
)
async def test_in_process_runner_applies_the_config_and_measures(models: str, attr: str) -> None:
    runner = InProcessRunner(f"{models}:{attr}", ITEM, LoadSpec(concurrency=4))
    try:
        config = TrialConfig((("max_batch_size", 2), ("max_delay_s", 0.0)))
        m = await measure_trial(runner, config, ANSWERING)
        assert m.error is None
        assert m.num_requests > 0 and m.num_errors == 0
        assert m.mean_batch_size is not None and 1 <= m.mean_batch_size <= 2
        assert runner._batcher is not None and runner._batcher.policy.max_batch_size == 2
        assert np.array_equal(await runner.sample_output(), ITEM * 2)
    finally:
        await runner.close()


async def test_the_in_process_runner_measures_auto_as_a_level(models: str) -> None:
    runner = InProcessRunner(f"{models}:double", ITEM, LoadSpec(concurrency=4))
    try:
        config = TrialConfig((("max_batch_size", "auto"), ("max_delay_s", "auto")))
        m = await measure_trial(runner, config, ANSWERING)
        assert m.error is None and m.num_requests > 0 and m.num_errors == 0
        assert runner._batcher is not None and runner._batcher.policy.is_adaptive
    finally:
        await runner.close()


async def test_the_in_process_runner_sets_preempt_from_an_on_level(models: str) -> None:
    runner = InProcessRunner(f"{models}:double", ITEM, LoadSpec(concurrency=2))
    try:
        m = await measure_trial(runner, TrialConfig((("preempt", 1),)), ANSWERING)
        assert m.error is None and m.num_requests > 0
        assert runner._batcher is not None and runner._batcher.policy.preempt is True
    finally:
        await runner.close()


async def test_a_batched_function_brings_its_policy_as_the_base(models: str) -> None:
    runner = InProcessRunner(f"{models}:batched_double", ITEM, LoadSpec(concurrency=2))
    assert runner.base_policy.max_batch_size == 8
    await runner.close()


async def test_a_new_replica_count_rebuilds_the_batcher(models: str) -> None:
    runner = InProcessRunner(f"{models}:double", ITEM, LoadSpec(concurrency=4))
    try:
        await measure_trial(runner, TrialConfig((("num_replicas", 1),)), SHORT)
        first = runner._batcher
        await measure_trial(
            runner, TrialConfig((("num_replicas", 1), ("max_delay_s", 0.001))), SHORT
        )
        assert runner._batcher is first  # same replicas: the policy changed in place
        m = await measure_trial(runner, TrialConfig((("num_replicas", 2),)), ANSWERING)
        assert runner._batcher is not first and runner._batcher is not None
        assert runner._batcher.num_replicas == 2 and m.num_requests > 0
    finally:
        await runner.close()


async def test_buffer_pool_on_or_off_rebuilds_the_batcher(models: str) -> None:
    runner = InProcessRunner(f"{models}:double", ITEM, LoadSpec(concurrency=4))
    try:
        await measure_trial(runner, TrialConfig((("buffer_pool", 0),)), SHORT)
        first = runner._batcher
        assert first is not None and first.buffer_pool is None
        await measure_trial(runner, TrialConfig((("buffer_pool", 0), ("max_delay_s", 0.0))), SHORT)
        assert runner._batcher is first  # same pool setting: the policy changed in place
        m = await measure_trial(runner, TrialConfig((("buffer_pool", 1),)), ANSWERING)
        assert runner._batcher is not first and runner._batcher is not None
        pool = runner._batcher.buffer_pool
        assert pool is not None and m.num_requests > 0 and pool.stats().hits > 0
    finally:
        await runner.close()


async def test_a_rebuild_frees_the_models_before_it_builds_new_ones(
    models: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped batcher's replicas hold their models in reference cycles: with the
    cyclic collector idle (as between its rare full runs), each rebuild for
    ``buffer_pool`` kept one more model resident (W1: +35 MiB a rebuild in an L9 run)."""
    built: list[weakref.ref[Doubler]] = []

    def factory(device: str) -> Doubler:
        model = Doubler()
        built.append(weakref.ref(model))
        return model

    monkeypatch.setattr(sys.modules[models], "make_tracked", factory, raising=False)
    runner = InProcessRunner(f"{models}:make_tracked", ITEM, LoadSpec(concurrency=2))
    gc.disable()
    try:
        for pool in (0, 1, 0, 1):
            await measure_trial(runner, TrialConfig((("buffer_pool", pool),)), SHORT)
            assert sum(ref() is not None for ref in built) == 1, len(built)
        assert len(built) == 4
    finally:
        gc.enable()
        await runner.close()


async def test_an_invalid_policy_is_a_failed_trial(models: str) -> None:
    runner = InProcessRunner(f"{models}:double", ITEM, LoadSpec(concurrency=1))
    m = await measure_trial(runner, TrialConfig((("max_batch_size", 0),)), SHORT)
    assert m.error is not None and "max_batch_size" in m.error
    await runner.close()


async def test_open_loop_load_sends_poisson_arrivals(models: str) -> None:
    runner = InProcessRunner(f"{models}:double", ITEM, LoadSpec(rate_rps=2000.0))
    m = await measure_trial(runner, TrialConfig((("max_delay_s", 0.0),)), SHORT)
    await runner.close()
    assert m.error is None and m.num_errors == 0


async def test_load_driver_counts_failures_as_errors() -> None:
    calls: list[int] = []
    failed = asyncio.Event()

    async def failing() -> int:
        calls.append(1)
        failed.set()
        raise RuntimeError("boom")

    driver = LoadDriver(failing, LoadSpec(concurrency=1, rate_rps=None))
    driver.start()
    await asyncio.wait_for(failed.wait(), 60)
    await driver.stop()
    latencies, items, errors = driver.take()
    assert latencies == [] and items == 0 and errors == len(calls)


CONFIG = """
models:
  - name: doubled
    kind: python
    source: tune_test_models:by_name
    inputs: [{name: x, datatype: FP32, shape: [4]}]
    outputs: [{name: y, datatype: FP32, shape: [4]}]
    max_batch_size: 16
"""


async def test_a_config_model_is_tuned_as_served_from_its_policy(
    models: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(CONFIG)
    monkeypatch.syspath_prepend(str(tmp_path))  # where the config's sources import from
    entry = resolve(None, config=str(path), model="doubled")
    runner = InProcessRunner(entry, {"x": ITEM}, LoadSpec(concurrency=4))
    try:
        assert runner.base_policy.max_batch_size == 16 and runner.num_replicas == 1
        m = await measure_trial(runner, TrialConfig((("max_batch_size", 2),)), ANSWERING)
        assert m.error is None and m.num_requests > 0 and m.num_errors == 0
        assert runner._batcher is not None and runner._batcher.policy.max_batch_size == 2
        assert np.array_equal((await runner.sample_output())["y"], ITEM * 2)
    finally:
        await runner.close()


def test_targets_and_load_specs_are_validated(models: str) -> None:
    with pytest.raises(ConfigError, match="zero-argument factory or class"):
        InProcessRunner(f"{models}:number", ITEM, LoadSpec())
    with pytest.raises(ConfigError):
        InProcessRunner(f"{models}:missing", ITEM, LoadSpec())
    with pytest.raises(ConfigError):
        LoadSpec(concurrency=0)
    with pytest.raises(ConfigError):
        LoadSpec(rate_rps=-1.0)


@pytest.mark.skipif(sys.platform != "linux", reason="read from /proc/self/statm")
def test_rss_is_measured_on_linux() -> None:
    rss = rss_bytes()
    assert rss is not None and rss > 0


class _StalledClock(FakeClock):
    """A fake clock read from ``now[0]``, which a model moves while it blocks the loop."""

    def __init__(self, now: list[float]) -> None:
        super().__init__(now[0])
        self._cell = now

    def now(self) -> float:
        return self._cell[0]


async def test_tuner_open_loop_counts_latency_from_the_schedule() -> None:
    # A model that blocks the event loop for 1 s on its first call: every arrival due
    # meanwhile leaves late, and its latency must count from when it was due.
    now = [0.0]
    calls = [0]
    done = asyncio.Event()

    async def submit() -> int:
        calls[0] += 1
        if calls[0] == 1:
            now[0] += 1.0  # synchronous: nothing else runs meanwhile
        if calls[0] == 200:
            done.set()
        return 1

    driver = LoadDriver(submit, LoadSpec(rate_rps=1000.0), clock=_StalledClock(now))
    driver.start()
    await done.wait()
    await driver.stop()
    latencies, _, errors = driver.take()
    assert errors == 0 and len(latencies) >= 200
    # Requests 2..200 were due at ~1 ms steps during the stall and answered at 1.0 s.
    assert sum(1 for lat in latencies if lat > 0.5) >= 150


async def test_a_window_counts_no_answer_that_landed_while_its_probe_ran() -> None:
    """The probe (a server's stats request) takes time in which answers land: counted in a
    window whose clock started after it, they made a server's throughput read 4-8% high."""

    class Landing:
        def __init__(self) -> None:
            self.items = 0

        def take(self) -> tuple[list[float], int, int]:
            taken, self.items = self.items, 0
            return [0.001] * taken, taken, 0

    driver = Landing()

    async def probe() -> tuple[int, int]:
        driver.items += 5  # answers that landed while the probe waited
        return 0, 0

    _, items, errors, _, _ = await load_window(driver, 0.0, probe)  # type: ignore[arg-type]
    assert (items, errors) == (0, 0)
