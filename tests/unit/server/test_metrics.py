"""``/metrics`` series read with prometheus_client's parser."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from carpool import Batcher, BatchPolicy, BatchTimeout
from carpool.core.clock import FakeClock
from carpool.server.metrics import Metrics
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec

SAFETY_S = 5.0


def _value(metrics: Metrics, name: str, model: str) -> float:
    body, _ = metrics.render()
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model") == model:
                return sample.value
    raise AssertionError(f"no sample {name}{{model={model!r}}} in:\n{body.decode()}")


async def test_a_replica_given_up_after_a_hang_is_counted_and_its_stuck_thread_shown() -> None:
    clock = FakeClock()
    entered, release = threading.Event(), threading.Event()

    def hangs(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        entered.set()
        release.wait(SAFETY_S)
        return {"y": inputs["x"]}

    policy = BatchPolicy(max_batch_size=1, max_delay_s=0.0, batch_timeout_s=1.0)
    batcher = Batcher(hangs, policy, collate="dict", clock=clock, executor="thread")
    spec = (TensorSpec("x", "FP32", (2,)),)
    served = ServedModel("hung", "1", "python", spec, (TensorSpec("y", "FP32", (2,)),), batcher)
    metrics = Metrics(ModelRepository([served]))
    await batcher.start()
    try:
        assert _value(metrics, "carpool_replicas_abandoned_total", "hung") == 0
        assert _value(metrics, "carpool_replica_threads_stuck", "hung") == 0
        task = asyncio.ensure_future(batcher.submit_many({"x": np.ones((1, 2), np.float32)}))
        await asyncio.wait_for(asyncio.to_thread(entered.wait, SAFETY_S), SAFETY_S)

        await clock.advance(1.0)

        assert isinstance((await asyncio.gather(task, return_exceptions=True))[0], BatchTimeout)
        assert _value(metrics, "carpool_replicas_abandoned_total", "hung") == 1
        assert _value(metrics, "carpool_replica_threads_stuck", "hung") == 1
        release.set()  # the stuck call returns: its thread ends
        async with asyncio.timeout(SAFETY_S):
            while _value(metrics, "carpool_replica_threads_stuck", "hung") != 0:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        assert _value(metrics, "carpool_replicas_abandoned_total", "hung") == 1
    finally:
        release.set()
        await batcher.stop()
