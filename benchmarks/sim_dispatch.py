"""A thousand replicas, simulated: carpool's real dispatch on a fake clock (issue 24 §4).

    .venv/bin/python benchmarks/sim_dispatch.py                     # 1, 10, 100, 1000
    .venv/bin/python benchmarks/sim_dispatch.py --replicas 1000 --repeats 1

What runs is the real engine: a :class:`~carpool.core.batcher.Batcher` with
``clock=FakeClock()``, ``devices=["sim:0", ..., "sim:N-1"]`` and an ``fn_factory`` that
gives each replica an ``async`` model (so every replica runs on the event loop, no
threads). The model "computes" by waiting on the fake clock for
``t(b) = (FIXED_S + PER_ITEM_S * b) / speed``, ``speed`` drawn per replica (seeded)
between 1 and ``--spread`` (3: replicas up to 3x apart). Nothing computes: the only CPU
the process spends is carpool's dispatch (scheduler, queues, replica loops, telemetry)
and this driver.

Arrivals are Poisson (seeded) at each ``--loads`` fraction of the total capacity, the sum
over replicas of ``max_batch_size / t(max_batch_size)``. The driver moves the fake clock
to the next arrival, or by ``--tick-s`` when arrivals come closer than that, and queues
each request with its exact ``arrival_s`` (so a queue wait counts from its arrival; the
dispatcher sees a request at most one tick late). A warm-up of ``--warmup-batches``
slowest full-batch times is excluded; figures cover the next ``--window-batches`` (or,
with few replicas, ``--min-window-batches`` / replicas, so that one replica's figures
still rest on some 1000 batches).

Per (replicas, load), medians over ``--repeats`` (each with its own seed):

- throughput: requests answered in the window per second, against the total capacity
  (``tput/cap``) and against the offered rate (``tput/offered``);
- balance: min/max over replicas of the fraction of the window each spent computing;
- p99 queue wait: batch closed - arrival, of requests that arrived in the window (from
  the batcher's ``on_trace``);
- mean batch size: of the batches started in the window;
- dispatch CPU per batch: ``time.process_time`` from the first arrival until every
  request is answered (replicas already loaded), over all batches run meanwhile. It
  includes this driver and FakeClock's settling: 20 loop turns per timer fired and 40
  per ``advance``, paid whether carpool has work in them or not. ``own us/batch`` takes
  those turns out (counted by :class:`CountingClock`, at the CPU cost of an empty turn
  measured at the start of each run): an estimate of carpool's own share.

The garbage collector is set up as ``carpool serve`` sets it once its models are loaded
(``--gc serve``, the default): a full collection, ``gc.freeze()`` of what is alive, and a
young generation of ``YOUNG_GC_THRESHOLD`` objects (``carpool.server.heap``), here once the
replicas are loaded and before the first arrival, undone after each run. ``--gc python``
keeps Python's defaults, as the simulation ran before.

Targets (issue 24; benchmark targets, printed PASS/FAIL, never asserted in tests):
at 90% load, from 10 to 1000 replicas, throughput >= 0.95 of the offered rate (at 90%
load throughput cannot exceed 0.90 of capacity, so "0.95 of capacity" is read as keeping
up with 95% of what arrives), balance >= 0.93, and dispatch CPU per batch within 2x of
its value at 10 replicas. Results go to ``benchmarks/results/sim_dispatch.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from carpool import BatchPolicy
from carpool.core.batcher import Batcher
from carpool.core.clock import FakeClock, TimerHandle, settle
from carpool.core.request import Outcome, RequestTrace
from carpool.server.heap import YOUNG_GC_THRESHOLD

SETTLE_ROUNDS = 20  # loop turns FakeClock.advance lets run: 2 settles, and one per timer
MAX_BATCH_SIZE = 8
FIXED_S = 0.020  # a batch's fixed cost on the slowest replica
PER_ITEM_S = 0.0025  # and its cost per item there: t(8) = 40 ms at speed 1
MAX_DELAY_S = 0.005
TARGET_LOAD = 0.90
TARGET_KEEP_UP = 0.95
TARGET_BALANCE = 0.93
TARGET_CPU_RATIO = 2.0


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated run: ``num_replicas`` replicas at ``load`` of their capacity."""

    num_replicas: int
    load: float
    seed: int
    spread: float = 3.0
    warmup_batches: float = 5.0
    window_batches: float = 10.0
    min_window_batches: int = 1000  # in all replicas: a long enough window for few
    tick_s: float = 0.0005
    max_batch_size: int = MAX_BATCH_SIZE
    fixed_s: float = FIXED_S
    per_item_s: float = PER_ITEM_S
    max_delay_s: float = MAX_DELAY_S
    gc: str = "serve"  # the garbage collector as carpool serve sets it, or "python"


