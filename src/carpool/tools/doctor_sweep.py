"""The doctor's sweep (part 1): latency, throughput and memory per batch size, and verdicts.

:func:`measure_sweep` times a batched callable at each batch size with an injected clock and
memory probe; :func:`find_knee` and :func:`max_batch_under_budget` are pure functions of the
numbers, so they are tested on synthetic timings.
"""

from __future__ import annotations

import gc
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from carpool.errors import ModelError
from carpool.tools.doctor_checks import Array, BatchCall, Clock

_MIB = 1024 * 1024


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch``, plus ``max_batch`` itself."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if (1 << i) <= max_batch]
    return sorted({*sizes, max_batch})


# -- memory --------------------------------------------------------------


class MemoryProbe(Protocol):
    """Peak memory above a baseline, over a window opened by ``start``."""

    def start(self) -> None: ...

    def stop(self) -> int: ...


def _proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs``); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class RssProbe:
    """Peak RSS growth over the RSS at construction: VmHWM reset per window, else sampled."""

    def __init__(self, interval_s: float = 0.001) -> None:
        # Garbage from before must not be freed inside a window: a collection there can
        # hand back more than the window allocates and hide its growth.
        gc.collect()
        self.baseline_bytes = _proc_status_bytes("VmRSS") or _max_rss_bytes()
        self._interval_s = interval_s
        self._peak_bytes = 0
        self._is_reset = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        gc.collect()
        self._is_reset = _reset_peak_rss() and _proc_status_bytes("VmHWM") is not None
        self._peak_bytes = _proc_status_bytes("VmRSS") or _max_rss_bytes()
        if not self._is_reset:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            rss = _proc_status_bytes("VmRSS") or _max_rss_bytes()
            self._peak_bytes = max(self._peak_bytes, rss)

    def stop(self) -> int:
        if self._is_reset:
            self._peak_bytes = max(self._peak_bytes, _proc_status_bytes("VmHWM") or 0)
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
        # What is resident now counts too: a sampling thread that was not scheduled during
        # a short window (a busy machine) would otherwise report no growth at all.
        now = _proc_status_bytes("VmRSS") or _max_rss_bytes()
        self._peak_bytes = max(self._peak_bytes, now)
        return max(0, self._peak_bytes - self.baseline_bytes)


def _max_rss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class CudaProbe:
    """Peak CUDA memory allocated above what was allocated at construction."""

    def __init__(self, device: str) -> None:
        import torch

        self._cuda = torch.cuda
        self._device = device
        self.baseline_bytes = int(self._cuda.memory_allocated(device))

    def start(self) -> None:
        self._cuda.synchronize(self._device)
        self._cuda.reset_peak_memory_stats(self._device)

    def stop(self) -> int:
        self._cuda.synchronize(self._device)
        return max(0, int(self._cuda.max_memory_allocated(self._device)) - self.baseline_bytes)


@dataclass(frozen=True, slots=True)
class BatchTiming:
    """One batch size's numbers; ``memory_bytes`` is peak growth over the loaded model.

    A batch size the model raised on has ``error`` set and NaN timings.
    """

    batch_size: int
    median_s: float
    p90_s: float
    mean_s: float
    items_per_s: float
    num_calls: int
    memory_bytes: int | None
    error: str | None = None

    @classmethod
    def failed(cls, batch_size: int, error: BaseException) -> BatchTiming:
        nan = math.nan
        reason = f"{type(error).__name__}: {error}"
        return cls(batch_size, nan, nan, nan, nan, 0, None, reason)


def summarize(
    batch_size: int, latencies_s: Sequence[float], memory_bytes: int | None
) -> BatchTiming:
    """The timing of ``batch_size`` from its per-call latencies."""
    values = np.asarray(latencies_s, dtype=np.float64)
    median = float(np.median(values))
    return BatchTiming(
        batch_size=batch_size,
        median_s=median,
        p90_s=float(np.percentile(values, 90)),
        mean_s=float(values.mean()),
        items_per_s=batch_size / median if median > 0 else math.inf,
        num_calls=len(values),
        memory_bytes=memory_bytes,
    )


def measure_sweep(
    call: BatchCall,
    make_batch: Callable[[int], Array],
    sizes: Sequence[int],
    *,
    repeats: int,
    warmup: int,
    clock: Clock = time.perf_counter,
    memory: MemoryProbe | None = None,
) -> list[BatchTiming]:
    """Time ``call`` on a batch of each size: ``warmup`` untimed calls, then ``repeats``.

    A size the model raises on is recorded (:meth:`BatchTiming.failed`) and the sweep goes on:
    a BatchNorm in training mode fails on 1 item, a model out of memory on the largest batch.

    Raises:
        ModelError: when the model raises on every size; the first error is chained.
    """
    timings: list[BatchTiming] = []
    first_error: Exception | None = None
    for size in sizes:
        batch = make_batch(size)
        latencies: list[float] = []
        is_measuring = False
        try:
            for _ in range(warmup):
                call(batch)
            if memory is not None:
                memory.start()
                is_measuring = True
            for _ in range(repeats):
                start = clock()
                call(batch)
                latencies.append(clock() - start)
        except Exception as error:
            if memory is not None and is_measuring:
                memory.stop()
            first_error = first_error or error
            timings.append(BatchTiming.failed(size, error))
            continue
        memory_bytes = memory.stop() if memory is not None else None
        timings.append(summarize(size, latencies, memory_bytes))
    if first_error is not None and all(t.error is not None for t in timings):
        raise ModelError(
            f"the model raised on every batch size ({', '.join(map(str, sizes))}): "
            f"{type(first_error).__name__}: {first_error}"
        ) from first_error
    return timings


