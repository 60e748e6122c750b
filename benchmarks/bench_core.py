"""Core batcher benchmarks (issue: carpool core).

Measures, in one process and one run:

1. offline ceiling: the W1 MLP in a tight loop at batch 1..128 (items/s);
2. W1 through ``carpool.Batcher`` at saturation (256 closed-loop submitters) against the
   offline ceiling at batch 64, measured interleaved in the same run (target >= 0.95);
3. carpool's own cost per request with no-op models (target <= 10 µs, >= 100k req/s),
   and what telemetry adds to it;
4. latency of one request at a time (target: p50 <= batch-1 model time + max_delay_s
   + 0.5 ms);
5. what batching bought: W1 at the same saturation with max_batch_size 1 vs 64.

Every ratio is against a baseline measured in the same run; every figure is the median
of repeated timed windows taken after a warm-up.

    .venv/bin/python benchmarks/bench_core.py            # full run, a few minutes
    .venv/bin/python benchmarks/bench_core.py --quick    # smoke run, < 60 s
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import carpool
from carpool import Batcher, BatchPolicy
from carpool.models.mlp import W1_INPUT_DIM, W1Runner

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "core.json"

SEED = 0
OFFLINE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
BATCH = 64
SUBMITTERS = 256
SAT_DELAY_S = 0.002  # max_delay_s of the saturation runs (batches fill long before it)
LAT_DELAY_S = 0.002  # max_delay_s of the one-at-a-time latency run
LAT_SLACK_S = 0.0005

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

TARGET_RATIO = 0.95
TARGET_OVERHEAD_US = 10.0

Submit = Callable[[Any], Awaitable[Any]]


@dataclass(frozen=True)
class Settings:
    repeats: int
    offline_window_s: float  # per batch size in the sweep
    sat_window_s: float  # W1 offline-64 and batcher windows of benchmark 2
    sat_warmup_s: float
    nobatch_window_s: float  # W1 with max_batch_size=1
    nobatch_warmup_s: float
    overhead_window_s: float
    overhead_warmup_s: float
    latency_requests: int  # sequential requests per repeat
    b1_calls: int  # batch-1 model calls per repeat (latency baseline)


FULL = Settings(
    repeats=5,
    offline_window_s=0.5,
    sat_window_s=2.5,
    sat_warmup_s=0.5,
    nobatch_window_s=2.0,
    nobatch_warmup_s=1.0,
    overhead_window_s=1.0,
    overhead_warmup_s=0.2,
    latency_requests=300,
    b1_calls=150,
)
QUICK = Settings(
    repeats=2,
    offline_window_s=0.2,
    sat_window_s=1.0,
    sat_warmup_s=0.3,
    nobatch_window_s=1.0,
    nobatch_warmup_s=0.8,
    overhead_window_s=0.4,
    overhead_warmup_s=0.1,
    latency_requests=100,
    b1_calls=50,
)


# -- helpers ----------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (same rule as carpool's telemetry)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def source_revision() -> dict[str, Any]:
    """The git commit measured, and whether src/ differed from it."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    dirty = git("status", "--porcelain", "--", "src")
    return {"commit": git("rev-parse", "HEAD"), "src_modified": dirty.splitlines() if dirty else []}


