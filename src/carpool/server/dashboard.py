"""The dashboard's data: each model's figures sampled every second into a bounded ring.

``carpool serve`` runs :meth:`Dashboard.run` (off with ``--no-dashboard``): each tick reads
every model's live document (:func:`carpool.server.live.live_figures`) and appends one
:data:`Sample` to the model's ring. A sample is the second's rates (the difference of two
documents) and the moment's gauges, so the ring holds the last ``capacity`` seconds::

    tick ─► live_figures(m) ─► sample(previous, current, dt) ─► ring[m] (300 samples)
                                                                   │
    GET /dashboard/series ◄──────────── series(): columns per model ┘

``GET /dashboard`` is the page (static/dashboard.html) drawing the columns with uPlot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from carpool.server.dashboard_samples import Sample, sample
from carpool.server.live import live_figures
from carpool.server.repository import ModelRepository

INTERVAL_S = 1.0
CAPACITY = 300  # five minutes at one sample a second
# The files GET /dashboard/{name} serves, and their content types.
STATIC_FILES = {
    "dashboard.html": b"text/html; charset=utf-8",
    "dashboard.js": b"text/javascript; charset=utf-8",
    "uPlot.iife.min.js": b"text/javascript; charset=utf-8",
    "uPlot.min.css": b"text/css; charset=utf-8",
}
logger = logging.getLogger("carpool.server.dashboard")


@dataclass(frozen=True, slots=True)
class Chart:
    """One chart of a model's panel: its title, and the series it draws, each a key of
    :data:`Sample` (those starting with the prefix ``*`` stand for every key so prefixed)."""

    title: str
    series: tuple[str, ...]


BATCH_CHARTS = (
    Chart("requests/s", ("requests_per_s",)),
    Chart("batch size (mean of the second)", ("mean_batch_size", "max_batch_size")),
    Chart("fill and compute ratios", ("fill_ratio", "effective_compute_ratio")),
    Chart("latency p50/p99 per class (s)", ("p50_s:*", "p99_s:*")),
    Chart("queue depth per class", ("queue:*",)),
    Chart("rejections/s", ("rejections_per_s",)),
    Chart("replica busy fraction", ("busy:*", "balance")),
    Chart("slowest request: where its time went (s)",
          ("slow_queue_s", "slow_fill_s", "slow_compute_s", "slow_answer_s")),
    # A chart per unit: seconds and items (or bytes and a fraction) on one axis flatten one.
    Chart("adaptive controller: delay (s)", ("adaptive_delay_s",)),
    Chart("adaptive controller: batch size", ("adaptive_batch_size",)),
    Chart("memory peak (bytes)", ("memory_peak_bytes",)),
    Chart("memory volatility", ("memory_volatility",)),
)  # fmt: skip
GENERATION_CHARTS = (
    Chart("requests/s", ("requests_per_s",)),
    Chart("sequences", ("running", "waiting")),
    Chart("batch size (sequences per step, mean of the second)", ("mean_batch_size",)),
    Chart("KV cache in use and prefix-cache hit rate", ("kv_cache_usage", "prefix_hit_rate")),
    Chart("TTFT and ITL p50/p99 (s)", ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")),
    Chart("tokens/s", ("tokens_per_s",)),
)


@dataclass(slots=True)
class ModelRing:
    """The last ``capacity`` samples of one model, with their wall times (Unix seconds)."""

    kind: str
    capacity: int = CAPACITY
    times_s: deque[float] = field(init=False)
    samples: deque[Sample] = field(init=False)

    def __post_init__(self) -> None:
        self.times_s = deque(maxlen=self.capacity)
        self.samples = deque(maxlen=self.capacity)

    def append(self, time_s: float, values: Sample) -> None:
        self.times_s.append(time_s)
        self.samples.append(values)

    def columns(self) -> dict[str, Any]:
        """The ring as uPlot takes it: the times, then one column per series that has a
        value (None where a sample lacks it), and the charts that draw them."""
        # Only series with a value: no empty chart for a figure the model has not had yet.
        names = sorted({name for s in self.samples for name, v in s.items() if v is not None})
        charts = GENERATION_CHARTS if self.kind == "generation" else BATCH_CHARTS
        return {
            "kind": self.kind,
            "t": list(self.times_s),
            "series": {name: [s.get(name) for s in self.samples] for name in names},
            "charts": [{"title": c.title, "series": _expand(c.series, names)} for c in charts],
        }


def _expand(patterns: Iterable[str], names: list[str]) -> list[str]:
    out: list[str] = []
    for pattern in patterns:
        if pattern.endswith("*"):
            out += [n for n in names if n.startswith(pattern[:-1])]
        elif pattern in names:
            out.append(pattern)
    return out


class Dashboard:
    """Every model's ring, filled by :meth:`tick` (each ``interval_s`` under :meth:`run`)."""

    def __init__(
        self,
        repository: ModelRepository,
        *,
        capacity: int = CAPACITY,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._repository = repository
        self._capacity = capacity
        self.interval_s = interval_s
        self._clock = clock
        self._rings: dict[str, ModelRing] = {}
        self._last: dict[str, tuple[float, dict[str, Any]]] = {}

    def tick(self) -> None:
        """Sample every model once."""
        now_s = self._clock()
        for model in self._repository:
            document = live_figures(model)
            previous = self._last.get(model.name)
            before, dt_s = (None, 0.0) if previous is None else (previous[1], now_s - previous[0])
            ring = self._rings.get(model.name)
            if ring is None:
                ring = self._rings[model.name] = ModelRing(document["kind"], self._capacity)
            ring.append(now_s, sample(document, before, dt_s))
            self._last[model.name] = (now_s, document)

    def series(self) -> dict[str, Any]:
        """``GET /dashboard/series``: the sampling interval and each model's columns."""
        return {
            "interval_s": self.interval_s,
            "capacity": self._capacity,
            "models": {name: ring.columns() for name, ring in self._rings.items()},
        }

    async def run(self) -> None:
        """Tick each ``interval_s`` until cancelled; a tick that fails is logged, not fatal."""
        while True:
            try:
                self.tick()
            except Exception:
                logger.exception("dashboard sample failed")
            await asyncio.sleep(self.interval_s)


def static_file(name: str) -> tuple[bytes, bytes] | None:
    """The packaged file ``name`` and its content type; None for any other name."""
    content_type = STATIC_FILES.get(name)
    if content_type is None:
        return None
    data = resources.files("carpool.server").joinpath("static", name).read_bytes()
    return data, content_type
