"""Adaptive batching (`max_delay_s: auto`) against fixed settings and AIMD, W1 over HTTP.

One `carpool serve` (W1 `mlp`, one replica) on the server CPU, `carpool bench` on the load
CPU (in this process, kserve-binary, 1 x 256 float32 per request). The policy is switched
between settings over the policy endpoint (`--allow-policy-updates`), not by restarting.

1. **Load sweep.** For each setting (a grid of fixed `max_delay_s` x `max_batch_size`, `auto`,
   and an AIMD controller of `max_batch_size` in the style of Clipper, implemented here
   only: +4 every 0.25 s while the share of requests over the SLO stays under 1%, x0.9
   when it does not) and each load (closed-loop concurrency 1; open-loop Poisson at
   fractions of the capacity over HTTP (concurrency 64, 64 within 2 ms); bursty gamma
   arrivals, CV^2 4, at 70%; a day/night schedule between 5% and 90%), the goodput:
   requests answered within `SLO_S` per second. Per load, the best fixed setting; over
   the whole sweep, the single fixed setting with the best total (the one a user tuning
   once would keep). The sweep goes load by load, every setting in turn, the order
   turned by one setting from load to load, so that no setting runs last at every load
   (this VM's speed drifts: `bench_steadiness.py`). Each point also keeps where a late
   answer's time went: the client's lag (`behind_schedule_ratio`, `max_lag_ms`: sends
   that left late, the load generator's own CPU), the server's mean batch size, queue
   wait and model time, its refusals, and the share it answered within the SLO by its
   own clock; for `auto`, what the controller had in force every 0.25 s
   (`adaptive_trace`).
2. **Priority classes.** An interactive request (`priority: 1`, `slo_s` 20 ms) every
   20 ms, alone and then under 64 closed-loop background clients; its p99, and the
   background throughput against the offline ceiling; fixed (64 within 2 ms) vs auto,
   each without and with `preempt` (an interactive batch runs between the steps of a
   background batch).
   Under load, from `/metrics`: the mean batch size (all classes) and the share of the
   time the model computed.

    .venv/bin/python benchmarks/bench_adaptive.py [--quick] [--only priority|c64]
        [--repeats N] [--breakdown] [--timeout-s S] [--max-queue-time-s auto|S]
        [--loads LABELS] [--settings NAMES] [--sweep-only] [--json PATH]

`--quick` runs a reduced grid and shorter points (a few minutes); the full run is the
issue's grid. `--only priority` runs only part 2 (results in `adaptive_priority.json`);
`--only c64` only `auto` against fixed (64 within 2 ms) at concurrency 64, in turn
(`adaptive_c64.json`); `--repeats N` runs either N times (the policies alternating) and
reports medians, and with `--sweep-only` runs the sweep N times, each on a fresh server
that measures its own capacity, and reports each load's median `auto` / best fixed;
`--breakdown` also records the server's timelines while the interactive client runs
under load and summarizes where the interactive requests' time went (it costs the server
some CPU: leave it off for the figures). `--timeout-s S` gives every setting of the
sweep (fixed, `auto`, AIMD) the same `timeout_s`: a request that can no longer be answered
within it expires at once (scheduler rule 7) instead of being answered late, as a user
who prefers a fast error to a late answer sets it. `--max-queue-time-s` gives them all the
same queue bound in time (`auto`: refuse at admission what could only be answered past
`slo_s`; the c64 and priority parts run without it). `--loads` and `--settings` keep
some of the sweep's loads and settings (`auto` always), `--sweep-only` skips the rest of
the run (the day/night schedule at full length against a few fixed settings, say).
Figures are ratios within one run. Needs `taskset` (util-linux). The same sweep for the
embeddings model, on a token budget: bench_adaptive_embeddings.py (it reuses this
module's sweep with its own `Workload`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import numpy as np
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench_http import offline_ceiling
from benchlib import (
    LOAD_CPU,
    RESULTS,
    SERVER_CPU,
    carpool_serve,
    machine_info,
    wait_kserve_ready,
    write_results,
)
from carpool.tools.bench import build_parser, config_from_args, run_bench
from carpool.tools.bench_types import PointResult
from wrkrun import free_port

DEFAULT_JSON = RESULTS / "adaptive.json"
PRIORITY_JSON = RESULTS / "adaptive_priority.json"
C64_JSON = RESULTS / "adaptive_c64.json"
SLO_S = 0.05
INTERACTIVE_SLO_S = 0.02
CONFIG = f"""\
models:
  - name: mlp
    kind: python
    source: carpool.server.defaults:w1_factory
    inputs:  [{{name: INPUT0, datatype: FP32, shape: [256]}}]
    outputs: [{{name: OUTPUT0, datatype: FP32, shape: [16]}}]
    max_batch_size: 64
    max_delay_s: 0.002
    slo_s: {SLO_S}
    default_class: background
    classes:
      - {{name: interactive, slo_s: {INTERACTIVE_SLO_S}}}
      - {{name: background}}