def machine_info() -> dict[str, Any]:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count() or 0
    return {
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "load_avg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
        "python_impl": platform.python_implementation(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
        "numpy": np.__version__,
        "carpool": carpool.__version__,
        "event_loop": "asyncio default (" + type(asyncio.new_event_loop()).__name__ + ")",
    }


def fresh() -> None:
    gc.collect()


class LoadMeter:
    """CPU that other processes (and the hypervisor, as steal) took while we measured,
    in cores, from /proc/stat minus this process's own CPU time. 0.0 means we had the
    machine to ourselves; on 2 cores, 1.0 means another process held a whole core."""

    def __init__(self) -> None:
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._start = self._read()

    def _read(self) -> tuple[float, float, float, float] | None:
        try:
            with open("/proc/stat", encoding="utf-8") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal ...
        busy = sum(fields[i] for i in (0, 1, 2, 5, 6) if i < len(fields))
        steal = fields[7] if len(fields) > 7 else 0
        own = os.times()
        return busy / self._tick, steal / self._tick, own.user + own.system, time.monotonic()

    def stop(self) -> dict[str, float]:
        end = self._read()
        if self._start is None or end is None:
            return {}
        wall = end[3] - self._start[3]
        if wall <= 0:
            return {}
        own = end[2] - self._start[2]
        others = (end[0] - self._start[0]) - own
        return {
            "others_cores": round(max(0.0, others) / wall, 3),
            "steal_cores": round((end[1] - self._start[1]) / wall, 3),
            "own_cores": round(own / wall, 3),
        }


def offline_window(runner: W1Runner, x: np.ndarray, window_s: float, min_calls: int = 3) -> float:
    """Items/s of ``runner(x)`` in a tight loop for at least ``window_s``."""
    calls = 0
    start = time.perf_counter()
    while True:
        runner(x)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= window_s and calls >= min_calls:
            return calls * x.shape[0] / elapsed


@dataclass
class Window:
    requests: int
    wall_s: float
    cpu_s: float
    latencies_s: list[float]

    @property
    def rate(self) -> float:
        return self.requests / self.wall_s

    @property
    def us_per_request(self) -> float:
        return self.wall_s / self.requests * 1e6

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_s / self.requests * 1e6


async def closed_loop(
    submit: Submit,
    payloads: list[Any],
    warmup_s: float,
    window_s: float,
    record_latency: bool = False,
) -> Window:
    """``len(payloads)`` tasks, each submitting its payload again as soon as it returns.

    Counts the requests answered inside the timed window (after ``warmup_s``); with
    ``record_latency`` also keeps each of those requests' submit-to-answer time.
    """
    stop = False
    measuring = False
    done = 0
    latencies: list[float] = []
    perf = time.perf_counter

    async def worker(payload: Any) -> None:
        nonlocal done
        while not stop:
            if record_latency:
                t0 = perf()
                await submit(payload)
                if measuring:
                    latencies.append(perf() - t0)
            else:
                await submit(payload)
            done += 1

    tasks = [asyncio.create_task(worker(p)) for p in payloads]
    try:
        await asyncio.sleep(warmup_s)
        measuring = True
        c0, t0, p0 = done, perf(), time.process_time()
        await asyncio.sleep(window_s)
        c1, t1, p1 = done, perf(), time.process_time()
        measuring = False
    finally:
        stop = True
        await asyncio.gather(*tasks)
    return Window(c1 - c0, t1 - t0, p1 - p0, latencies)


def batch_stats(b: Batcher) -> dict[str, float]:
    snap = b.snapshot()
    s = snap.batches
    return {
        "num_batches": s.num_batches,
        "num_items": s.num_items,
        "mean_batch_size": s.mean_batch_size,
        "fill_ratio": s.fill_ratio,
        # a batch's span inside carpool: closed -> outputs handed back (model included)
        "batch_span_ms_p50": s.compute.p50_s * 1e3,
        "busy_fraction": snap.replicas[0].busy_fraction if snap.replicas else math.nan,
    }


class QuietGate:
    """Before each repeat, wait (a bounded time) until other processes and the hypervisor
    (steal) leave the CPUs alone, so that a repeat does not start on a contended machine. What it
    waited and found is recorded; it never discards a measurement."""

    THRESHOLD_CORES = 0.25
    SAMPLE_S = 0.5

    def __init__(self, max_wait_s: float, total_budget_s: float) -> None:
        self.max_wait_s = max_wait_s
        self.budget_s = total_budget_s
        self.waited_s = 0.0
        self.gave_up = 0

    def wait(self) -> dict[str, float]:
        if self.max_wait_s <= 0:
            return {}
        start = time.monotonic()
        sample: dict[str, float] = {}
        while True:
            meter = LoadMeter()
            time.sleep(self.SAMPLE_S)
            sample = meter.stop()
            spent = time.monotonic() - start
            taken = sample.get("others_cores", 0.0) + sample.get("steal_cores", 0.0)
            if taken < self.THRESHOLD_CORES:
                break
            if spent >= self.max_wait_s or self.waited_s + spent >= self.budget_s:
                self.gave_up += 1
                break
        spent = time.monotonic() - start
        self.waited_s += spent
        return {
            "waited_s": round(spent, 2),
            "others_cores_before": sample.get("others_cores"),
            "steal_cores_before": sample.get("steal_cores"),
        }


GATE = QuietGate(0.0, 0.0)


def _taken(load: dict[str, Any]) -> float:
    """Cores that others (processes, hypervisor steal) took during a measurement."""
    return load.get("others_cores", math.nan) + load.get("steal_cores", 0.0)


# -- 0. is W1 single-threaded on a non-main thread too? ---------------------------------


def _w1_calls(runner: W1Runner, x: np.ndarray, calls: int) -> dict[str, float]:
    wall, cpu = [], []
    for _ in range(calls):
        t0, c0 = time.perf_counter(), time.process_time()
        runner(x)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"wall_ms": median(wall) * 1e3, "process_cpu_ms": median(cpu) * 1e3}


