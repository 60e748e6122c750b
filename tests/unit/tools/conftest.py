"""Fakes for the tuner tests: a trial runner with a known response surface, no wall clock."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np

from carpool.errors import ConfigError
from carpool.tools.tune_trial import Measurement, TrialConfig, WindowSample

Number = int | float


def surface(values: dict[str, Number]) -> tuple[float, float]:
    """(throughput req/s, p99 s): bigger batches and longer delays buy throughput and cost
    latency; replicas add throughput. The best within a 20 ms p99 is delay 0.01, batch 16."""
    delay = float(values.get("max_delay_s", 0.0))
    size = float(values.get("max_batch_size", 1))
    replicas = float(values.get("num_replicas", 1))
    throughput = 100.0 * math.sqrt(size) * (1 + 10 * delay) * replicas**0.5
    p99_s = (2.0 + 0.3 * size + 1000 * delay) * 1e-3
    return throughput, p99_s


class SurfaceRunner:
    """A :class:`TrialRunner` whose windows come from ``surface`` (or a scripted list of
    throughputs, ``windows``); it records every call."""

    def __init__(
        self,
        fn: Callable[[dict[str, Number]], tuple[float, float]] = surface,
        windows: list[float] | None = None,
    ) -> None:
        self.fn = fn
        self.scripted: Iterator[float] | None = iter(windows) if windows is not None else None
        self.calls: list[str] = []
        self.config: dict[str, Number] = {}

    async def start_trial(self, config: TrialConfig) -> None:
        self.calls.append("start")
        self.config = config.as_dict()
        if self.config.get("max_batch_size", 1) == 0:
            raise ConfigError("max_batch_size", 0, "an integer >= 1")

    async def measure_window(self, duration_s: float) -> WindowSample:
        self.calls.append(f"window {duration_s}")
        throughput, p99_s = self.fn(self.config)
        if self.scripted is not None:
            throughput = next(self.scripted)
        num = max(1, round(throughput * duration_s))
        latencies = np.full(num, p99_s)
        return WindowSample(duration_s, num, 0, latencies, mean_batch_size=2.0, memory_bytes=100)

    async def end_trial(self) -> None:
        self.calls.append("end")


def measured(throughput: float, p99_s: float, **changes: object) -> Measurement:
    fields: dict[str, object] = dict(
        throughput_rps=throughput, throughput_items_s=throughput, p50_s=p99_s / 2, p99_s=p99_s,
        num_requests=100, num_errors=0, num_windows=3, spread=0.0, is_stable=True,
        measured_s=1.0,
    )  # fmt: skip
    fields.update(changes)
    return Measurement(**fields)  # type: ignore[arg-type]
