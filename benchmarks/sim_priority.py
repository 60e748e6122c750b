"""Priority classes under `max_delay_s: auto`, simulated: carpool's real scheduler and
controller on a virtual clock, one replica computing on the event loop of one core.

    .venv/bin/python benchmarks/sim_priority.py [--seconds 10] [--seeds 3]
        [--client-cpu-s S] [--label NAME]

It replays what `bench_adaptive.py --only priority` measures over HTTP, without the noise
of a shared machine: the :class:`~carpool.core.scheduler.Scheduler`,
:class:`~carpool.core.adaptive.Adaptive` and :class:`~carpool.core.batch_times.BatchTimes`
decide; this driver plays the event loop of `carpool serve` with W1 on one core
(`executor: auto` puts the model on the loop there):

- the loop does one thing at a time: it runs a batch (``t(b) = overhead + per_item * b``,
  times ``U[1 - noise, 1 + noise]``), then answers that batch's requests
  (``ANSWER_S`` each), then reads every request that reached its socket meanwhile
  (``READ_S`` each; the request's arrival is when it is read, as the server sees it),
  then asks the scheduler for the next batch (`io_turn` order); idle, it reads each
  request as it comes;
- 64 closed-loop background clients (class `background`) send their next request
  ``CLIENT_S`` after their answer; an interactive client (`priority: 1`, `slo_s` 20 ms)
  sends one every 20 ms (or when its previous one is answered, if later), as the
  benchmark's does. With ``--client-cpu-s``, the background clients share one
  load-generator core: each next request costs it that long, one after another, so
  a batch's clients come back spread out rather than at once.

The default costs are W1's on the quiet 2-core machine: batch 64 in 16.4 ms (the offline
ceiling 3900 items/s), batch 1 in 2.5 ms (`bench_adaptive`'s c=1 p50 2.85 ms over HTTP),
about 45 us of HTTP work per request on the loop (its capacity over HTTP at concurrency 64
was 0.85 of the ceiling). Per policy (fixed: 64 within 2 ms; auto), medians over the
seeds: the interactive p99 alone and under load, background throughput over the ceiling,
the mean sizes of the batches each class led, and the share of the time the replica sat
idle while background requests waited. Results: `benchmarks/results/sim_priority.json`
(with ``--label``, under that key, next to the rows already there). A model, not a
measurement: it shows what the policy decides; the HTTP benchmark shows what a real
server does.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from benchlib import RESULTS, write_results
from carpool.core.adaptive import Adaptive
from carpool.core.batch_times import BatchTimes
from carpool.core.policy import BatchPolicy, ClassPolicy
from carpool.core.queues import Queues
from carpool.core.request import Request, RequestState
from carpool.core.scheduler import Scheduler

OVERHEAD_S, PER_ITEM_S = 0.00228, 0.000220  # t(1) 2.5 ms, t(64) 16.4 ms
READ_S, ANSWER_S = 25e-6, 20e-6  # the loop's HTTP work per request
CLIENT_S = 100e-6  # a background client's turnaround
NOISE = 0.1
INTERACTIVE_PERIOD_S = 0.02
NUM_BACKGROUND = 64
WARMUP_S = 2.0
POLICIES: dict[str, dict[str, Any]] = {
    "fixed": {"max_delay_s": 0.002, "max_batch_size": 64},
    "auto": {"max_delay_s": "auto", "max_batch_size": 64},
}


class _Clock:
    """BatchTimes reads the time from this: the simulation's."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def now(self) -> float:
        return self.now_s

    def call_at(self, when_s: float, callback: Any) -> Any:
        raise NotImplementedError("the simulation sets no timers")


@dataclass
class _Run:
    interactive_s: list[float] = field(default_factory=list)
    num_background: int = 0
    idle_waiting_s: float = 0.0  # nothing computing while background requests waited
    sizes: dict[str, list[int]] = field(
        default_factory=lambda: {"interactive": [], "background": []}
    )


def _policy(**changes: Any) -> BatchPolicy:
    classes = (ClassPolicy("interactive", slo_s=0.02), ClassPolicy("background"))
    return BatchPolicy(slo_s=0.05, classes=classes, default_class="background", **changes)