@dataclass(slots=True)
class SimResult:
    """What one run measured (see the module docstring for each figure)."""

    num_replicas: int
    load: float
    seed: int
    capacity_rps: float
    offered_rps: float
    num_requests: int
    num_answered_ok: int
    num_answered_twice: int
    num_batches: int
    throughput_rps: float
    balance: float
    p99_queue_wait_s: float
    mean_batch_size: float
    cpu_per_batch_us: float
    carpool_cpu_per_batch_us: float
    cpu_s: float
    wall_s: float
    busy_fractions: list[float] = field(repr=False, default_factory=list)

    @property
    def tput_over_capacity(self) -> float:
        return self.throughput_rps / self.capacity_rps

    @property
    def tput_over_offered(self) -> float:
        return self.throughput_rps / self.offered_rps

    def summary(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__ if k != "busy_fractions"}
        out |= {"tput_over_capacity": self.tput_over_capacity}
        return out | {"tput_over_offered": self.tput_over_offered}


class CountingClock(FakeClock):
    """A FakeClock that counts its ``advance`` calls and the timers they fire, so that
    the loop turns its settling costs can be told apart from carpool's own work."""

    def __init__(self) -> None:
        super().__init__()
        self.num_advances = 0
        self.num_fired = 0

    def call_at(self, when_s: float, callback: Callable[[], None]) -> TimerHandle:
        def fire() -> None:
            self.num_fired += 1
            callback()

        return super().call_at(when_s, fire)

    async def advance(self, delta_s: float) -> None:
        self.num_advances += 1
        await super().advance(delta_s)

    @property
    def num_turns(self) -> int:
        """Loop turns spent settling: 2 settles per advance and one per timer fired."""
        return SETTLE_ROUNDS * (2 * self.num_advances + self.num_fired)


