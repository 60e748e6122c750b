"""One tuning trial: apply a config, warm up, measure windows until throughput is stable.

::

    apply config ─ warm-up window (discarded) ─ w1 ─ w2 ─ w3 ─ ... ─ wN
                                                 └─ stop once the last k windows' throughput
                                                    spreads (max-min)/mean <= stable_spread,
                                                    or at max_windows

The load keeps running across windows; a window counts the requests that completed in it.
Where the load comes from and how the config is applied is a :class:`TrialRunner`'s
business (in-process batcher or a running server: :mod:`carpool.tools.tune_runners`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from carpool.errors import ConfigError

Number = int | float | str  # "auto" for max_delay_s / max_batch_size


class TargetRefused(ConfigError):
    """The server to tune refused access (401: its API key; 403: policy updates not
    allowed): every trial would fail alike, so the search stops at once."""


@dataclass(frozen=True, slots=True)
class TrialConfig:
    """The values one trial sets, as ``(name, value)`` pairs in the space's order."""

    values: tuple[tuple[str, Number], ...]

    def as_dict(self) -> dict[str, Number]:
        return dict(self.values)

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.values)


@dataclass(frozen=True, slots=True)
class WindowSample:
    """What completed within one window of ``elapsed_s`` seconds."""

    elapsed_s: float
    num_items: int
    num_errors: int
    latencies_s: npt.NDArray[np.float64]
    mean_batch_size: float | None = None
    memory_bytes: int | None = None

    @property
    def num_requests(self) -> int:
        return int(self.latencies_s.size)

    @property
    def throughput_rps(self) -> float:
        return self.num_requests / self.elapsed_s if self.elapsed_s > 0 else 0.0


class TrialRunner(Protocol):
    """Applies configs and measures windows of load under them."""

    async def start_trial(self, config: TrialConfig) -> None:
        """Apply ``config`` and start the load. Raises :class:`ConfigError` if invalid."""

    async def measure_window(self, duration_s: float) -> WindowSample:
        """Let the load run ``duration_s`` and report what completed meanwhile."""

    async def end_trial(self) -> None:
        """Stop the load (the next trial starts from idle)."""


@dataclass(frozen=True, slots=True)
class MeasureSettings:
    """How long a trial runs.

    Args:
        warmup_s: the discarded first window.
        window_s: each measured window.
        stable_spread: stop when the last ``num_stable_windows`` throughputs spread
            (max - min) / mean no more than this.
        num_stable_windows: k, the windows the spread is taken over (also the minimum).
        max_windows: most measured windows of a full-length trial.
    """

    warmup_s: float = 1.0
    window_s: float = 1.0
    stable_spread: float = 0.05
    num_stable_windows: int = 3
    max_windows: int = 5

    def __post_init__(self) -> None:
        if not (self.warmup_s >= 0 and math.isfinite(self.warmup_s)):
            raise ConfigError("warmup_s", self.warmup_s, "seconds >= 0")
        if not (self.window_s > 0 and math.isfinite(self.window_s)):
            raise ConfigError("window_s", self.window_s, "seconds > 0")
        if not self.stable_spread >= 0:
            raise ConfigError("stable_spread", self.stable_spread, "a fraction >= 0")
        if self.num_stable_windows < 1:
            raise ConfigError("num_stable_windows", self.num_stable_windows, "an integer >= 1")
        if self.max_windows < 1:
            raise ConfigError("max_windows", self.max_windows, "an integer >= 1")

    def windows_for(self, scale: float) -> tuple[int, int]:
        """(min, max) windows of a trial ``scale`` times the full length."""
        most = max(1, round(self.max_windows * scale))
        return min(self.num_stable_windows, most), most