"""
FULL_DELAYS_S = (0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02)
FULL_SIZES = (8, 16, 32, 64, 128)
QUICK_DELAYS_S = (0.0, 0.002, 0.01)
QUICK_SIZES = (16, 64)
FULL_FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9, 1.1)
QUICK_FRACTIONS = (0.3, 0.7, 1.1)


@dataclass(frozen=True)
class Workload:
    """What one sweep serves and varies: the model, its `carpool bench` payload flags, the
    SLO, and the policy key that bounds a batch (``size_key``: items or tokens) with its
    grids and the AIMD controller's start, step and range on it."""

    model: str
    payload: tuple[str, ...]
    slo_s: float
    size_key: str
    quick_sizes: tuple[int, ...]
    full_sizes: tuple[int, ...]
    auto: dict[str, Any]  # the `auto` setting
    capacity_policy: dict[str, Any]  # the policy the capacity is measured under
    aimd_range: tuple[int, int, int, int] = (8, 4, 1, 128)  # start, step, least, most
    base: dict[str, Any] = field(default_factory=dict)  # joins every fixed and AIMD setting
    day_night: bool = True
    unit: str = ""  # after a size in a setting's name


W1 = Workload(
    model="mlp",
    payload=("--protocol", "kserve-binary", "--input-shape", "1,256"),
    slo_s=SLO_S,
    size_key="max_batch_size",
    quick_sizes=QUICK_SIZES,
    full_sizes=FULL_SIZES,
    auto={"max_delay_s": "auto", "max_batch_size": "auto"},
    capacity_policy={"max_delay_s": 0.002, "max_batch_size": 64},
)


def with_bounds(
    work: Workload, timeout_s: float | None, queue_time: float | str | None
) -> Workload:
    """``work`` with every setting of its sweep (fixed, AIMD, ``auto``) given the same
    ``timeout_s`` and ``max_queue_time_s``, where set."""
    bounds: dict[str, Any] = {}
    if timeout_s is not None:
        bounds["timeout_s"] = timeout_s
    if queue_time is not None:
        bounds["max_queue_time_s"] = queue_time
    if not bounds:
        return work
    return dataclasses.replace(work, base={**work.base, **bounds}, auto={**work.auto, **bounds})


def queue_time_arg(text: str) -> float | str:
    return text if text == "auto" else float(text)


def set_policy(url: str, model: str, **changes: Any) -> None:
    response = httpx.post(f"{url}/v2/models/{model}/policy", json=changes, timeout=10.0)
    response.raise_for_status()


def _loads(capacity: float, quick: bool, day_night: bool) -> list[tuple[str, list[str], float]]:
    """(label, `carpool bench` load flags, measured seconds) per load."""
    point_s = 3.0 if quick else 10.0
    loads = [("c=1", ["--concurrency", "1"], point_s)]
    for fraction in QUICK_FRACTIONS if quick else FULL_FRACTIONS:
        rate = f"{fraction * capacity:.0f}"
        loads.append((f"poisson {fraction:.0%}", ["--rate", rate, "--arrival", "poisson"], point_s))
    bursty = ["--rate", f"{0.7 * capacity:.0f}", "--arrival", "gamma", "--burstiness", "4"]
    loads.append(("bursty 70%", bursty, point_s))
    if not day_night:
        return loads
    step_s = 2.0 if quick else 20.0
    levels = (0.05, 0.3, 0.9, 0.3, 0.05, 0.6)
    schedule = ",".join(f"{i * step_s:g}s:{f * capacity:.0f}" for i, f in enumerate(levels))
    loads.append(("day/night", ["--schedule", schedule, "--arrival", "poisson"], step_s * 6))
    return loads