def thread_check(runner: W1Runner, calls: int) -> dict[str, Any]:
    """W1 at batch 1 and 64 on the main thread and on a fresh thread (as a replica's
    executor thread is). torch.set_num_threads(1) was called on the main thread only;
    process CPU well above wall time means more than one thread worked on the call."""
    out: dict[str, Any] = {}
    for b in (1, BATCH):
        x = np.random.default_rng(SEED).standard_normal((b, W1_INPUT_DIM), dtype=np.float32)
        for _ in range(3):
            runner(x)
        main = _w1_calls(runner, x, calls)
        box: dict[str, dict[str, float]] = {}

        def worker(x: np.ndarray = x, box: dict[str, dict[str, float]] = box) -> None:
            for _ in range(3):
                runner(x)
            box["r"] = _w1_calls(runner, x, calls)

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        other = box["r"]
        out[str(b)] = {
            "main_thread": main,
            "fresh_thread": other,
            "fresh_thread_cpu_per_wall": other["process_cpu_ms"] / other["wall_ms"],
            "fresh_thread_wall_vs_main": other["wall_ms"] / main["wall_ms"],
        }
    worst = max(v["fresh_thread_cpu_per_wall"] for v in out.values())
    slow = max(v["fresh_thread_wall_vs_main"] for v in out.values())
    out["single_threaded_everywhere"] = worst < 1.3 and slow < 1.3
    return out


# -- 1. offline ceiling -----------------------------------------------------------------