def simulate(
    changes: dict[str, Any],
    seconds: float,
    seed: int,
    num_background: int = NUM_BACKGROUND,
    client_cpu_s: float = 0.0,
) -> _Run:
    """One run of ``seconds`` after the warm-up; what happened in it."""
    import asyncio

    loop = asyncio.new_event_loop()  # only to make the requests' futures
    rng = random.Random(seed)
    policy = _policy(**changes)
    clock = _Clock()
    times = BatchTimes(clock)
    adaptive = Adaptive(times.fit)
    queues, scheduler = Queues(policy), Scheduler()
    ids = itertools.count()
    # (time it reaches the socket, seq, class, time it was sent)
    sent: list[tuple[float, int, str, float]] = []
    for k in range(num_background):
        heapq.heappush(sent, (k * 1e-5, next(ids), "background", k * 1e-5))
    next_interactive = rng.uniform(0, INTERACTIVE_PERIOD_S)
    heapq.heappush(sent, (next_interactive, next(ids), "interactive", next_interactive))
    sent_at: dict[int, float] = {}
    run, end_s = _Run(), WARMUP_S + seconds
    client_free_s = 0.0  # when the load generator's core is next free
    now = 0.0

    def read(until_s: float) -> float:
        t = until_s
        while sent and sent[0][0] <= t:
            _, _, name, sent_s = heapq.heappop(sent)
            t += READ_S
            limits = policy.class_limits(name)
            request = Request(
                request_id=next(ids), payload=None, num_items=1, is_many=False, cost=1.0,
                class_name=limits.name, rank=limits.rank, arrival_s=t, deadline_s=None,
                future=loop.create_future(),
            )  # fmt: skip
            sent_at[request.request_id] = sent_s
            queues.admit(request)
            adaptive.arrived(name, t, queues.by_name[name].num_live > 1)
        return t

    while now < end_s:
        now = read(now)
        clock.now_s = now
        decision = scheduler.decide(
            now, policy, queues, num_replicas=1, max_items_cap=None, is_draining=False,
            expire=lambda r: None, predict_s=times.predict_s,
            adaptive=adaptive if policy.is_adaptive else None,
        )  # fmt: skip
        batch = decision.batch
        if batch is None:
            wakes = [t for t in (decision.wake_at_s, decision.ages_at_s) if t is not None]
            if sent:
                wakes.append(sent[0][0])
            idle_until_s = max(now, min(wakes))
            if now >= WARMUP_S and queues.by_name["background"].num_live > 0:
                run.idle_waiting_s += idle_until_s - now
            now = idle_until_s
            continue
        for name in {r.class_name for r in batch.requests}:
            if queues.by_name[name].num_live == 0:
                adaptive.emptied(name, now)
        for request in batch.requests:
            request.state = RequestState.RUNNING
        compute_s = (OVERHEAD_S + PER_ITEM_S * batch.num_items) * rng.uniform(1 - NOISE, 1 + NOISE)
        now += compute_s
        clock.now_s = now
        times.observe(batch.num_items, compute_s)
        queues.by_name[batch.lead_class].num_running -= 1
        is_measured = now >= WARMUP_S
        if is_measured:
            run.sizes[batch.lead_class].append(batch.num_items)
        for request in batch.requests:
            now += ANSWER_S
            latency_s = now - sent_at.pop(request.request_id)
            if request.class_name == "interactive":
                if is_measured:
                    run.interactive_s.append(latency_s)
                next_interactive = max(next_interactive + INTERACTIVE_PERIOD_S, now)
                heapq.heappush(sent, (next_interactive, next(ids), "interactive", next_interactive))
            else:
                run.num_background += is_measured
                client_free_s = max(client_free_s, now) + client_cpu_s
                sent_s = client_free_s + CLIENT_S
                heapq.heappush(sent, (sent_s, next(ids), "background", sent_s))
    loop.close()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--client-cpu-s", type=float, default=0.0)
    parser.add_argument("--label", help="store the rows under this key, keeping the others")
    args = parser.parse_args()
    ceiling = 64 / (OVERHEAD_S + PER_ITEM_S * 64)
    out: dict[str, Any] = {}
    for name, changes in POLICIES.items():
        rows = []
        for seed in range(args.seeds):
            alone = simulate(changes, args.seconds, seed, num_background=0)
            loaded = simulate(changes, args.seconds, seed, client_cpu_s=args.client_cpu_s)
            rows.append(
                {
                    "interactive_alone_p99_ms": float(np.percentile(alone.interactive_s, 99) * 1e3),
                    "interactive_loaded_p99_ms": float(
                        np.percentile(loaded.interactive_s, 99) * 1e3
                    ),
                    "background_over_ceiling": loaded.num_background / args.seconds / ceiling,
                    "interactive_batch_mean": statistics.fmean(loaded.sizes["interactive"]),
                    "background_batch_mean": statistics.fmean(loaded.sizes["background"]),
                    "idle_while_background_waits": loaded.idle_waiting_s / args.seconds,
                }
            )
        out[name] = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
        out[name]["runs"] = rows
        row = out[name]
        print(
            f"{name:>6}: interactive p99 alone {row['interactive_alone_p99_ms']:.1f} ms, "
            f"under load {row['interactive_loaded_p99_ms']:.1f} ms; background "
            f"{row['background_over_ceiling']:.2f} of ceiling; mean batch led by interactive "
            f"{row['interactive_batch_mean']:.1f}, by background {row['background_batch_mean']:.1f}"
            f"; idle while background waits {row['idle_while_background_waits']:.3f}"
        )
    path = RESULTS / "sim_priority.json"
    if not args.label:
        write_results(path, {"ceiling_items_per_s": ceiling, **out})
        return
    kept = orjson.loads(path.read_bytes()) if path.exists() else {}
    rows = {"command": " ".join(sys.argv), "client_cpu_s": args.client_cpu_s, **out}
    path.write_bytes(orjson.dumps({**kept, args.label: rows}, option=orjson.OPT_INDENT_2))
    print(f"wrote {path} ({args.label})")


if __name__ == "__main__":
    main()
