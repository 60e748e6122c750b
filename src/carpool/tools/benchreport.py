"""How ``carpool bench`` shows and keeps its results: a live display, a table, JSON, CSV, plots.

The live display (rich) is redrawn by an asyncio task twice a second, never by a thread,
so it takes no time from the load generator beyond the redraw itself; it is off when
stderr is not a terminal or with ``--no-progress``. Plots (matplotlib, Agg backend):

* ``latency_vs_throughput.png`` — p50 and p99 against achieved req/s over the sweep;
* ``latency_cdf.png`` — one latency CDF per point;
* ``batch_sizes.png`` — the server's batch-size histogram per point.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import math
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from carpool.tools.bench_types import BenchConfig, PointResult
from carpool.tools.loadgen import Progress
from carpool.tools.summary import Percentiles

REFRESH_S = 0.5
CSV_COLUMNS = (
    "label", "mode", "concurrency", "offered_rate_rps", "rate_rps", "items_per_s",
    "tokens_per_s", "num_requests", "num_errors", "p50_ms", "p90_ms", "p99_ms", "p999_ms",
    "mean_ms", "max_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
    "num_behind_schedule", "max_lag_ms", "server_mean_batch_size", "server_fill_ratio",
    "server_effective_compute_ratio", "server_mean_queue_wait_ms", "server_mean_compute_ms",
)  # fmt: skip


class LiveProgress:
    """``async with LiveProgress(progress, label, duration_s, enabled=...)``: a rich
    status line (sent, done, errors, rate, recent p50) while a run goes on."""

    def __init__(self, progress: Progress, label: str, duration_s: float, *, enabled: bool):
        self._progress = progress
        self._label = label
        self._duration_s = duration_s
        self._enabled = enabled
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LiveProgress:
        if self._enabled:
            self._task = asyncio.get_running_loop().create_task(self._refresh())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _refresh(self) -> None:
        from rich.console import Console
        from rich.live import Live

        loop = asyncio.get_running_loop()
        started = loop.time()
        with Live(console=Console(stderr=True), auto_refresh=False, transient=True) as live:
            while True:
                await asyncio.sleep(REFRESH_S)
                live.update(self._line(loop.time() - started), refresh=True)

    def _line(self, elapsed_s: float) -> str:
        p = self._progress
        recent = sorted(p.recent_latency_s)
        p50 = recent[len(recent) // 2] * 1e3 if recent else float("nan")
        rate = p.num_done / elapsed_s if elapsed_s > 0 else 0.0
        return (
            f"{self._label}  {min(elapsed_s, self._duration_s):5.1f}/{self._duration_s:g} s  "
            f"sent {p.num_sent}  done {p.num_done}  errors {p.num_errors}  "
            f"{rate:,.0f} req/s  p50 {p50:.2f} ms"
        )


def _ms(value_s: float | None) -> float | None:
    return None if value_s is None else value_s * 1e3


def _pct(p: Percentiles | None, name: str) -> float | None:
    return None if p is None else _ms(getattr(p, name))


def flat_row(result: PointResult) -> dict[str, Any]:
    """One CSV row (and the table's cells): milliseconds, server figures prefixed."""
    s, server = result.summary, result.server
    return {
        "label": result.label,
        "mode": s.mode,
        "concurrency": s.concurrency,
        "offered_rate_rps": s.offered_rate_rps,
        "rate_rps": s.rate_rps,
        "items_per_s": s.items_per_s,
        "tokens_per_s": s.tokens_per_s,
        "num_requests": s.num_requests,
        "num_errors": s.num_errors,
        **{f"{q}_ms": _pct(s.latency, f"{q}_s") for q in ("p50", "p90", "p99", "p999")},
        "mean_ms": _pct(s.latency, "mean_s"),
        "max_ms": _pct(s.latency, "max_s"),
        "ttft_p50_ms": _pct(s.ttft, "p50_s"),
        "ttft_p99_ms": _pct(s.ttft, "p99_s"),
        "itl_p50_ms": _pct(s.itl, "p50_s"),
        "itl_p99_ms": _pct(s.itl, "p99_s"),
        "num_behind_schedule": s.num_behind_schedule,
        "max_lag_ms": _ms(s.max_lag_s),
        "server_mean_batch_size": server.mean_batch_size if server else None,
        "server_fill_ratio": server.fill_ratio if server else None,
        "server_effective_compute_ratio": server.effective_compute_ratio if server else None,
        "server_mean_queue_wait_ms": _ms(server.mean_queue_wait_s) if server else None,
        "server_mean_compute_ms": _ms(server.mean_compute_s) if server else None,
    }


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def text_table(results: list[PointResult]) -> str:
    """The summary printed at the end: one line per point, errors and lag underneath."""
    head = f"{'point':24} {'req/s':>9} {'items/s':>9} {'p50 ms':>8} {'p90 ms':>8} "
    head += f"{'p99 ms':>8} {'p99.9 ms':>8} {'errors':>6} {'behind':>7} {'batch':>6} {'fill':>5}"
    lines = [head]
    for result in results:
        row = flat_row(result)
        cells = [
            f"{result.label[:24]:24}",
            _cell(row["rate_rps"], "9.1f"),
            _cell(row["items_per_s"], "9.1f"),
            *(_cell(row[f"{q}_ms"], "8.2f") for q in ("p50", "p90", "p99", "p999")),
            _cell(row["num_errors"], "6d"),
            _cell(row["num_behind_schedule"], "7d"),
            _cell(row["server_mean_batch_size"], "6.1f"),
            _cell(row["server_fill_ratio"], "5.2f"),
        ]
        lines.append(" ".join(cells))
        s = result.summary
        if s.offered_rate_rps is not None:  # open loop: what was asked next to what came
            lines.append(
                f"  offered {s.offered_rate_rps:.1f} req/s, achieved {s.rate_rps:.1f} req/s"
            )
        if s.errors:
            lines.append(f"  errors: {', '.join(f'{k}: {n}' for k, n in s.errors.items())}")
        if s.num_behind_schedule:
            lines.append(
                f"  behind schedule: {s.num_behind_schedule} of {s.num_requests} sends started "
                f"over 1 ms late (max lag {s.max_lag_s * 1e3:.1f} ms); latency counts from "
                "the schedule"
            )
        if s.ttft is not None:  # one-token streams have a ttft and no inter-token gaps
            itl = (
                "itl -"
                if s.itl is None
                else f"itl p50 {s.itl.p50_s * 1e3:.2f} ms p99 {s.itl.p99_s * 1e3:.2f} ms"
            )
            lines.append(
                f"  ttft p50 {s.ttft.p50_s * 1e3:.2f} ms p99 {s.ttft.p99_s * 1e3:.2f} ms; "
                f"{itl}; {s.tokens_per_s:.1f} tokens/s"
            )
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """Where the client ran: platform, Python, CPU count and the CPUs it was pinned to."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
    }


def report_document(config: BenchConfig, results: list[PointResult]) -> dict[str, Any]:
    """The JSON document: config, machine, and per point its summary and server stats."""
    from carpool import __version__

    spec = config.spec
    return {
        "carpool_version": __version__,
        "command": " ".join(sys.argv),
        "target": spec.label,
        "config": spec.config,
        "protocol": spec.wire.value,
        "model": spec.model,
        "duration_s": config.duration_s,
        "warmup_s": config.warmup_s,
        "seed": config.seed,
        "machine": machine_info(),
        "points": [
            {
                "label": r.label,
                "summary": r.summary.to_dict(),
                "server": None if r.server is None else r.server.to_dict(),
            }
            for r in results
        ],
    }


def write_outputs(config: BenchConfig, results: list[PointResult]) -> None:
    """Write whichever of JSON, CSV and plots ``config`` asks for, and say where."""
    if config.json_path is not None:
        write_json(config.json_path, report_document(config, results))
    if config.csv_path is not None:
        write_csv(config.csv_path, results)
    if config.plots_dir is not None:
        for path in write_plots(config.plots_dir, results):
            print(f"wrote {path}")


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(document), indent=2, allow_nan=False) + "\n")
    print(f"wrote {path}")


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None: strict JSON has no place for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_csv(path: Path, results: list[PointResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for result in results:
            writer.writerow(flat_row(result))
    print(f"wrote {path}")


def write_plots(folder: Path, results: list[PointResult]) -> list[Path]:
    """The three PNGs (the batch-size one only when the server reported batches)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with _figure(plt, folder / "latency_vs_throughput.png", written) as ax:
        rows = [flat_row(r) for r in results if r.summary.latency is not None]
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot([w["rate_rps"] for w in rows], [w[f"{q}_ms"] for w in rows], style, label=q)
        for w in rows:
            ax.annotate(w["label"], (w["rate_rps"], w["p99_ms"]), fontsize=7)
        ax.set(xlabel="achieved req/s", ylabel="latency (ms)", title="Latency vs throughput")
        ax.legend()
    with _figure(plt, folder / "latency_cdf.png", written) as ax:
        for r in results:
            if r.latencies_s:
                n = len(r.latencies_s)
                ax.plot(
                    [v * 1e3 for v in r.latencies_s], [(i + 1) / n for i in range(n)], label=r.label
                )
        ax.set(xlabel="latency from scheduled send (ms)", ylabel="fraction", title="Latency CDF")
        ax.set_xscale("log")
        ax.legend(fontsize=7)
    with_batches = [r for r in results if r.server is not None and r.server.batch_size_counts]
    if with_batches:
        with _figure(plt, folder / "batch_sizes.png", written) as ax:
            width = 0.8 / len(with_batches)
            for i, r in enumerate(with_batches):
                assert r.server is not None
                labels = list(r.server.batch_size_counts)
                xs = [x + i * width for x in range(len(labels))]
                ax.bar(xs, list(r.server.batch_size_counts.values()), width, label=r.label)
                ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels)
            ax.set(
                xlabel="batch size (bucket upper bound)", ylabel="batches", title="Server batches"
            )
            ax.legend(fontsize=7)
    return written


@contextlib.contextmanager
def _figure(plt: Any, path: Path, written: list[Path]) -> Iterator[Any]:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        yield ax
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        written.append(path)
    finally:
        plt.close(fig)