def bench_offline(runner: W1Runner, cfg: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    rng = np.random.default_rng(SEED)
    inputs = {b: rng.standard_normal((b, W1_INPUT_DIM), dtype=np.float32) for b in OFFLINE_SIZES}
    for b in OFFLINE_SIZES:  # warm-up: every shape once, a few calls
        for _ in range(3):
            runner(inputs[b])
    runs: dict[int, list[float]] = {b: [] for b in OFFLINE_SIZES}
    for _ in range(cfg.repeats):  # sizes interleaved within each repeat
        GATE.wait()
        for b in OFFLINE_SIZES:
            fresh()
            runs[b].append(offline_window(runner, inputs[b], cfg.offline_window_s))
    out = {}
    for b in OFFLINE_SIZES:
        med = median(runs[b])
        out[str(b)] = {
            "items_per_s_median": med,
            "ms_per_batch_median": b / med * 1e3,
            "items_per_s_runs": runs[b],
        }
        log(f"  offline batch {b:>3}: {med:8.0f} items/s  ({b / med * 1e3:7.2f} ms/batch)")
    return out


# -- 2 + 5. W1 through the batcher at saturation ----------------------------------------


async def w1_batcher_run(
    runner: W1Runner,
    payloads: list[np.ndarray],
    max_batch_size: int,
    warmup_s: float,
    window_s: float,
) -> tuple[Window, dict[str, float]]:
    """One batcher's life at saturation; batch stats are its snapshot() at the end
    (the whole run, warm-up included)."""
    policy = BatchPolicy(max_batch_size=max_batch_size, max_delay_s=SAT_DELAY_S)
    async with Batcher(runner, policy, name="w1", collate="numpy") as batcher:
        win = await closed_loop(batcher.submit, payloads, warmup_s, window_s, record_latency=True)
        stats = batch_stats(batcher)
    return win, stats


async def bench_saturation(
    runner: W1Runner, cfg: Settings, log: Callable[[str], None]
) -> tuple[dict[str, Any], dict[str, Any]]:
    rng = np.random.default_rng(SEED + 1)
    payloads = [rng.standard_normal(W1_INPUT_DIM, dtype=np.float32) for _ in range(SUBMITTERS)]
    x64 = rng.standard_normal((BATCH, W1_INPUT_DIM), dtype=np.float32)
    for _ in range(3):
        runner(x64)
    # one untimed batcher run so the first timed one does not pay for thread start-up
    await w1_batcher_run(runner, payloads, BATCH, 0.1, 0.2)

    offline, batched, ratios, stats, lat64 = [], [], [], [], []
    nobatch, lat1, stats1 = [], [], []
    loads: list[dict[str, Any]] = []
    for i in range(cfg.repeats):
        order = ("offline", "batcher") if i % 2 == 0 else ("batcher", "offline")
        off = bat = math.nan
        load: dict[str, Any] = {"gate": GATE.wait()}
        for what in order:
            fresh()
            meter = LoadMeter()
            if what == "offline":
                off = offline_window(runner, x64, cfg.sat_window_s)
            else:
                win, st = await w1_batcher_run(
                    runner, payloads, BATCH, cfg.sat_warmup_s, cfg.sat_window_s
                )
                bat = win.rate
                stats.append(st)
                lat64.append(win.latencies_s)
            load[what] = meter.stop()
        loads.append(load)
        offline.append(off)
        batched.append(bat)
        ratios.append(bat / off)
        fresh()
        win1, st1 = await w1_batcher_run(
            runner, payloads, 1, cfg.nobatch_warmup_s, cfg.nobatch_window_s
        )
        nobatch.append(win1.rate)
        lat1.append(win1.latencies_s)
        stats1.append(st1)
        log(
            f"  repeat {i + 1}/{cfg.repeats} ({order[0]} first): offline@64 {off:7.0f} items/s,"
            f" batcher {bat:7.0f} items/s, ratio {bat / off:.3f}, mean batch "
            f"{stats[-1]['mean_batch_size']:.1f}, batch span p50 "
            f"{stats[-1]['batch_span_ms_p50']:.2f} ms vs offline {BATCH / off * 1e3:.2f} ms; "
            f"max_batch_size=1: {win1.rate:6.0f} items/s; other processes + steal "
            f"{_taken(load['offline']):.2f} / {_taken(load['batcher']):.2f} cores"
        )

    ratio = median(ratios)
    sat = {
        "submitters": SUBMITTERS,
        "max_batch_size": BATCH,
        "max_delay_s": SAT_DELAY_S,
        "window_s": cfg.sat_window_s,
        "warmup_s": cfg.sat_warmup_s,
        "offline_items_per_s_runs": offline,
        "batcher_items_per_s_runs": batched,
        "ratio_runs": ratios,
        "offline_items_per_s_median": median(offline),
        "batcher_items_per_s_median": median(batched),
        "ratio_median": ratio,
        "ratio_min": min(ratios),
        "target_ratio": TARGET_RATIO,
        "pass": ratio >= TARGET_RATIO,
        "mean_batch_size_runs": [s["mean_batch_size"] for s in stats],
        "fill_ratio_runs": [s["fill_ratio"] for s in stats],
        "mean_batch_size_median": median([s["mean_batch_size"] for s in stats]),
        "fill_ratio_median": median([s["fill_ratio"] for s in stats]),
        "batch_span_ms_p50_runs": [s["batch_span_ms_p50"] for s in stats],
        "offline_ms_per_batch64_runs": [BATCH / o * 1e3 for o in offline],
        "replica_busy_fraction_runs": [s["busy_fraction"] for s in stats],
        "load_runs": loads,
        "snapshot_scope": "whole batcher run, warm-up included",
    }
    all64 = [v for run in lat64 for v in run]
    all1 = [v for run in lat1 for v in run]
    bought = {
        "submitters": SUBMITTERS,
        "max_delay_s": SAT_DELAY_S,
        "batch64": {
            "items_per_s_median": median(batched),
            "p50_ms": quantile(all64, 0.5) * 1e3,
            "p99_ms": quantile(all64, 0.99) * 1e3,
            "p50_ms_runs": [quantile(r, 0.5) * 1e3 for r in lat64],
            "num_latencies": len(all64),
        },
        "batch1": {
            "items_per_s_median": median(nobatch),
            "items_per_s_runs": nobatch,
            "p50_ms": quantile(all1, 0.5) * 1e3,
            "p99_ms": quantile(all1, 0.99) * 1e3,
            "p50_ms_runs": [quantile(r, 0.5) * 1e3 for r in lat1],
            "num_latencies": len(all1),
            "mean_batch_size_median": median([s["mean_batch_size"] for s in stats1]),
        },
        "throughput_ratio_runs": [b / n for b, n in zip(batched, nobatch, strict=True)],
        "throughput_ratio_median": median([b / n for b, n in zip(batched, nobatch, strict=True)]),
    }
    return sat, bought


# -- 3. overhead with no-op models --------------------------------------------------------


async def noop_async(batch: list[Any]) -> list[Any]:
    return batch


def noop_sync(batch: np.ndarray) -> np.ndarray:
    return batch


class _FloorBatcher:
    """Not carpool: the least asyncio work the same pattern needs (a future per request,
    one consumer task waking on arrivals, answering up to 64 at a time). Informational:
    the part of carpool's per-request time that the event loop itself costs."""

    def __init__(self) -> None:
        self.pending: list[tuple[Any, asyncio.Future[Any]]] = []
        self.waiter: asyncio.Future[None] | None = None
        self.stopped = False

    async def submit(self, payload: Any) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((payload, fut))
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)
        return await fut

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopped or self.pending:
            if not self.pending:
                self.waiter = loop.create_future()
                await self.waiter
                continue
            batch, self.pending = self.pending[:BATCH], self.pending[BATCH:]
            outs = await noop_async([p for p, _ in batch])
            for (_, fut), out in zip(batch, outs, strict=True):
                fut.set_result(out)