def goodput(url: str, work: Workload, flags: list[str], duration_s: float) -> dict[str, Any]:
    argv = [url, "--model", work.model, *work.payload]
    argv += [*flags, "--duration", f"{duration_s:g}s", "--warmup", "1s", "--seed", "0"]
    config = config_from_args(build_parser().parse_args([*argv, "--no-progress"]))
    before = _server_latency(url, work)
    (point,) = asyncio.run(run_bench(config))
    after = _server_latency(url, work)
    latencies = np.array(point.latencies_s)
    within = int((latencies <= work.slo_s).sum())
    return {
        "goodput_rps": within / duration_s,
        "rate_rps": point.summary.rate_rps,
        "p50_ms": float(np.percentile(latencies, 50) * 1e3) if len(latencies) else 0.0,
        "p99_ms": float(np.percentile(latencies, 99) * 1e3) if len(latencies) else 0.0,
        "num_errors": point.summary.num_errors,
        **_where_the_time_went(point),
        # The server's own clock (arrival to answer, warm-up included): within the SLO
        # there but not at the client, a request waited outside the batcher (unread in a
        # socket, or in a client that fell behind).
        "server_within_slo_share": _share(after[0] - before[0], after[1] - before[1]),
    }


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _server_latency(url: str, work: Workload) -> tuple[float, float]:
    """(answered within the SLO, answered) by the server's latency histogram so far."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    within = total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != "carpool_request_latency_seconds":
            continue
        for s in family.samples:
            if s.labels.get("model") != work.model or not s.name.endswith("_bucket"):
                continue
            le = float(s.labels["le"])
            if le == float("inf"):
                total += s.value
            elif abs(le - work.slo_s) < 1e-9:
                within += s.value
    return within, total


def _where_the_time_went(point: PointResult) -> dict[str, Any]:
    """The client's lag (sends that left late: its own CPU, not the server) and the
    server's side of the point (batch size, queue wait, model time), to tell a late
    answer's cause apart."""
    summary, server = point.summary, point.server
    out: dict[str, Any] = {
        "behind_schedule_ratio": summary.behind_schedule_ratio,
        "max_lag_ms": summary.max_lag_s * 1e3,
    }
    if server is not None:
        wait, compute = server.mean_queue_wait_s, server.mean_compute_s
        out["mean_batch_size"] = server.mean_batch_size
        out["mean_queue_wait_ms"] = None if wait is None else wait * 1e3
        out["mean_compute_ms"] = None if compute is None else compute * 1e3
        out["rejections"] = server.rejections
    return out


class _Every:
    """A thread that runs :meth:`_run` (which waits ``period_s`` between its turns on
    ``_stop``) while the ``with`` block lasts."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        raise NotImplementedError


class Aimd(_Every):
    """Clipper-style AIMD on the workload's size key (W1: max_batch_size, from 8, +4 up to
    128) from the server's latency histogram: +step each period while under 1% of the
    period's requests were over the SLO (a bound of the histogram), else x0.9."""

    def __init__(self, url: str, work: Workload, period_s: float = 0.25) -> None:
        super().__init__(period_s)
        self.url, self.work = url, work
        self.size, self.step, self.least, self.most = work.aimd_range

    def __enter__(self) -> Self:
        start = {**self.work.base, "max_delay_s": 0.002, self.work.size_key: self.size}
        set_policy(self.url, self.work.model, **start)
        return super().__enter__()

    def _run(self) -> None:
        before = _server_latency(self.url, self.work)
        while not self._stop.wait(self.period_s):
            after = _server_latency(self.url, self.work)
            num = after[1] - before[1]
            over = num - (after[0] - before[0])
            before = after
            if num and over / num > 0.01:
                self.size = max(self.least, int(self.size * 0.9))
            else:
                self.size = min(self.most, self.size + self.step)
            set_policy(self.url, self.work.model, **{self.work.size_key: self.size})


class PolicyTrace(_Every):
    """What the controller had in force through a load: the policy's ``adaptive`` key
    every ``period_s`` (seconds since the start; per class the cap, the target size,
    whether it refuses and the company rate; the fitted line and its stretch)."""

    def __init__(self, url: str, model: str, period_s: float = 0.25) -> None:
        super().__init__(period_s)
        self.url, self.model = url, model
        self.samples: list[dict[str, Any]] = []

    def _run(self) -> None:
        start = time.perf_counter()
        with httpx.Client(base_url=self.url, timeout=10.0) as client:
            while not self._stop.wait(self.period_s):
                state = client.get(f"/v2/models/{self.model}/policy").json().get("adaptive")
                if state is None:  # a fixed policy: nothing adapts
                    continue
                fit = state["batch_time_fit"]
                self.samples.append(
                    {
                        "t_s": round(time.perf_counter() - start, 3),
                        "classes": {
                            name: {k: c[k] for k in ("max_batch_size", "batch_size", "refusing")}
                            | {"company_rps": round(c["company_rate_rps"])}
                            for name, c in state["classes"].items()
                        },
                        "overhead_ms": round(fit["overhead_s"] * 1e3, 3),
                        "per_item_ms": round(fit["per_item_s"] * 1e3, 4),
                        "stretch": round(fit["stretch"], 3),
                    }
                )


