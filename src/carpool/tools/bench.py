"""``carpool bench TARGET``: load a served model (or a batched function) and report.

::

    carpool bench http://127.0.0.1:8000 --model mlp --concurrency 1,16,64 --duration 10s
    carpool bench http://127.0.0.1:8000 --model mlp --rate 500 --arrival poisson --json out.json
    carpool bench mypkg.models:encode --input-shape 4,256 --rate 200,400,800

Each point of the sweep (a concurrency, a rate, or one schedule or trace) runs a warm-up,
scrapes the server's ``/metrics``, runs the measured window, scrapes again, and sums up:
req/s, items/s, latency percentiles from the scheduled send time, errors by status, how
often the generator fell behind schedule, and the server's own batch statistics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from carpool.core.telemetry import TelemetrySnapshot
from carpool.errors import CarpoolError, ConfigError
from carpool.tools import benchreport
from carpool.tools.bench_types import BenchConfig, Point, PointResult
from carpool.tools.httpclient import HttpClient, split_url
from carpool.tools.loadgen import (
    Arrival,
    ArrivalProcess,
    LoadGenerator,
    RateStep,
    RunResult,
    Target,
    parse_duration,
    parse_schedule,
    read_trace,
)
from carpool.tools.outputs import writable_path
from carpool.tools.serverstats import ServerStats, stats_from_metrics, stats_from_snapshots
from carpool.tools.summary import summarize
from carpool.tools.targets import (
    InProcessTarget,
    TargetSpec,
    Wire,
    make_target,
    read_texts,
    resolve_target,
)

_TARGET_HELP = (
    "http://host:port, or module:attr (a batched callable, a factory taking device or no "
    "argument, a class, an nn.Module, a @carpool.batched function, a Batcher), or nothing "
    "with --config FILE --model NAME"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="carpool bench", description="Load a model server (or a batched function)."
    )
    p.add_argument("target", metavar="TARGET", nargs="?", help=_TARGET_HELP)
    p.add_argument("--model", metavar="NAME", help="model name on the server, or in --config")
    p.add_argument(
        "--config", metavar="FILE", help="run model --model of this serve config in-process"
    )
    p.add_argument("--protocol", default="kserve-binary", choices=[w.value for w in Wire])
    load = p.add_argument_group("load (closed loop: --concurrency; open loop: the others)")
    load.add_argument("--concurrency", help="closed-loop sweep, e.g. 1,16,64")
    load.add_argument("--rate", help="open-loop sweep in req/s, e.g. 100,200")
    load.add_argument("--arrival", default="poisson", choices=[a.value for a in Arrival])
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma gaps' CV² (1: Poisson)")
    load.add_argument("--schedule", help="rate schedule start:rate,..., e.g. 0:50,10s:200,20s:50")
    load.add_argument("--trace", help="file of send times, one float (seconds) per line")
    load.add_argument(
        "--duration", help="measured time per point (default 10s; a trace: its length)"
    )
    load.add_argument("--warmup", default="2s", help="unmeasured warm-up per point")
    load.add_argument("--seed", type=int, default=0, help="seeds arrivals and payloads")
    load.add_argument("--drain-timeout", default="30s", help="wait for late answers, then fail")
    load.add_argument("--max-connections", type=int, default=1024)
    data = p.add_argument_group("payload")
    data.add_argument("--input-shape", help="per request, items first, e.g. 1,256")
    data.add_argument("--dtype", help="KServe datatype of the inputs (FP32, INT64, ...)")
    data.add_argument("--texts", help="file of texts, one per line, rotated (OpenAI)")
    data.add_argument("--max-tokens", type=int, default=16, help="completions")
    data.add_argument("--no-stream", action="store_true", help="completions without SSE")
    out = p.add_argument_group("output")
    out.add_argument("--json", dest="json_path", help="write the results as JSON")
    out.add_argument("--csv", dest="csv_path", help="write one CSV row per point")
    out.add_argument("--plots", dest="plots_dir", help="write PNG plots to this folder")
    out.add_argument(
        "--html", dest="html_path", help="write one self-contained HTML report (plots inside)"
    )
    out.add_argument("--no-progress", action="store_true", help="no live display")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Check and convert the parsed flags. Raises ConfigError naming the flag."""
    spec = TargetSpec(
        target=args.target,
        wire=Wire(args.protocol),
        model=args.model,
        config=args.config,
        input_shape=_int_list(args.input_shape, "input-shape") if args.input_shape else None,
        datatype=args.dtype,
        texts=read_texts(args.texts),
        max_tokens=args.max_tokens,
        is_streaming=not args.no_stream,
        seed=args.seed,
        max_connections=args.max_connections,
    )
    if not spec.is_http or spec.config is not None:
        resolve_target(spec)  # a model named in no form: a bad flag, before any request
    points = _points(args)
    if args.duration is not None:
        duration_s = parse_duration(args.duration)
    elif points[0].trace is not None:
        duration_s = float(points[0].trace[-1]) + 1e-9
        if duration_s < MIN_TRACE_S:  # every request at once: no span to take rates over
            raise ConfigError(
                "trace", args.trace, f"send times spanning {MIN_TRACE_S:g} s or more, or --duration"
            )
    else:
        duration_s = 10.0
    if duration_s <= 0:
        raise ConfigError("duration", args.duration, "a duration above 0")
    return BenchConfig(
        spec=spec,
        points=points,
        duration_s=duration_s,
        warmup_s=parse_duration(args.warmup, "warmup"),
        seed=args.seed,
        drain_timeout_s=parse_duration(args.drain_timeout, "drain-timeout"),
        json_path=writable_path("json", args.json_path),
        csv_path=writable_path("csv", args.csv_path),
        plots_dir=_plots_dir(args.plots_dir),
        show_progress=not args.no_progress and sys.stderr.isatty(),
        html_path=writable_path("html", args.html_path),
    )