async def empty_turn_s(num_turns: int = 20_000) -> float:
    """CPU seconds of one loop turn with nothing else to run: what FakeClock's settling
    costs per turn even when carpool has no work in it."""
    start = time.process_time()
    for _ in range(num_turns // SETTLE_ROUNDS):
        await settle(SETTLE_ROUNDS)
    return (time.process_time() - start) / num_turns


def replica_speeds(num_replicas: int, spread: float, seed: int) -> list[float]:
    """Each replica's speed, 1 (slowest) to ``spread`` times that, drawn with ``seed``."""
    rng = np.random.default_rng(seed)
    return [float(s) for s in rng.uniform(1.0, spread, num_replicas)]


def batch_time_s(num_items: int, speed: float, config: SimConfig) -> float:
    return (config.fixed_s + config.per_item_s * num_items) / speed


class SimReplicas:
    """The simulated models: each replica's ``async`` function waits on the fake clock
    for its batch time, and records what it computed and when."""

    def __init__(self, clock: FakeClock, speeds: list[float], config: SimConfig) -> None:
        self.clock = clock
        self.speeds = speeds
        self.config = config
        # Per replica: (started_s, ended_s, num_items) of each batch.
        self.batches: list[list[tuple[float, float, int]]] = [[] for _ in speeds]

    def factory(self, device: str) -> Any:
        replica_id = int(device.removeprefix("sim:"))
        speed = self.speeds[replica_id]
        clock, config, log = self.clock, self.config, self.batches[replica_id]

        async def model(batch: list[Any]) -> list[Any]:
            started_s = clock.now()
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            clock.call_at(started_s + batch_time_s(len(batch), speed, config), _waker(done))
            await done
            log.append((started_s, clock.now(), len(batch)))
            return batch

        return model

    def capacity_rps(self) -> float:
        """Items per second with every replica computing full batches back to back."""
        size = self.config.max_batch_size
        return sum(size / batch_time_s(size, s, self.config) for s in self.speeds)


def _waker(done: asyncio.Future[None]) -> Any:
    def wake() -> None:
        if not done.done():
            done.set_result(None)

    return wake


def poisson_arrivals(rate_rps: float, start_s: float, end_s: float, seed: int) -> np.ndarray:
    """Arrival times of a Poisson process of ``rate_rps`` in [start_s, end_s)."""
    rng = np.random.default_rng(seed + 1_000_003)
    expected = rate_rps * (end_s - start_s)
    num = int(expected + 10 * math.sqrt(expected) + 16)
    times = start_s + np.cumsum(rng.exponential(1.0 / rate_rps, num))
    while times[-1] < end_s:  # not reached in practice: 10 sigma of slack
        more = times[-1] + np.cumsum(rng.exponential(1.0 / rate_rps, num))
        times = np.concatenate([times, more])
    return times[times < end_s]


@contextlib.contextmanager
def collector_as_served() -> Iterator[None]:
    """The garbage collector as ``carpool serve`` sets it once its models are loaded (a
    full collection, what is alive frozen, a young generation of ``YOUNG_GC_THRESHOLD``),
    then as it was."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


async def simulate(config: SimConfig) -> SimResult:
    """Run one simulation (see the module docstring) and measure it."""
    clock = CountingClock()
    turn_s = await empty_turn_s()
    speeds = replica_speeds(config.num_replicas, config.spread, config.seed)
    sim = SimReplicas(clock, speeds, config)
    ledger = Ledger()
    batcher = Batcher(
        fn_factory=sim.factory,
        devices=[f"sim:{i}" for i in range(config.num_replicas)],
        policy=BatchPolicy(max_batch_size=config.max_batch_size, max_delay_s=config.max_delay_s),
        name="sim",
        collate="list",
        clock=clock,
        on_trace=ledger.trace,
    )
    await batcher.start()
    collector = collector_as_served() if config.gc == "serve" else contextlib.nullcontext()
    capacity_rps = sim.capacity_rps()
    offered_rps = config.load * capacity_rps
    slowest_s = batch_time_s(config.max_batch_size, min(speeds), config)
    start_s = clock.now()
    window_start_s = start_s + config.warmup_batches * slowest_s
    per_replica = max(config.window_batches, config.min_window_batches / config.num_replicas)
    window_end_s = window_start_s + per_replica * slowest_s
    arrivals = poisson_arrivals(offered_rps, start_s, window_end_s, config.seed)

    with collector:
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        await _drive(batcher, clock, ledger, arrivals.tolist(), config.tick_s)
        while ledger.settle():
            next_s = clock.next_timer_s()
            await clock.advance(max(0.0, (next_s or clock.now()) - clock.now()))
        cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
        await batcher.stop(drain=True)

    num_batches = sum(len(b) for b in sim.batches)
    window_s = window_end_s - window_start_s
    answered = [t for t in ledger.ok_answered_s if window_start_s <= t < window_end_s]
    waits = sorted(
        wait_s
        for arrived_s, wait_s in zip(ledger.ok_arrived_s, ledger.ok_wait_s, strict=True)
        if window_start_s <= arrived_s < window_end_s
    )
    in_window = [
        n for log in sim.batches for (s, _, n) in log if window_start_s <= s < window_end_s
    ]
    busy = [_busy_s(log, window_start_s, window_end_s) / window_s for log in sim.batches]
    return SimResult(
        num_replicas=config.num_replicas,
        load=config.load,
        seed=config.seed,
        capacity_rps=capacity_rps,
        offered_rps=offered_rps,
        num_requests=ledger.num_requests,
        num_answered_ok=ledger.num_ok,
        num_answered_twice=len(ledger.traced_ids) - len(set(ledger.traced_ids)),
        num_batches=num_batches,
        throughput_rps=len(answered) / window_s,  # one item per request
        balance=min(busy) / max(busy) if max(busy) > 0 else 1.0,
        p99_queue_wait_s=_quantile(waits, 0.99),
        mean_batch_size=statistics.fmean(in_window) if in_window else math.nan,
        cpu_per_batch_us=cpu_s / num_batches * 1e6 if num_batches else math.nan,
        carpool_cpu_per_batch_us=(
            (cpu_s - clock.num_turns * turn_s) / num_batches * 1e6 if num_batches else math.nan
        ),
        cpu_s=cpu_s,
        wall_s=wall_s,
        busy_fractions=busy,
    )


class Ledger:
    """Every request's future until it resolves, and what its trace said.

    It keeps numbers, not objects: a futures list and the traces kept whole would grow the
    heap the cyclic garbage collector walks with the length of the run (and so with the
    replicas), and charge that to the CPU per batch.
    """

    def __init__(self) -> None:
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.num_requests = 0
        self.num_ok = 0
        self.num_failed = 0
        self.traced_ids: list[int] = []
        self.ok_arrived_s: list[float] = []
        self.ok_wait_s: list[float] = []
        self.ok_answered_s: list[float] = []

    def add(self, future: asyncio.Future[Any]) -> None:
        self.num_requests += 1
        self.pending.append(future)

    def settle(self) -> int:
        """Count the resolved futures at the front (they resolve about in arrival order);
        how many are still pending."""
        pending = self.pending
        while pending and pending[0].done():
            future = pending.popleft()
            if future.cancelled() or future.exception() is not None:
                self.num_failed += 1
            else:
                self.num_ok += 1
        return len(pending)

    def trace(self, trace: RequestTrace) -> None:
        self.traced_ids.append(trace.request_id)
        if trace.outcome is Outcome.OK:
            self.ok_arrived_s.append(trace.arrived_s)
            self.ok_wait_s.append(trace.wait_s)
            self.ok_answered_s.append(trace.answered_s)


async def _drive(
    batcher: Batcher, clock: FakeClock, ledger: Ledger, arrivals: list[float], tick_s: float
) -> None:
    """Queue each arrival on the fake clock, its future in ``ledger``."""
    payload = [0]
    i, num = 0, len(arrivals)
    while i < num:
        now = clock.now()
        while i < num and arrivals[i] <= now:
            ledger.add(batcher.enqueue_many(payload, arrival_s=arrivals[i]).future)
            i += 1
        ledger.settle()
        if i < num:
            await clock.advance(max(arrivals[i], now + tick_s) - now)


def _busy_s(log: list[tuple[float, float, int]], start_s: float, end_s: float) -> float:
    return sum(max(0.0, min(e, end_s) - max(s, start_s)) for s, e, _ in log)


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def medians(runs: list[SimResult]) -> dict[str, float]:
    keys = ["tput_over_capacity", "tput_over_offered", "balance", "p99_queue_wait_s"]
    keys += ["mean_batch_size", "cpu_per_batch_us", "carpool_cpu_per_batch_us"]
    return {k: statistics.median(getattr(r, k) for r in runs) for k in keys}


def check_targets(rows: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    """The issue's targets over the rows at TARGET_LOAD with 10 replicas or more."""
    at = [r for r in rows if r["load"] == TARGET_LOAD and r["num_replicas"] >= 10]
    if not at:
        return []
    keep_up = min(r["tput_over_offered"] for r in at)
    balance = min(r["balance"] for r in at)
    sizes = ",".join(str(r["num_replicas"]) for r in at)

    def cpu_ratio(key: str) -> float:
        cpus = {r["num_replicas"]: r[key] for r in at}
        return max(cpus.values()) / min(cpus.values())

    total, own = cpu_ratio("cpu_per_batch_us"), cpu_ratio("carpool_cpu_per_batch_us")
    return [
        (
            f"throughput/offered >= {TARGET_KEEP_UP} at {TARGET_LOAD:.0%} load ({sizes})",
            keep_up >= TARGET_KEEP_UP,
            f"lowest {keep_up:.3f}",
        ),
        (
            f"balance >= {TARGET_BALANCE} at {TARGET_LOAD:.0%} load ({sizes})",
            balance >= TARGET_BALANCE,
            f"lowest {balance:.3f}",
        ),
        (
            f"dispatch CPU/batch flat within {TARGET_CPU_RATIO:g}x ({sizes})",
            total <= TARGET_CPU_RATIO,
            f"largest/smallest {total:.2f}",
        ),
        (
            f"the same, settling turns taken out ({sizes})",
            own <= TARGET_CPU_RATIO,
            f"largest/smallest {own:.2f}",
        ),
    ]


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'replicas':>8} {'load':>5} {'tput/cap':>8} {'tput/off':>8} {'balance':>7} "
        f"{'p99 wait ms':>11} {'batch':>5} {'cpu us/batch':>12} {'own us/batch':>12}"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['num_replicas']:>8} {r['load']:>5.0%} {r['tput_over_capacity']:>8.3f} "
            f"{r['tput_over_offered']:>8.3f} {r['balance']:>7.3f} "
            f"{r['p99_queue_wait_s'] * 1e3:>11.2f} {r['mean_batch_size']:>5.2f} "
            f"{r['cpu_per_batch_us']:>12.1f} {r['carpool_cpu_per_batch_us']:>12.1f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", default="1,10,100,1000", help="comma-separated counts")
    parser.add_argument("--loads", default="0.5,0.7,0.9,0.95", help="fractions of capacity")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spread", type=float, default=3.0, help="fastest/slowest, at most")
    parser.add_argument("--warmup-batches", type=float, default=5.0)
    parser.add_argument("--window-batches", type=float, default=10.0)
    parser.add_argument(
        "--min-window-batches",
        type=int,
        default=1000,
        help="with few replicas, the window lasts this many slowest batch times / replicas",
    )
    parser.add_argument("--tick-s", type=float, default=0.0005)
    parser.add_argument(
        "--gc",
        choices=("serve", "python"),
        default="serve",
        help="the garbage collector as carpool serve sets it (default), or Python's defaults",
    )
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from benchlib import RESULTS, machine_info, utc_now, write_results

    args = parse_args(argv)
    info = machine_info()
    for key in ("platform", "cpu_model", "cpu_count", "python", "torch"):
        print(f"{key}: {info[key]}")
    rows: list[dict[str, Any]] = []
    for num_replicas in [int(n) for n in args.replicas.split(",")]:
        for load in [float(x) for x in args.loads.split(",")]:
            runs = []
            for repeat in range(args.repeats):
                config = SimConfig(
                    num_replicas,
                    load,
                    seed=args.seed + repeat,
                    spread=args.spread,
                    warmup_batches=args.warmup_batches,
                    window_batches=args.window_batches,
                    min_window_batches=args.min_window_batches,
                    tick_s=args.tick_s,
                    gc=args.gc,
                )
                runs.append(asyncio.run(simulate(config)))
            row = {"num_replicas": num_replicas, "load": load, **medians(runs)}
            row["runs"] = [r.summary() for r in runs]
            rows.append(row)
            print(table([row]).split("\n")[1], f"  ({sum(r.wall_s for r in runs):.1f} s)")
    print()
    print(table(rows))
    targets = check_targets(rows)
    for name, ok, detail in targets:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    settings = {
        "max_batch_size": MAX_BATCH_SIZE,
        "fixed_s": FIXED_S,
        "per_item_s": PER_ITEM_S,
        "max_delay_s": MAX_DELAY_S,
        **{k: v for k, v in vars(args).items() if k != "json"},
    }
    write_results(
        args.json or RESULTS / "sim_dispatch.json",
        {
            "when": utc_now(),
            "machine": info,
            "settings": settings,
            "rows": rows,
            "targets": [{"target": n, "pass": ok, "detail": d} for n, ok, d in targets],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