@dataclass(frozen=True, slots=True)
class KneeVerdict:
    """``knee_batch_size``: the smallest size after which growing the batch stops paying."""

    knee_batch_size: int | None
    min_gain: float
    gains: list[tuple[int, int, float]]  # (from size, to size, throughput ratio)
    reason: str


def find_knee(points: Sequence[tuple[int, float]], min_gain: float = 1.3) -> KneeVerdict:
    """The knee of ``(batch size, items/s)`` points.

    The knee is the smallest size ``b`` such that every step up from ``b`` gains less than
    ``min_gain`` per doubling (a step of ratio ``r`` must gain ``min_gain ** log2(r)``).
    ``None`` when throughput still scales at the largest step.
    """
    ordered = sorted(points)
    gains: list[tuple[int, int, float]] = []
    is_flat: list[bool] = []
    for (b1, t1), (b2, t2) in itertools.pairwise(ordered):
        gain = t2 / t1 if t1 > 0 else math.inf
        gains.append((b1, b2, gain))
        is_flat.append(gain < min_gain ** math.log2(b2 / b1))
    knee: int | None = None
    for i in range(len(is_flat) - 1, -1, -1):
        if not is_flat[i]:
            break
        knee = gains[i][0]
    if len(ordered) < 2:  # no step to judge: not evidence that throughput still grows
        measured = (
            f"only one batch size measured ({ordered[0][0]})"
            if ordered
            else "no batch size measured"
        )
        reason = f"{measured}: no step to find a knee on; sweep several sizes (--max-batch above 1)"
    elif knee is None:
        largest = ordered[-1][0]
        reason = (
            f"throughput still grows by >= {min_gain:g}x per doubling up to batch {largest}: "
            "no knee yet; try a larger --max-batch"
        )
    else:
        after = ", ".join(f"{a}->{b}: {g:.2f}x" for a, b, g in gains if a >= knee)
        reason = f"past batch {knee} each doubling gains < {min_gain:g}x ({after})"
    return KneeVerdict(knee, min_gain, gains, reason)


@dataclass(frozen=True, slots=True)
class MemoryVerdict:
    """The largest batch whose peak memory growth fits ``budget_bytes``, and how it was found."""

    budget_bytes: int | None
    max_batch_size: int | None
    method: str  # measured | interpolated | extrapolated | unbounded | none
    slope_bytes_per_item: float
    intercept_bytes: float
    reason: str


def fit_memory(points: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """``(slope bytes/item, intercept bytes)`` of a line through the three largest batches."""
    top = sorted(points)[-3:]
    if len(top) < 2:
        return 0.0, float(top[0][1]) if top else 0.0
    sizes = np.array([b for b, _ in top], dtype=np.float64)
    mems = np.array([m for _, m in top], dtype=np.float64)
    slope, intercept = np.polyfit(sizes, mems, 1)
    return float(slope), float(intercept)


def max_batch_under_budget(points: Sequence[tuple[int, int]], budget_bytes: int) -> MemoryVerdict:
    """The largest batch size whose memory (``(size, bytes)`` points) fits ``budget_bytes``.

    Measured when a measured size overflows (interpolated between the bracketing sizes),
    else extrapolated along :func:`fit_memory`; ``unbounded`` when memory does not grow.
    """
    ordered = sorted(points)
    slope, intercept = fit_memory(ordered)
    budget_mib = budget_bytes / _MIB

    def verdict(size: int | None, method: str, reason: str) -> MemoryVerdict:
        return MemoryVerdict(budget_bytes, size, method, slope, intercept, reason)

    if not ordered:
        return verdict(None, "none", "no memory measurements")
    over = [i for i, (_, m) in enumerate(ordered) if m > budget_bytes]
    if over:
        i = over[0]
        b2, m2 = ordered[i]
        if i == 0:
            return verdict(
                None,
                "none",
                f"batch {b2} already grows memory by {m2 / _MIB:.1f} MiB "
                f"> budget {budget_mib:.1f} MiB",
            )
        b1, m1 = ordered[i - 1]
        size = b1 + int((budget_bytes - m1) * (b2 - b1) / (m2 - m1)) if m2 > m1 else b1
        method = "measured" if size == b1 else "interpolated"
        return verdict(
            size,
            method,
            f"batch {b2} grows memory by {m2 / _MIB:.1f} MiB > budget "
            f"{budget_mib:.1f} MiB; batch {b1} fits ({m1 / _MIB:.1f} MiB)",
        )
    largest = ordered[-1][0]
    if slope * largest < 1024:  # under 1 KiB over the whole sweep: noise, not growth
        return verdict(
            None,
            "unbounded",
            f"memory did not grow with batch size up to {largest}; "
            f"the budget of {budget_mib:.1f} MiB does not limit the batch",
        )
    size = max(largest, math.floor((budget_bytes - intercept) / slope + 1e-9))
    return verdict(
        size,
        "extrapolated",
        f"{slope / 1024:.1f} KiB per item (+{intercept / _MIB:.1f} MiB) "
        f"reaches {budget_mib:.1f} MiB at batch {size}",
    )