def measure_capacity(url: str, work: Workload, quick: bool) -> float:
    """Requests per second the server answers at concurrency 64 under the workload's
    default policy (W1: 64 within 2 ms): the capacity that the open-loop loads are
    fractions of. (The offline ceiling leaves out the HTTP work, which shares the core.)"""
    set_policy(url, work.model, **work.base, **work.capacity_policy)
    return float(goodput(url, work, ["--concurrency", "64"], 3.0 if quick else 10.0)["rate_rps"])


def sweep_settings(work: Workload, quick: bool) -> list[tuple[str, dict[str, Any] | None]]:
    """(name, policy) of every setting of the sweep: the fixed grid, then `auto` and AIMD
    (no policy: the controller sets it as it runs)."""
    delays = QUICK_DELAYS_S if quick else FULL_DELAYS_S
    sizes = work.quick_sizes if quick else work.full_sizes
    settings: list[tuple[str, dict[str, Any] | None]] = [
        (
            f"fixed {d * 1e3:g} ms x {b}{work.unit}",
            {**work.base, "max_delay_s": d, work.size_key: b},
        )
        for d in delays
        for b in sizes
    ]
    return [*settings, ("auto", work.auto), ("aimd", None)]


def unknown_names(
    work: Workload, quick: bool, loads: list[str] | None, settings: list[str] | None
) -> str | None:
    """What is wrong with ``--loads``/``--settings`` names (a typo would run an empty
    sweep for minutes, then fail), or None."""
    known = {
        "--loads": [label for label, _, _ in _loads(1.0, quick, work.day_night)],
        "--settings": [name for name, _ in sweep_settings(work, quick)],
    }
    for flag, asked in (("--loads", loads), ("--settings", settings)):
        if unknown := [name for name in asked or [] if name not in known[flag]]:
            return (
                f"{flag}: unknown {', '.join(unknown)}; expected names from "
                f"{','.join(known[flag])}{' (this grid: --quick)' if quick else ''}"
            )
    return None


def run_sweep(
    url: str,
    work: Workload,
    capacity: float,
    quick: bool,
    only_loads: list[str] | None = None,
    only_settings: list[str] | None = None,
) -> dict[str, Any]:
    """The sweep (module docstring); ``only_loads``/``only_settings`` keep those labels
    and setting names (``auto`` is always kept: the ratios are its)."""
    settings = sweep_settings(work, quick)
    if only_settings is not None:
        settings = [(n, p) for n, p in settings if n in only_settings or n == "auto"]
    loads = _loads(capacity, quick, work.day_night)
    if only_loads is not None:
        loads = [load for load in loads if load[0] in only_loads]
    table: dict[str, dict[str, dict[str, Any]]] = {name: {} for name, _ in settings}
    # Load by load, every setting in turn, the order turned by one setting from one load
    # to the next: the machine's speed drifts (bench_steadiness.py), and a setting run
    # last at every load would carry every slow stretch at the end of the run.
    for i, (label, flags, duration_s) in enumerate(loads):
        shift = i % len(settings)
        for name, policy in settings[shift:] + settings[:shift]:
            if policy is None:
                with Aimd(url, work):
                    table[name][label] = goodput(url, work, flags, duration_s)
            elif name == "auto":
                set_policy(url, work.model, **policy)
                with PolicyTrace(url, work.model) as trace:
                    table[name][label] = goodput(url, work, flags, duration_s)
                table[name][label]["adaptive_trace"] = trace.samples
            else:
                set_policy(url, work.model, **policy)
                table[name][label] = goodput(url, work, flags, duration_s)
            row = table[name][label]
            if name == "auto":  # what the controller had in force at the end of the load
                policy_url = f"{url}/v2/models/{work.model}/policy"
                row["adaptive"] = httpx.get(policy_url, timeout=10.0).json()["adaptive"]
            print(
                f"{name:>24} {label:>13}: goodput {row['goodput_rps']:7.0f}/s  "
                f"p50 {row['p50_ms']:6.2f} ms  p99 {row['p99_ms']:7.2f} ms",
                flush=True,
            )
    fixed = [n for n, p in settings if p is not None and n != "auto"]
    labels = [label for label, _, _ in loads]
    best_per_load = {lb: max(fixed, key=lambda n: table[n][lb]["goodput_rps"]) for lb in labels}
    best_single = max(fixed, key=lambda n: sum(table[n][lb]["goodput_rps"] for lb in labels))
    summary = {}
    for lb in labels:
        best = table[best_per_load[lb]][lb]["goodput_rps"]
        summary[lb] = {
            "best_fixed": best_per_load[lb],
            "auto_over_best_fixed": table["auto"][lb]["goodput_rps"] / best if best else 0.0,
            "auto_over_single_fixed": _ratio(table, "auto", best_single, lb),
            "aimd_over_single_fixed": _ratio(table, "aimd", best_single, lb),
        }
    total = {n: sum(table[n][lb]["goodput_rps"] for lb in labels) for n in table}
    return {
        "table": table,
        "per_load": summary,
        "best_single_fixed": best_single,
        "auto_over_single_fixed_total": total["auto"] / total[best_single],
        "aimd_over_single_fixed_total": total.get("aimd", 0.0) / total[best_single],
    }


