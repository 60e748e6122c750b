"""What ``carpool top`` draws: a pure function of a :class:`TopState` (no network, no
terminal), so a test renders any state at any width.

    ┌ carpool top  http://127.0.0.1:8000  3 models  sort: name ┐
    │ model   kind  req/s  batch  fill  compute  queue  p99  rej/s │  one row a model
    └──────────────────────────────────────────────────────────────┘
    ┌ the selected model ─────────────────────────────────────────┐
    │ batch sizes (a bar a size) │ classes: queue, p50/p99 vs SLO │
    │ replicas: busy, balance    │ memory, controller, slowest    │
    │ generation: running/waiting, KV, prefix hits, TTFT, ITL     │
    └──────────────────────────────────────────────────────────────┘
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from carpool.server.dashboard_samples import Sample

SORT_KEYS = ("name", "requests/s", "p99")
HELP = "q quit · ↑/↓ pick a model · s sort (name, requests/s, p99) · ? help"


@dataclass(frozen=True, slots=True)
class ModelView:
    """One model: its live document (server/live.py) and the last second's ``rates``."""

    name: str
    document: dict[str, Any]
    rates: Sample


@dataclass(frozen=True, slots=True)
class TopState:
    """Everything one frame shows. ``error``: why the last fetch failed (the frame says
    reconnecting and keeps the last figures). ``adaptive``: the controller's gauges by
    model, when the server exports them (``carpool_adaptive_*`` in /metrics)."""

    url: str
    models: tuple[ModelView, ...] = ()
    selected: int = 0
    sort_key: str = "name"
    show_help: bool = False
    error: str | None = None
    adaptive: dict[str, dict[str, float]] = field(default_factory=dict)


def _worst_p99(view: ModelView) -> float:
    values = [c["p99_s"] for c in view.document["classes"] if c["p99_s"] is not None]
    if view.document["generation"] is not None:
        values.append(view.document["generation"]["ttft"]["p99_s"] or 0.0)
    return max(values, default=0.0)


def sorted_models(models: tuple[ModelView, ...], sort_key: str) -> tuple[ModelView, ...]:
    """The models in the order the frame lists them (``sort_key``: one of SORT_KEYS)."""
    if sort_key == "requests/s":
        return tuple(sorted(models, key=lambda v: -(v.rates.get("requests_per_s") or 0.0)))
    if sort_key == "p99":
        return tuple(sorted(models, key=lambda v: -_worst_p99(v)))
    return tuple(sorted(models, key=lambda v: v.name))