async def overhead_run(kind: str, payloads: list[Any], cfg: Settings) -> tuple[Window, dict]:
    policy = BatchPolicy(max_batch_size=BATCH, max_delay_s=0.005)
    if kind == "floor":
        floor = _FloorBatcher()
        consumer = asyncio.create_task(floor.run())
        win = await closed_loop(
            floor.submit, payloads, cfg.overhead_warmup_s, cfg.overhead_window_s
        )
        floor.stopped = True
        if floor.waiter is not None and not floor.waiter.done():
            floor.waiter.set_result(None)
        await consumer
        return win, {}
    fn, collate = (noop_async, "list") if kind.startswith("async") else (noop_sync, "numpy")
    telemetry = not kind.endswith("notel")
    batcher = Batcher(fn, policy, name=kind, collate=collate, telemetry=telemetry)
    async with batcher:
        win = await closed_loop(
            batcher.submit, payloads, cfg.overhead_warmup_s, cfg.overhead_window_s
        )
        st = batch_stats(batcher) if telemetry else {}
    return win, st


OVERHEAD_KINDS = ("async_list", "async_list_notel", "sync_numpy", "sync_numpy_notel", "floor")


async def bench_overhead(cfg: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    rng = np.random.default_rng(SEED + 2)
    payloads = [rng.standard_normal(W1_INPUT_DIM, dtype=np.float32) for _ in range(SUBMITTERS)]
    for kind in OVERHEAD_KINDS:  # warm-up
        await overhead_run(kind, payloads, QUICK)
    runs: dict[str, list[Window]] = {k: [] for k in OVERHEAD_KINDS}
    stats: dict[str, list[dict]] = {k: [] for k in OVERHEAD_KINDS}
    loads = []
    for i in range(cfg.repeats):
        kinds = OVERHEAD_KINDS if i % 2 == 0 else tuple(reversed(OVERHEAD_KINDS))
        gate = GATE.wait()
        meter = LoadMeter()
        for kind in kinds:
            fresh()
            win, st = await overhead_run(kind, payloads, cfg)
            runs[kind].append(win)
            stats[kind].append(st)
        loads.append({**meter.stop(), "gate": gate})
        log(
            f"  repeat {i + 1}/{cfg.repeats}: "
            + ", ".join(f"{k} {runs[k][-1].us_per_request:5.2f} µs" for k in OVERHEAD_KINDS)
            + f"; other processes + steal {_taken(loads[-1]):.2f} cores"
        )
    out: dict[str, Any] = {
        "submitters": SUBMITTERS,
        "max_batch_size": BATCH,
        "max_delay_s": 0.005,
        "window_s": cfg.overhead_window_s,
        "target_us_per_request": TARGET_OVERHEAD_US,
        "load_runs": loads,
    }
    for kind in OVERHEAD_KINDS:
        wins = runs[kind]
        entry = {
            "us_per_request_median": median([w.us_per_request for w in wins]),
            "requests_per_s_median": median([w.rate for w in wins]),
            "cpu_us_per_request_median": median([w.cpu_us_per_request for w in wins]),
            "us_per_request_runs": [w.us_per_request for w in wins],
            "requests_per_s_runs": [w.rate for w in wins],
            "cpu_us_per_request_runs": [w.cpu_us_per_request for w in wins],
        }
        if all(stats[kind]):
            entry["mean_batch_size_median"] = median([s["mean_batch_size"] for s in stats[kind]])
        if kind != "floor":
            entry["pass"] = entry["us_per_request_median"] <= TARGET_OVERHEAD_US
        out[kind] = entry
    for base in ("async_list", "sync_numpy"):
        diffs = [
            a.us_per_request - b.us_per_request
            for a, b in zip(runs[base], runs[base + "_notel"], strict=True)
        ]
        out[base + "_telemetry_cost_us"] = {"median": median(diffs), "runs": diffs}
    out["async_list_minus_floor_us"] = (
        out["async_list"]["us_per_request_median"] - out["floor"]["us_per_request_median"]
    )
    return out


# -- 4. one request at a time -----------------------------------------------------------


async def bench_latency(
    runner: W1Runner, cfg: Settings, log: Callable[[str], None]
) -> dict[str, Any]:
    rng = np.random.default_rng(SEED + 3)
    x1 = rng.standard_normal((1, W1_INPUT_DIM), dtype=np.float32)
    payloads = [rng.standard_normal(W1_INPUT_DIM, dtype=np.float32) for _ in range(32)]
    for _ in range(10):
        runner(x1)
    policy = BatchPolicy(max_batch_size=BATCH, max_delay_s=LAT_DELAY_S)
    b1_ms, p50s, p99s, bounds, lat_all, compute_p50 = [], [], [], [], [], []
    wait_ms, span_ms = [], []
    perf = time.perf_counter
    loads = []
    for i in range(cfg.repeats):
        fresh()
        gate = GATE.wait()
        meter = LoadMeter()
        times = []
        for _ in range(cfg.b1_calls):
            t0 = perf()
            runner(x1)
            times.append(perf() - t0)
        b1 = median(times)
        lats: list[float] = []
        traces: list[carpool.RequestTrace] = []
        async with Batcher(
            runner, policy, name="w1-seq", collate="numpy", on_trace=traces.append
        ) as batcher:
            for j in range(10):  # warm-up
                await batcher.submit(payloads[j % len(payloads)])
            traces.clear()
            for j in range(cfg.latency_requests):
                t0 = perf()
                await batcher.submit(payloads[j % len(payloads)])
                lats.append(perf() - t0)
            snap = batcher.snapshot()
        p50, p99 = quantile(lats, 0.5), quantile(lats, 0.99)
        bound = b1 + LAT_DELAY_S + LAT_SLACK_S
        b1_ms.append(b1 * 1e3)
        p50s.append(p50 * 1e3)
        p99s.append(p99 * 1e3)
        bounds.append(bound * 1e3)
        compute_p50.append(snap.batches.compute.p50_s * 1e3)
        wait_ms.append(median([t.wait_s for t in traces]) * 1e3)
        span_ms.append(median([t.compute_s for t in traces]) * 1e3)
        lat_all += lats
        loads.append({**meter.stop(), "gate": gate})
        log(
            f"  repeat {i + 1}/{cfg.repeats}: batch-1 model {b1 * 1e3:.3f} ms, p50 "
            f"{p50 * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms, bound {bound * 1e3:.3f} ms, "
            f"[arrival->batch closed {wait_ms[-1]:.3f} ms, batch span {span_ms[-1]:.3f} ms]"
            f"; other processes + steal {_taken(loads[-1]):.2f} cores"
        )
    p50 = median(p50s)
    bound = median(bounds)
    return {
        "max_batch_size": BATCH,
        "max_delay_s": LAT_DELAY_S,
        "slack_s": LAT_SLACK_S,
        "requests_per_repeat": cfg.latency_requests,
        "batch1_model_ms_runs": b1_ms,
        "batch1_model_ms_median": median(b1_ms),
        "p50_ms_runs": p50s,
        "p99_ms_runs": p99s,
        "bound_ms_runs": bounds,
        "in_batcher_compute_p50_ms_runs": compute_p50,
        "trace_wait_ms_median_runs": wait_ms,
        "trace_batch_span_ms_median_runs": span_ms,
        "load_runs": loads,
        "p50_ms_median": p50,
        "p99_ms_pooled": quantile(lat_all, 0.99) * 1e3,
        "p50_ms_pooled": quantile(lat_all, 0.5) * 1e3,
        "bound_ms_median": bound,
        # what carpool added on top of batch-1 model time + max_delay_s (the bound's slack
        # is 0.5 ms)
        "p50_minus_model_and_delay_ms_runs": [
            p - m - LAT_DELAY_S * 1e3 for p, m in zip(p50s, b1_ms, strict=True)
        ],
        "pass_runs": [p <= b for p, b in zip(p50s, bounds, strict=True)],
        "pass": p50 <= bound,
    }


# -- main -------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


async def main_async(cfg: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    runner = W1Runner(seed=SEED)
    results: dict[str, Any] = {}

    log("\n[0] W1 on the main thread vs a fresh thread (a replica runs on its own thread)")
    check = thread_check(runner, cfg.b1_calls // 3)
    for b in ("1", str(BATCH)):
        c = check[b]
        log(
            f"  batch {b:>2}: main {c['main_thread']['wall_ms']:.3f} ms wall / "
            f"{c['main_thread']['process_cpu_ms']:.3f} ms CPU; fresh thread "
            f"{c['fresh_thread']['wall_ms']:.3f} ms wall / "
            f"{c['fresh_thread']['process_cpu_ms']:.3f} ms CPU"
        )
    if not check["single_threaded_everywhere"]:
        log(
            "  WARN: W1 is not single-threaded (or is slower) off the main thread: "
            "torch.set_num_threads(1) did not reach the replica thread's OpenMP team. "
            "OMP_NUM_THREADS=1 in the environment makes it so."
        )
    results["thread_check"] = check

    log("\n[1] offline ceiling: W1 in a tight loop")
    t = time.perf_counter()
    results["offline_ceiling"] = bench_offline(runner, cfg, log)
    log(f"  ({time.perf_counter() - t:.0f} s)")

    log(f"\n[2+5] W1 through the batcher, {SUBMITTERS} closed-loop submitters (interleaved)")
    t = time.perf_counter()
    sat, bought = await bench_saturation(runner, cfg, log)
    results["batcher_vs_offline"] = sat
    results["batching_bought"] = bought
    log(f"  ({time.perf_counter() - t:.0f} s)")

    log(f"\n[3] overhead: no-op models at batch {BATCH}, {SUBMITTERS} closed-loop submitters")
    t = time.perf_counter()
    results["overhead"] = await bench_overhead(cfg, log)
    log(f"  ({time.perf_counter() - t:.0f} s)")

    log("\n[4] one request at a time: W1, max_delay_s=0.002")
    t = time.perf_counter()
    results["latency_single"] = await bench_latency(runner, cfg, log)
    log(f"  ({time.perf_counter() - t:.0f} s)")
    return results


def summarize(r: dict[str, Any]) -> list[dict[str, Any]]:
    sat, ov, lat, bought = (
        r["batcher_vs_offline"],
        r["overhead"],
        r["latency_single"],
        r["batching_bought"],
    )
    tc = r["thread_check"]["1"]
    rows: list[dict[str, Any]] = [
        {
            "name": "W1 batch 1 on a fresh thread: wall / CPU",
            "value": (
                f"{tc['fresh_thread']['wall_ms']:.2f} / {tc['fresh_thread']['process_cpu_ms']:.2f}"
                f" ms (main thread {tc['main_thread']['wall_ms']:.2f} / "
                f"{tc['main_thread']['process_cpu_ms']:.2f} ms)"
            ),
            "target": "info (CPU ~ wall: one thread)",
            "pass": None,
        },
        {
            "name": "offline ceiling, batch 64 (sweep)",
            "value": f"{r['offline_ceiling']['64']['items_per_s_median']:.0f} items/s",
            "target": "reference",
            "pass": None,
        },
        {
            "name": "W1 batcher / offline@64 throughput",
            "value": (
                f"{sat['ratio_median']:.3f} ({sat['batcher_items_per_s_median']:.0f} / "
                f"{sat['offline_items_per_s_median']:.0f} items/s; runs "
                + ", ".join(f"{x:.3f}" for x in sat["ratio_runs"])
                + ")"
            ),
            "target": f">= {TARGET_RATIO}",
            "pass": sat["pass"],
        },
        {
            "name": "W1 batcher mean batch size / fill ratio",
            "value": f"{sat['mean_batch_size_median']:.1f} / {sat['fill_ratio_median']:.3f}",
            "target": "info",
            "pass": None,
        },
        {
            "name": "W1 batch span in carpool vs offline, batch 64",
            "value": (
                f"{median(sat['batch_span_ms_p50_runs']):.2f} ms vs "
                f"{median(sat['offline_ms_per_batch64_runs']):.2f} ms"
            ),
            "target": "info",
            "pass": None,
        },
    ]
    for kind, label in (
        ("async_list", "overhead, async no-op, list collate"),
        ("sync_numpy", "overhead, sync no-op, numpy collate"),
    ):
        e = ov[kind]
        rows.append(
            {
                "name": label,
                "value": (
                    f"{e['us_per_request_median']:.2f} µs/req "
                    f"({e['requests_per_s_median']:.0f} req/s, "
                    f"CPU {e['cpu_us_per_request_median']:.2f} µs/req)"
                ),
                "target": f"<= {TARGET_OVERHEAD_US:g} µs/req",
                "pass": e["pass"],
            }
        )
        n = ov[kind + "_notel"]
        rows.append(
            {
                "name": label + ", telemetry=False",
                "value": (
                    f"{n['us_per_request_median']:.2f} µs/req "
                    f"({n['requests_per_s_median']:.0f} req/s)"
                ),
                "target": "info",
                "pass": None,
            }
        )
        rows.append(
            {
                "name": label + ": telemetry cost",
                "value": f"{ov[kind + '_telemetry_cost_us']['median']:+.2f} µs/req",
                "target": "info",
                "pass": None,
            }
        )
    rows.append(
        {
            "name": "asyncio floor (not carpool), same pattern",
            "value": (
                f"{ov['floor']['us_per_request_median']:.2f} µs/req "
                f"({ov['floor']['requests_per_s_median']:.0f} req/s)"
            ),
            "target": "info",
            "pass": None,
        }
    )
    rows.append(
        {
            "name": "one at a time: p50 / p99 latency",
            "value": (
                f"p50 {lat['p50_ms_median']:.3f} ms, p99 {lat['p99_ms_pooled']:.3f} ms "
                f"(bound {lat['bound_ms_median']:.3f} = batch-1 "
                f"{lat['batch1_model_ms_median']:.3f} + 2 + 0.5 ms)"
            ),
            "target": "p50 <= bound",
            "pass": lat["pass"],
        }
    )
    rows.append(
        {
            "name": "one at a time: where p50 went",
            "value": (
                f"arrival->batch closed {median(lat['trace_wait_ms_median_runs']):.3f} ms, "
                f"batch span {median(lat['trace_batch_span_ms_median_runs']):.3f} ms; "
                f"p50 - model - delay = "
                f"{median(lat['p50_minus_model_and_delay_ms_runs']):.3f} ms (slack 0.5)"
            ),
            "target": "info",
            "pass": None,
        }
    )
    b64, b1 = bought["batch64"], bought["batch1"]
    rows.append(
        {
            "name": "batching bought: throughput 64 vs 1",
            "value": (
                f"{bought['throughput_ratio_median']:.2f}x ({b64['items_per_s_median']:.0f}"
                f" vs {b1['items_per_s_median']:.0f} items/s)"
            ),
            "target": "info",
            "pass": None,
        }
    )
    rows.append(
        {
            "name": "batching bought: latency p50/p99",
            "value": (
                f"64: {b64['p50_ms']:.1f}/{b64['p99_ms']:.1f} ms; "
                f"1: {b1['p50_ms']:.1f}/{b1['p99_ms']:.1f} ms"
            ),
            "target": "info",
            "pass": None,
        }
    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few, short repeats (< 60 s)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--repeats", type=int, default=None, help="override the repeat count")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        metavar="S",
        help="before each repeat wait up to S seconds for other processes to go idle "
        "(default 20, 0 with --quick; 0 turns it off; at most 120 s in all)",
    )
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    global GATE
    wait_s = args.wait_quiet if args.wait_quiet is not None else (0.0 if args.quick else 20.0)
    GATE = QuietGate(wait_s, 120.0)
    if args.repeats is not None:
        cfg = Settings(**{**cfg.__dict__, "repeats": args.repeats})

    torch.set_num_threads(1)
    np.random.seed(SEED)
    torch.manual_seed(SEED)

    def log(line: str) -> None:
        print(line, flush=True)

    machine = machine_info()
    log("carpool core benchmarks" + (" (quick)" if args.quick else ""))
    for key, value in machine.items():
        log(f"  {key:18} {value}")
    log(f"  {'repeats':18} {cfg.repeats}")

    start = time.perf_counter()
    meter = LoadMeter()
    results = asyncio.run(main_async(cfg, log))
    elapsed = time.perf_counter() - start
    machine["load_during_run"] = meter.stop()
    machine["quiet_gate"] = {
        "max_wait_s": GATE.max_wait_s,
        "waited_s": round(GATE.waited_s, 1),
        "gave_up": GATE.gave_up,
        "threshold_cores": QuietGate.THRESHOLD_CORES,
    }
    machine["load_avg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    summary = summarize(results)

    log(
        f"\nsummary ({elapsed:.0f} s; other processes + steal took "
        f"{_taken(machine['load_during_run']):.2f} of "
        f"{machine['cpus_usable']} cores on average; waited {GATE.waited_s:.0f} s for quiet, "
        f"gave up {GATE.gave_up}x)"
    )
    width = max(len(row["name"]) for row in summary)
    for row in summary:
        mark = "" if row["pass"] is None else verdict(row["pass"])
        log(f"  {mark:4} {row['name']:<{width}}  {row['value']}  [target {row['target']}]")

    document = {
        "command": " ".join(
            [f"{k}={os.environ[k]}" for k in THREAD_ENV if k in os.environ]
            + [".venv/bin/python", *sys.argv]
        ),
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "elapsed_s": elapsed,
        "machine": machine,
        "source": source_revision(),
        "settings": cfg.__dict__,
        "results": results,
        "summary": summary,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    log(f"\nwrote {args.json}")
    gated = [row["pass"] for row in summary if row["pass"] is not None]
    return 0 if all(gated) else 1


if __name__ == "__main__":
    sys.exit(main())