def _plots_dir(value: str | None) -> Path | None:
    """``--plots``, checked before the run (a file in the way, a folder that cannot be
    written): after it, the figures and the HTML report written after them were lost."""
    if not value:
        return None
    writable_path("plots", Path(value) / "latency_cdf.png")
    return Path(value)


def _points(args: argparse.Namespace) -> tuple[Point, ...]:
    modes = [name for name in ("concurrency", "rate", "schedule", "trace") if getattr(args, name)]
    if len(modes) > 1:
        raise ConfigError("load", modes, "only one of --concurrency, --rate, --schedule, --trace")
    arrival = Arrival(args.arrival)
    if args.rate:
        return tuple(
            Point(f"rate={r:g}", arrivals=ArrivalProcess.steady(r, arrival, args.burstiness))
            for r in _float_list(args.rate, "rate")
        )
    if args.schedule:
        process = ArrivalProcess(arrival, parse_schedule(args.schedule), args.burstiness)
        return (Point(f"schedule={args.schedule}", arrivals=process),)
    if args.trace:
        return (Point(f"trace={args.trace}", trace=read_trace(args.trace)),)
    levels = _int_list(args.concurrency or "1", "concurrency")
    return tuple(Point(f"concurrency={c}", concurrency=c) for c in levels)


def _int_list(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ConfigError(name, text, "comma-separated integers >= 1, e.g. 1,16,64")
    return values


def _float_list(text: str, name: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ConfigError(name, text, "comma-separated numbers above 0, e.g. 100,200")
    return values


async def run_bench(config: BenchConfig) -> list[PointResult]:
    """Every point of ``config`` against one opened target, in order."""
    target = make_target(config.spec)
    await target.open()
    try:
        results = []
        for number, point in enumerate(config.points):
            rng = np.random.default_rng(config.seed + number)
            results.append(await _run_point(config, target, point, rng))
        return results
    finally:
        await target.close()


# A full collection is never due while a point runs (its threshold is out of reach).
_NO_FULL_COLLECTION = 1 << 30
# A trace's shortest span without --duration (and what its warm-up rate is taken over):
# send times all at 0 gave a run of 1 ns, billions of requests a second offered, and a
# warm-up flood at the same rate.
MIN_TRACE_S = 0.1


@contextlib.contextmanager
def full_collections_held() -> Iterator[None]:
    """Collect once and freeze what is alive, then let no full (oldest-generation)
    collection run until the block ends; young ones still run, so short-lived cycles
    are still freed. A full collection walks every object the process holds (the
    records of the run so far, and torch's when the benchmark measured a model
    in-process): in the load generator it stalled the event loop for about 100 ms in
    the middle of a point, every send due meanwhile left late, and the latency counted
    from the scheduled time (as it must be) charged that stall to the server."""
    young, middle, old = gc.get_threshold()
    was_frozen = gc.get_freeze_count() > 0  # someone froze on purpose: leave it so
    gc.collect()
    gc.freeze()
    gc.set_threshold(young, middle, _NO_FULL_COLLECTION)
    try:
        yield
    finally:
        gc.set_threshold(young, middle, old)
        if not was_frozen:
            gc.unfreeze()


async def _run_point(
    config: BenchConfig, target: Target, point: Point, rng: np.random.Generator
) -> PointResult:
    with full_collections_held():
        if config.warmup_s > 0:
            # Its own stream: the measured schedule for a seed is the same whatever the warm-up.
            [warm_rng] = rng.spawn(1)
            warm = LoadGenerator(target, drain_timeout_s=config.drain_timeout_s)
            await _drive(warm, config, point, config.warmup_s, warm_rng, is_warmup=True)
        before = await _server_state(config, target)
        generator = LoadGenerator(target, drain_timeout_s=config.drain_timeout_s)
        async with benchreport.LiveProgress(
            generator.progress, point.label, config.duration_s, enabled=config.show_progress
        ):
            result = await _drive(generator, config, point, config.duration_s, rng)
        after = await _server_state(config, target)
        server = _server_stats(config, before, after)
        latencies = sorted(r.latency_s for r in result.records if r.error is None)
        return PointResult(point.label, summarize(result), server, latencies)


async def _drive(
    generator: LoadGenerator,
    config: BenchConfig,
    point: Point,
    duration_s: float,
    rng: np.random.Generator,
    *,
    is_warmup: bool = False,
) -> RunResult:
    if point.concurrency is not None:
        return await generator.run_closed(point.concurrency, duration_s)
    if point.arrivals is not None:
        arrivals = point.arrivals
        if is_warmup:  # warm up at the first rate above 0 of a schedule, in the same shape
            first = next(s for s in arrivals.steps if s.rate_rps > 0)
            steps = (RateStep(0.0, first.rate_rps),)
            arrivals = ArrivalProcess(arrivals.arrival, steps, arrivals.burstiness)
        return await generator.run_open(arrivals.send_times(duration_s, rng), duration_s)
    assert point.trace is not None
    trace = point.trace
    if is_warmup:  # the trace's mean rate over its span (MIN_TRACE_S at least), Poisson
        rate = len(trace) / max(float(trace[-1]), MIN_TRACE_S)
        return await generator.run_open(
            ArrivalProcess.steady(rate, Arrival.POISSON).send_times(duration_s, rng), duration_s
        )
    return await generator.run_open(trace[trace < duration_s], duration_s)


async def _server_state(config: BenchConfig, target: Target) -> str | TelemetrySnapshot | None:
    """The server's /metrics text (HTTP) or the batcher's snapshot (in-process)."""
    if isinstance(target, InProcessTarget):
        return target.snapshot()
    host, port, prefix = split_url(config.spec.label)
    client = HttpClient(host, port, max_connections=1)
    try:
        response = await client.get(prefix + "/metrics")
    except OSError:
        return None
    finally:
        await client.close()
    return response.body.decode("utf-8", "replace") if response.status == 200 else None


def _server_stats(
    config: BenchConfig,
    before: str | TelemetrySnapshot | None,
    after: str | TelemetrySnapshot | None,
) -> ServerStats | None:
    if isinstance(before, str) and isinstance(after, str):
        try:
            return stats_from_metrics(before, after, config.spec.model or "")
        except ValueError:  # not a Prometheus exposition
            return None
    if isinstance(before, TelemetrySnapshot) and isinstance(after, TelemetrySnapshot):
        return stats_from_snapshots(before, after)
    return None


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``carpool bench``; exits 2 on a bad flag, 1 when the target fails."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        spec = config.spec
        if spec.is_http and spec.model is None:  # a flag missing: 2, before any request
            raise ConfigError("model", None, f"a model name (--model) for {spec.wire.value}")
    except CarpoolError as error:
        print(f"carpool bench: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    runner = _event_loop_runner()
    try:
        results = runner(run_bench(config))
    except (CarpoolError, OSError) as error:
        print(f"carpool bench: {config.spec.label}: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print(benchreport.text_table(results))
    benchreport.write_outputs(config, results)
    if config.html_path is not None:
        from carpool.tools.report import bench_html, write_html

        write_html(config.html_path, bench_html(config, results))


def _event_loop_runner() -> Any:
    try:
        import uvloop
    except ImportError:  # the tools extra is optional: the standard loop works, slower
        return asyncio.run
    return uvloop.run
