"""A run's records summed up: throughput, latency percentiles, errors, and how late it sent.

Latency counts from each request's *scheduled* send time (see :mod:`.loadgen`), over the
requests that succeeded; failed ones are counted by status (``"503"``) or, without an
HTTP status, by error name (``"timeout"``, ``"ConnectionResetError"``, ``"QueueFull"``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from carpool.tools.loadgen import BEHIND_SCHEDULE_S, Mode, RequestRecord, RunResult

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Mean, p50/p90/p99/p99.9 and max of some durations, in seconds."""

    count: int
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    p999_s: float
    max_s: float

    @classmethod
    def of(cls, values_s: list[float]) -> Percentiles | None:
        """None for no values."""
        if not values_s:
            return None
        array = np.asarray(values_s, dtype=np.float64)
        p50, p90, p99, p999 = (float(v) for v in np.percentile(array, PERCENTILES))
        return cls(len(values_s), float(array.mean()), p50, p90, p99, p999, float(array.max()))


@dataclass(frozen=True, slots=True)
class Summary:
    """What one run (one concurrency or one rate) came to."""

    mode: str
    concurrency: int | None
    offered_rate_rps: float | None  # open loop: scheduled requests / scheduled time
    elapsed_s: float  # first scheduled send to last answer
    num_requests: int
    num_ok: int
    num_errors: int
    errors: dict[str, int]
    rate_rps: float  # successful requests per second
    items_per_s: float
    tokens_per_s: float
    latency: Percentiles | None
    ttft: Percentiles | None
    itl: Percentiles | None
    num_behind_schedule: int  # sends that started more than BEHIND_SCHEDULE_S late
    max_lag_s: float

    @property
    def behind_schedule_ratio(self) -> float:
        return self.num_behind_schedule / self.num_requests if self.num_requests else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["behind_schedule_ratio"] = self.behind_schedule_ratio
        return out


def error_key(record: RequestRecord) -> str:
    """How a failed request is counted: its HTTP status, else its error's name."""
    if record.status and not 200 <= record.status < 300:
        return str(record.status)
    return (record.error or "unknown").split(":", 1)[0]


def summarize(result: RunResult) -> Summary:
    """Sum up ``result``; an empty run gives zero rates and no percentiles."""
    records = result.records
    ok = [r for r in records if r.error is None]
    errors: dict[str, int] = {}
    for record in records:
        if record.error is not None:
            key = error_key(record)
            errors[key] = errors.get(key, 0) + 1
    finished = [r.done_s for r in records if not math.isnan(r.done_s)]
    elapsed_s = max(finished) - result.started_s if finished else 0.0
    if result.mode is Mode.OPEN and finished:
        # Open loop: the rate is over the whole sending window, as the offered rate is;
        # the last answer can come before its end (no arrival in the last gap).
        elapsed_s = max(elapsed_s, result.duration_s)
    per_s = 1.0 / elapsed_s if elapsed_s > 0 else 0.0
    lags = [r.lag_s for r in records if not math.isnan(r.sent_s)]
    ttfts = [t for r in ok if (t := r.ttft_s) is not None]
    itls = [gap for r in ok if r.itl_s for gap in r.itl_s]
    return Summary(
        mode=result.mode.value,
        concurrency=result.concurrency,
        offered_rate_rps=result.offered_rate_rps,
        elapsed_s=elapsed_s,
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        errors=dict(sorted(errors.items())),
        rate_rps=len(ok) * per_s,
        items_per_s=sum(r.num_items for r in ok) * per_s,
        tokens_per_s=sum(r.num_tokens for r in ok) * per_s,
        latency=Percentiles.of([r.latency_s for r in ok]),
        ttft=Percentiles.of(ttfts),
        itl=Percentiles.of(itls),
        num_behind_schedule=sum(1 for lag in lags if lag > BEHIND_SCHEDULE_S),
        max_lag_s=max(lags, default=0.0),
    )