def _num(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _ms(value_s: float | str | None) -> str:
    if isinstance(value_s, str):  # a policy field set to "auto" (adaptive batching)
        return value_s
    return "-" if value_s is None else f"{value_s * 1e3:.1f}ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _bar(fraction: float, width: int = 12) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "·" * (width - filled)


# The summary's columns, by importance: a narrow terminal keeps the first ones that fit.
COLUMNS = ("model", "req/s", "batch", "p99", "queue", "fill", "compute", "rej/s")
_COLUMN_WIDTH = 9


def render(state: TopState, width: int = 120) -> RenderableType:
    """The whole frame for ``state`` on a terminal ``width`` columns wide."""
    models = sorted_models(state.models, state.sort_key)
    title = f"carpool top  {state.url}  {len(models)} model(s)  sort: {state.sort_key}"
    parts: list[RenderableType] = []
    if state.error is not None:
        parts.append(Text(f"reconnecting... ({state.error})", style="bold red"))
    parts.append(_summary(models, state.selected, width))
    if models:
        chosen = models[min(state.selected, len(models) - 1)]
        parts.append(_detail(chosen, state.adaptive.get(chosen.name, {})))
    parts.append(Text(HELP if state.show_help else "? help  q quit", style="dim"))
    return Panel(Group(*parts), title=title, title_align="left")


def _summary(models: tuple[ModelView, ...], selected: int, width: int) -> Table:
    longest = max((len(v.name) for v in models), default=5)
    fit = max(1, 1 + (width - 4 - longest) // _COLUMN_WIDTH)
    columns = COLUMNS[:fit]
    table = Table(expand=True, box=None, pad_edge=False)
    for name in columns:
        table.add_column(name, justify="left" if name == "model" else "right", no_wrap=True)
    for i, view in enumerate(models):
        d, r = view.document, view.rates
        cells = {
            "model": view.name,
            "req/s": _num(r.get("requests_per_s")),
            "batch": _num(r.get("mean_batch_size") or r.get("running")),
            "p99": _ms(_worst_p99(view) or None),
            "queue": str(d["num_pending"]),
            "fill": _pct(d["fill_ratio"]),
            "compute": _pct(d["effective_compute_ratio"]),
            "rej/s": _num(r.get("rejections_per_s")),
        }
        table.add_row(*(cells[c] for c in columns), style="reverse" if i == selected else None)
    return table


def _detail(view: ModelView, adaptive: dict[str, float]) -> Panel:
    d = view.document
    parts: list[RenderableType] = []
    if d["kind"] == "generation":  # its batches: the engine's steps
        parts += [_sizes(d), _generation(d["generation"], view.rates)]
    else:
        parts += [_sizes(d), _classes(d), _replicas(d, view.rates)]
        parts.append(_controller(d, adaptive))
        if d["memory"] is not None:
            m = d["memory"]
            parts.append(
                Text(
                    f"memory: peak {m['peak_bytes'] / 2**20:.0f} MiB of "
                    f"{m['total_bytes'] / 2**20:.0f} MiB, volatility {_pct(m['volatility'])}"
                )
            )
        parts.append(_slowest(d["slowest"]))
    return Panel(Group(*parts), title=f"{view.name} ({d['kind']})", title_align="left")


def _sizes(d: dict[str, Any]) -> RenderableType:
    sizes = {int(k): v for k, v in d["batch_sizes"].items()}
    if not sizes:
        return Text("batch sizes: no batch yet")
    table = Table(title="batch sizes since start", box=None, title_justify="left")
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("batches", justify="right", no_wrap=True)
    table.add_column("", no_wrap=True, overflow="crop")
    most = max(sizes.values())
    shown = sorted(sizes.items())
    if len(shown) > 12:  # the 12 most frequent, in size order
        shown = sorted(sorted(shown, key=lambda kv: -kv[1])[:12])
    for size, count in shown:
        table.add_row(str(size), str(count), _bar(count / most, 20))
    return table


def _classes(d: dict[str, Any]) -> Table:
    table = Table(title="classes", box=None, title_justify="left")
    for name in ("class", "queue", "p50", "p99", "SLO", "met", "rejections"):
        table.add_column(name, justify="left" if name in ("class", "rejections") else "right")
    for c in d["classes"]:
        rejected = ", ".join(f"{k} {n}" for k, n in c["rejections"].items() if n) or "-"
        slo, p99 = c["slo_s"], c["p99_s"]
        late = slo is not None and p99 is not None and p99 > slo
        table.add_row(
            c["name"],
            str(c["num_pending"]),
            _ms(c["p50_s"]),
            Text(_ms(p99), style="bold red" if late else ""),
            _ms(slo),
            _pct(c["slo_attainment"]),
            rejected,
        )
    return table


def _replicas(d: dict[str, Any], rates: Sample) -> RenderableType:
    lines = []
    for r in d["replicas"]:
        busy = rates.get(f"busy:{r['replica_id']}")
        busy = r["busy_fraction"] if busy is None else busy
        lines.append(f"replica {r['replica_id']} ({r['device']}) {_bar(busy)} {_pct(busy)} busy")
    balance = rates.get("balance", d["replica_balance"])
    lines.append(f"balance {_num(balance, 2)} (least busy / most busy; 1 is even)")
    return Text("\n".join(lines))


def _controller(d: dict[str, Any], adaptive: dict[str, float]) -> Text:
    line = f"policy: max batch {d['max_batch_size']}, max delay {_ms(d['max_delay_s'])}"
    if adaptive:
        delay, size = adaptive.get("delay_s"), adaptive.get("batch_size")
        line += f"  adaptive: delay {_ms(delay)}, batch size {_num(size, 0)}"
    return Text(line)


def _slowest(slow: dict[str, Any] | None) -> Text:
    if slow is None:
        return Text("slowest request (last 10 s): none yet")
    queue_s = slow["queue_s"] + slow["replica_wait_s"]
    # The parts sum to the total: answering too (long when the event loop is saturated).
    return Text(
        f"slowest request (last 10 s): {_ms(slow['total_s'])} [{slow['class']}] = "
        f"queue {_ms(queue_s)} + waiting for the batch to fill {_ms(slow['fill_wait_s'])} "
        f"+ compute {_ms(slow['compute_s'])} + answering {_ms(slow.get('answer_s'))} "
        f"(batch of {slow['batch_size']} on replica {slow['replica_id']})"
    )


def _generation(g: dict[str, Any], rates: Sample) -> Table:
    table = Table(box=None, show_header=False)
    table.add_column("figure", no_wrap=True)
    table.add_column("value", justify="right")
    rows = [
        ("running sequences", str(g["num_running"])),
        ("waiting sequences", str(g["num_waiting"])),
        ("KV blocks in use", _pct(g["kv_cache_usage"])),
        ("prefix-cache hit rate", _pct(g["prefix_cache_hit_rate"])),
        ("tokens/s", _num(rates.get("tokens_per_s"))),
        ("TTFT p50 / p99", f"{_ms(g['ttft']['p50_s'])} / {_ms(g['ttft']['p99_s'])}"),
        ("ITL p50 / p99", f"{_ms(g['itl']['p50_s'])} / {_ms(g['itl']['p99_s'])}"),
        ("preemptions", str(g["num_preemptions"])),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