@dataclass(frozen=True, slots=True)
class Measurement:
    """A trial's result over its measured windows (the warm-up left out)."""

    throughput_rps: float
    throughput_items_s: float
    p50_s: float
    p99_s: float
    num_requests: int
    num_errors: int
    num_windows: int
    spread: float  # of the last k windows' throughput
    is_stable: bool
    measured_s: float
    mean_batch_size: float | None = None
    memory_bytes: int | None = None  # the largest window's
    window_rps: tuple[float, ...] = field(default=())
    error: str | None = None

    @classmethod
    def failed(cls, error: str) -> Measurement:
        nan = math.nan
        return cls(0.0, 0.0, nan, nan, 0, 0, 0, nan, False, 0.0, error=error)


def spread(values: list[float]) -> float:
    """(max - min) / mean; infinite when the mean is 0 and the values differ."""
    mean = sum(values) / len(values)
    width = max(values) - min(values)
    if mean <= 0:
        return 0.0 if width == 0 else math.inf
    return width / mean


async def measure_trial(
    runner: TrialRunner, config: TrialConfig, settings: MeasureSettings, scale: float = 1.0
) -> Measurement:
    """Apply ``config`` through ``runner`` and measure until stable (see the module doc).

    A config the runner refuses (:class:`ConfigError`) or a runner failure comes back as a
    failed measurement naming the error, so one bad point does not end a search.
    """
    min_windows, max_windows = settings.windows_for(scale)
    k = min(settings.num_stable_windows, max_windows)
    windows: list[WindowSample] = []
    try:
        await runner.start_trial(config)
        try:
            if settings.warmup_s > 0:
                await runner.measure_window(settings.warmup_s)
            while len(windows) < max_windows:
                windows.append(await runner.measure_window(settings.window_s))
                if len(windows) >= min_windows and _is_stable(windows[-k:], settings):
                    break
        finally:
            await runner.end_trial()
    except TargetRefused:
        raise  # no trial can run: the whole search stops, saying what the server needs
    except (ConfigError, OSError) as error:
        return Measurement.failed(f"{type(error).__name__}: {error}")
    return summarize(windows, k, settings.stable_spread)


def _is_stable(last: list[WindowSample], settings: MeasureSettings) -> bool:
    return spread([w.throughput_rps for w in last]) <= settings.stable_spread


def summarize(windows: list[WindowSample], k: int, stable_spread: float) -> Measurement:
    """One measurement from every window (throughput over their total time, percentiles
    over every latency); the spread over the last ``k``."""
    elapsed = sum(w.elapsed_s for w in windows)
    latencies = np.concatenate([w.latencies_s for w in windows]) if windows else np.zeros(0)
    num_requests = int(latencies.size)
    rates = [w.throughput_rps for w in windows]
    last_spread = spread(rates[-k:]) if windows else math.nan
    p50, p99 = (
        (float(np.percentile(latencies, 50)), float(np.percentile(latencies, 99)))
        if num_requests
        else (math.nan, math.nan)
    )
    sizes = [(w.mean_batch_size, w.num_items) for w in windows if w.mean_batch_size]
    items = sum(w.num_items for w in windows)
    mean_batch = None
    if sizes:  # weighted by items: the mean over every batch of the trial
        num_batches = sum(n / b for b, n in sizes if b)
        mean_batch = sum(n for _, n in sizes) / num_batches if num_batches else None
    memories = [w.memory_bytes for w in windows if w.memory_bytes is not None]
    return Measurement(
        throughput_rps=num_requests / elapsed if elapsed > 0 else 0.0,
        throughput_items_s=items / elapsed if elapsed > 0 else 0.0,
        p50_s=p50,
        p99_s=p99,
        num_requests=num_requests,
        num_errors=sum(w.num_errors for w in windows),
        num_windows=len(windows),
        spread=last_spread,
        is_stable=len(windows) >= k and last_spread <= stable_spread,
        measured_s=elapsed,
        mean_batch_size=mean_batch,
        memory_bytes=max(memories) if memories else None,
        window_rps=tuple(rates),
    )
