"""Self-contained HTML reports: ``carpool bench ... --html report.html`` (and, through
:mod:`carpool.tools.report_tune`, ``carpool tune ... --html``).

One file a person can mail or attach to an issue: the plots are PNGs embedded as
``data:`` URIs, the styles inline, nothing fetched when it opens. The bench report holds
the latency-throughput curve, the latency CDF and the server's batch-size distribution
(the same plots as ``--plots``, :func:`carpool.tools.benchreport.write_plots`), and a
table of every point of the sweep.
"""

from __future__ import annotations

import base64
import html
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from carpool.tools.bench_types import BenchConfig, PointResult
from carpool.tools.benchreport import flat_row, machine_info, write_plots

STYLE = (
    "body{font-family:sans-serif;max-width:72em;margin:1em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:0.5em 0}"
    "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
    "th{background:#f3f3f3}figure{margin:1em 0}figcaption{color:#555;font-size:90%}"
    "img{max-width:100%}"
)
# What each plot of --plots shows, as the report's captions.
BENCH_PLOTS = {
    "latency_vs_throughput.png": "Latency against throughput: p50 and p99 at each point",
    "latency_cdf.png": "Latency CDF of each point (from the scheduled send time)",
    "batch_sizes.png": "Batch-size distribution on the server, per point",
}
_TABLE_COLUMNS = (
    ("label", "point", "{}"),
    ("rate_rps", "req/s", "{:,.1f}"),
    ("items_per_s", "items/s", "{:,.1f}"),
    ("p50_ms", "p50 ms", "{:.2f}"),
    ("p99_ms", "p99 ms", "{:.2f}"),
    ("p999_ms", "p99.9 ms", "{:.2f}"),
    ("num_errors", "errors", "{}"),
    ("server_mean_batch_size", "mean batch", "{:.1f}"),
    ("server_fill_ratio", "fill", "{:.2f}"),
    ("server_mean_queue_wait_ms", "queue ms", "{:.2f}"),
    ("server_mean_compute_ms", "compute ms", "{:.2f}"),
)


def png_data_uri(path: Path) -> str:
    """``path``'s PNG as a ``data:`` URI, for an ``<img src>``."""
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def figure_html(path: Path, caption: str, plot_id: str) -> str:
    """A ``<figure>`` embedding the PNG at ``path``; ``plot_id`` names it in the DOM."""
    return (
        f"<figure class='plot' id='{html.escape(plot_id)}'>"
        f"<img src='{png_data_uri(path)}' alt='{html.escape(caption)}'>"
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def table_html(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def page(title: str, body: list[str]) -> str:
    """A whole HTML document: ``body`` is HTML already escaped."""
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        + "\n".join(body)
        + "</body></html>\n"
    )


def write_html(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None or value != value else spec.format(value)


def bench_html(config: BenchConfig, results: list[PointResult]) -> str:
    """The bench report of ``results``: what ran, on what, the table and the plots."""
    spec = config.spec
    machine = machine_info()
    body = [
        f"<h1>carpool bench: {html.escape(spec.label)}</h1>",
        "<p>"
        + html.escape(
            f"model {spec.model or '-'} over {spec.wire.value}; {len(results)} points of "
            f"{config.duration_s:g} s each after {config.warmup_s:g} s of warm-up; seed "
            f"{config.seed}. Client: {machine['platform']}, Python {machine['python']}, "
            f"{machine['cpu_count']} CPUs."
        )
        + "</p>",
        "<h2>Points</h2>",
        table_html(
            (title for _, title, _ in _TABLE_COLUMNS),
            (
                [_cell(row[key], spec_) for key, _, spec_ in _TABLE_COLUMNS]
                for row in (flat_row(r) for r in results)
            ),
        ),
        "<h2>Plots</h2>",
    ]
    with tempfile.TemporaryDirectory(prefix="carpool-report-") as folder:
        for path in write_plots(Path(folder), results):
            body.append(figure_html(path, BENCH_PLOTS[path.name], path.stem))
    return page(f"carpool bench: {spec.label}", body)