def _ratio(table: dict[str, dict[str, dict[str, Any]]], a: str, b: str, load: str) -> float:
    base = table[b][load]["goodput_rps"]
    return table[a][load]["goodput_rps"] / base if base and a in table else 0.0


def _interactive(url: str, duration_s: float) -> list[float]:
    """An interactive request (priority 1) every 20 ms for ``duration_s``; latencies."""
    body = {
        "inputs": [{"name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}],
        "parameters": {"priority": 1},
    }
    payload = orjson.dumps(body)
    latencies = []
    with httpx.Client(base_url=url, timeout=10.0) as client:
        end = time.perf_counter() + duration_s
        next_s = time.perf_counter()
        while next_s < end:
            time.sleep(max(0.0, next_s - time.perf_counter()))
            start = time.perf_counter()
            client.post("/v2/models/mlp/infer", content=payload).raise_for_status()
            latencies.append(time.perf_counter() - start)
            next_s += 0.02
    return latencies


def _timelines(url: str, seconds: float, into: dict[str, Any]) -> threading.Thread:
    """Record the server's request timelines for ``seconds`` on a thread, into ``into``."""

    def record() -> None:
        query = {"seconds": f"{seconds:g}"}
        response = httpx.get(f"{url}/v2/timelines", params=query, timeout=seconds + 30)
        into.update(response.raise_for_status().json())

    thread = threading.Thread(target=record, daemon=True)
    thread.start()
    return thread


def _breakdown(served: dict[str, Any], loaded: list[float]) -> dict[str, Any]:
    """Where the interactive requests' time went on the server (medians and p99s, ms), the
    background batch sizes meanwhile, and the client's latency the server never saw."""
    interactive = [t for t in served["timelines"] if t["class_name"] == "interactive"]
    background = [t for t in served["timelines"] if t["class_name"] != "interactive"]

    def ms(values: list[float], q: float) -> float:
        return float(np.percentile(values, q) * 1e3) if values else 0.0

    def span(t: dict[str, Any], a: str, b: str) -> float:
        return float((t[b] or t["answered_s"]) - (t[a] or t["arrived_s"]))

    stages = {
        "server_total": [t["answered_s"] - t["arrived_s"] for t in interactive],
        "queue": [span(t, "arrived_s", "batch_closed_s") for t in interactive],
        "replica_wait": [span(t, "batch_closed_s", "compute_started_s") for t in interactive],
        "compute": [span(t, "compute_started_s", "compute_ended_s") for t in interactive],
        "answer": [span(t, "compute_ended_s", "answered_s") for t in interactive],
    }
    out: dict[str, Any] = {f"{k}_p50_ms": ms(v, 50) for k, v in stages.items()}
    out |= {f"{k}_p99_ms": ms(v, 99) for k, v in stages.items()}
    out["client_p99_ms"] = ms(loaded, 99)
    out["interactive_batch_size_p50"] = float(np.median([t["batch_size"] for t in interactive]))
    out["background_batch_size_p50"] = float(np.median([t["batch_size"] for t in background]))
    out["num_interactive"] = len(interactive)
    return out


def _batch_sums(url: str) -> dict[str, float]:
    """The server's batch counters for `mlp`: items, batches and compute seconds so far."""
    wanted = {
        "carpool_batch_size_sum": "items",
        "carpool_batch_size_count": "batches",
        "carpool_batch_compute_seconds_sum": "compute_s",
    }
    sums = dict.fromkeys(wanted.values(), 0.0)
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted and s.labels.get("model") == "mlp":
                sums[wanted[s.name]] += s.value
    return sums


def _priority_round(
    url: str, name: str, policy: dict[str, Any], ceiling: float, duration_s: float, breakdown: bool
) -> dict[str, Any]:
    set_policy(url, W1.model, **policy)
    alone = _interactive(url, duration_s)
    served: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "bg.json"
        command = [
            "taskset", "-c", LOAD_CPU, sys.executable, "-m", "carpool.cli", "bench", url,
            "--model", "mlp", "--protocol", "kserve-binary", "--input-shape", "1,256",
            "--concurrency", "64", "--duration", f"{duration_s + 1:g}s", "--warmup", "1s",
            "--no-progress", "--json", str(report),
        ]  # fmt: skip
        background = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        time.sleep(1.5)  # its warm-up
        recorder = _timelines(url, duration_s, served) if breakdown else None
        first, started_s = _batch_sums(url), time.perf_counter()
        loaded = _interactive(url, duration_s)
        last, wall_s = _batch_sums(url), time.perf_counter() - started_s
        document = httpx.get(f"{url}/v2/models/mlp/policy", timeout=10.0).json()
        if recorder is not None:
            recorder.join(timeout=60)
        background.wait(timeout=120)
        summary = orjson.loads(report.read_bytes())["points"][0]["summary"]
    row: dict[str, Any] = {
        "interactive_alone_p99_ms": float(np.percentile(alone, 99) * 1e3),
        "interactive_loaded_p99_ms": float(np.percentile(loaded, 99) * 1e3),
        "background_rps": summary["rate_rps"],
        "background_over_ceiling": summary["rate_rps"] / ceiling,
        # Under load, every class's batches: their mean size and the share of the time
        # the model computed (the rest: HTTP work on the loop, or idle).
        "loaded_batch_mean": (last["items"] - first["items"])
        / max(1.0, last["batches"] - first["batches"]),
        "loaded_compute_share": (last["compute_s"] - first["compute_s"]) / wall_s,
    }
    if served:
        row["breakdown"] = _breakdown(served, loaded)
    if document.get("adaptive") is not None:  # what the controller had in force under load
        row["adaptive"] = document["adaptive"]
    print(f"priority {name}: {row}", flush=True)
    return row


def _concurrency_64(url: str, duration_s: float, repeats: int) -> dict[str, Any]:
    """Closed-loop concurrency 64: auto and fixed (64 within 2 ms) in turn, ``repeats``
    rounds; median req/s of each, and each round's."""
    policies = {"auto": W1.auto, "fixed": {"max_delay_s": 0.002, "max_batch_size": 64}}
    rounds: dict[str, list[float]] = {name: [] for name in policies}
    for _ in range(repeats):
        for name, policy in policies.items():
            set_policy(url, W1.model, **policy)
            point = goodput(url, W1, ["--concurrency", "64"], duration_s)
            rounds[name].append(point["rate_rps"])
    out: dict[str, Any] = {f"{name}_rps": float(np.median(r)) for name, r in rounds.items()}
    out["rounds"] = rounds
    return out


def _priorities(
    url: str, ceiling: float, duration_s: float, repeats: int = 1, breakdown: bool = False
) -> dict[str, Any]:
    """Fixed (64 within 2 ms) and auto, each without and with ``preempt``, alternating,
    ``repeats`` times; medians."""
    policies: dict[str, dict[str, Any]] = {
        "fixed": {"max_delay_s": 0.002, "max_batch_size": 64, "preempt": False},
        "auto": {"max_delay_s": "auto", "max_batch_size": 64, "preempt": False},
        "fixed_preempt": {"max_delay_s": 0.002, "max_batch_size": 64, "preempt": True},
        "auto_preempt": {"max_delay_s": "auto", "max_batch_size": 64, "preempt": True},
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
    for _ in range(repeats):
        for name, policy in policies.items():
            runs[name].append(_priority_round(url, name, policy, ceiling, duration_s, breakdown))
    out: dict[str, Any] = {}
    for name, rows in runs.items():
        keys = [k for k, v in rows[0].items() if isinstance(v, float)]
        out[name] = {k: float(np.median([r[k] for r in rows])) for k in keys}
        out[name]["runs"] = rows
    return out


@contextmanager
def serving(config_text: str) -> Iterator[str]:
    """`carpool serve` of ``config_text`` (policy updates allowed) on the server CPU, one
    thread; this process moves to the load CPU. Yields its URL; stops it after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "serve.yaml"
        config.write_text(config_text, encoding="utf-8")
        argv = [*carpool_serve(port, config=config), "--allow-policy-updates"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        server = subprocess.Popen(
            ["taskset", "-c", SERVER_CPU, *argv], env=env, stdout=subprocess.DEVNULL
        )
        try:
            wait_kserve_ready(url, server)
            os.sched_setaffinity(0, {int(LOAD_CPU)})
            yield url
        finally:
            server.terminate()
            server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="reduced grid, short points")
    parser.add_argument(
        "--only", choices=("priority", "c64"), help="only the priority classes, or concurrency 64"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of those two, or of the sweep with --sweep-only (medians)",
    )
    parser.add_argument("--breakdown", action="store_true", help="record server timelines")
    parser.add_argument(
        "--timeout-s", type=float, help="the sweep's settings all get this timeout_s (deadline)"
    )
    parser.add_argument(
        "--max-queue-time-s",
        type=queue_time_arg,
        help='the sweep\'s settings all get this max_queue_time_s ("auto" or seconds)',
    )
    parser.add_argument("--loads", help='only these loads of the sweep, by label ("c=1,day/night")')
    parser.add_argument(
        "--settings", help='only these settings (and auto), by name ("fixed 0 ms x 64,aimd")'
    )
    parser.add_argument("--sweep-only", action="store_true", help="no c64 or priority parts")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = with_bounds(W1, args.timeout_s, args.max_queue_time_s)
    only_loads = None if args.loads is None else args.loads.split(",")
    only_settings = None if args.settings is None else args.settings.split(",")
    if problem := unknown_names(work, args.quick, only_loads, only_settings):
        parser.error(problem)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected at least 1")
    priority_only = args.only == "priority"
    machine = machine_info()
    print(f"machine: {machine}")
    if args.sweep_only and args.repeats > 1:
        rounds = sweep_rounds(work, args.quick, args.repeats, only_loads, only_settings)
        record = {"machine": machine, "quick": args.quick, "slo_s": SLO_S}
        record |= {"max_queue_time_s": args.max_queue_time_s, "timeout_s": args.timeout_s}
        write_results(args.json or DEFAULT_JSON, record | rounds)
        return
    ceiling = offline_ceiling()
    print(f"offline W1 ceiling at batch 64 on cpu {SERVER_CPU}: {ceiling:.0f} items/s")
    with serving(CONFIG) as url:
        duration_s = 4.0 if args.quick else 20.0
        if priority_only:
            priorities = _priorities(url, ceiling, duration_s, args.repeats, args.breakdown)
            _report_priorities(args.json or PRIORITY_JSON, machine, ceiling, priorities)
            return
        if args.only == "c64":
            c64 = _concurrency_64(url, 3.0 if args.quick else 10.0, args.repeats)
            c64 |= {"auto_over_fixed": c64["auto_rps"] / c64["fixed_rps"]}
            c64 |= {"auto_over_ceiling": c64["auto_rps"] / ceiling}
            print(f"concurrency 64 (medians): {c64}", flush=True)
            record = {"machine": machine, "ceiling_items_per_s": ceiling, "c64": c64}
            write_results(args.json or C64_JSON, record)
            return
        capacity = measure_capacity(url, W1, args.quick)
        print(f"capacity over HTTP at concurrency 64: {capacity:.0f} req/s", flush=True)
        sweep = run_sweep(url, work, capacity, args.quick, only_loads, only_settings)
        set_policy(url, W1.model, **dict.fromkeys(work.base))  # the rest runs without them
        if args.sweep_only:
            print_sweep(sweep)
            record = {"machine": machine, "quick": args.quick, "slo_s": SLO_S}
            record |= {"max_queue_time_s": args.max_queue_time_s, "timeout_s": args.timeout_s}
            record |= {"capacity_rps": capacity, "sweep": sweep}
            write_results(args.json or DEFAULT_JSON, record)
            return
        # The two single-load targets: auto at concurrency 64 against the offline batch-64
        # ceiling, and its concurrency-1 p50 against the model's batch-1 time.
        c64 = _concurrency_64(url, 3.0 if args.quick else 10.0, args.repeats)
        # The ceiling again, minutes later (the server idle on its CPU): the machine's
        # speed drifts, so the ratios below divide by the larger of the two.
        ceilings = [ceiling, offline_ceiling()]
        ceiling = max(ceilings)
        print(f"offline ceiling again: {ceilings[1]:.0f} items/s; dividing by {ceiling:.0f}")
        batch1_s = 1.0 / offline_ceiling(batch_size=1)
        targets = {
            "auto_c64_rps": c64["auto_rps"],
            "auto_c64_over_ceiling": c64["auto_rps"] / ceiling,
            "fixed_c64_rps": c64["fixed_rps"],
            "auto_c64_over_fixed": c64["auto_rps"] / c64["fixed_rps"],
            "batch1_model_ms": batch1_s * 1e3,
            "auto_c1_p50_ms": sweep["table"]["auto"]["c=1"]["p50_ms"],
        }
        targets["auto_c1_p50_over_batch1_ms"] = targets["auto_c1_p50_ms"] - batch1_s * 1e3
        print(
            f"auto at concurrency 64: {c64['auto_rps']:.0f} req/s = "
            f"{targets['auto_c64_over_ceiling']:.2f} of the ceiling, "
            f"{targets['auto_c64_over_fixed']:.2f} of fixed 64 within 2 ms; concurrency 1 p50 "
            f"{targets['auto_c1_p50_ms']:.2f} ms against batch-1 model time "
            f"{targets['batch1_model_ms']:.2f} ms",
            flush=True,
        )
        priorities = _priorities(url, ceiling, duration_s, args.repeats, args.breakdown)
    print_sweep(sweep)
    write_results(
        args.json or DEFAULT_JSON,
        {
            "machine": machine,
            "quick": args.quick,
            "slo_s": SLO_S,
            "timeout_s": args.timeout_s,
            "max_queue_time_s": args.max_queue_time_s,
            "ceiling_items_per_s": ceiling,
            "ceilings_items_per_s": ceilings,
            "capacity_rps": capacity,
            "sweep": sweep,
            "targets": targets,
            "priorities": priorities,
        },
    )


def sweep_rounds(
    work: Workload,
    quick: bool,
    repeats: int,
    only_loads: list[str] | None,
    only_settings: list[str] | None,
) -> dict[str, Any]:
    """The sweep ``repeats`` times, each on a fresh server with its own capacity
    measurement; per load, each round's `auto` / best fixed and their median (one point
    under overload moves by tens of percent from round to round on this shared machine)."""
    rounds = []
    for i in range(repeats):
        with serving(CONFIG) as url:
            capacity = measure_capacity(url, W1, quick)
            print(f"round {i + 1}/{repeats}: capacity {capacity:.0f} req/s", flush=True)
            sweep = run_sweep(url, work, capacity, quick, only_loads, only_settings)
        print_sweep(sweep)
        rounds.append({"capacity_rps": capacity, "sweep": sweep})
    per_load: dict[str, Any] = {}
    for load in rounds[0]["sweep"]["per_load"]:
        ratios = [r["sweep"]["per_load"][load]["auto_over_best_fixed"] for r in rounds]
        per_load[load] = {"auto_over_best_fixed": ratios, "median": float(np.median(ratios))}
        print(
            f"{load:>13}: auto / best fixed, median of {repeats} rounds {np.median(ratios):.2f}"
            f" (rounds {', '.join(f'{x:.2f}' for x in ratios)})"
        )
    totals = [r["sweep"]["auto_over_single_fixed_total"] for r in rounds]
    print(f"whole sweep: auto / best single fixed, median {np.median(totals):.2f}")
    summary = {"per_load": per_load, "auto_over_single_fixed_total": totals}
    summary["auto_over_single_fixed_total_median"] = float(np.median(totals))
    return {"rounds": rounds, "medians": summary}


def print_sweep(sweep: dict[str, Any]) -> None:
    """Per load, auto against the best fixed setting, and the whole sweep's totals."""
    for load, row in sweep["per_load"].items():
        print(
            f"{load:>13}: auto / best fixed ({row['best_fixed']}) {row['auto_over_best_fixed']:.2f}"
            f"  auto / single fixed {row['auto_over_single_fixed']:.2f}"
            f"  aimd / single fixed {row['aimd_over_single_fixed']:.2f}"
        )
    print(
        f"whole sweep: auto / best single fixed ({sweep['best_single_fixed']}) "
        f"{sweep['auto_over_single_fixed_total']:.2f}; aimd "
        f"{sweep['aimd_over_single_fixed_total']:.2f}"
    )


def _report_priorities(
    path: Path, machine: dict[str, Any], ceiling: float, priorities: dict[str, Any]
) -> None:
    for name, row in priorities.items():
        print(
            f"{name:>13} (median of {len(row['runs'])}): interactive p99 alone "
            f"{row['interactive_alone_p99_ms']:.1f} ms, under load "
            f"{row['interactive_loaded_p99_ms']:.1f} ms; background "
            f"{row['background_rps']:.0f} req/s = {row['background_over_ceiling']:.2f} of ceiling"
        )
    record = {"machine": machine, "ceiling_items_per_s": ceiling, "priorities": priorities}
    write_results(path, record)


if __name__ == "__main__":
    main()
