"""The tuning report (markdown and the same in HTML) and the recommended ``carpool serve``
config.

The report is a list of blocks (heading, paragraph, table, image, code) rendered twice, so
the two files say the same. Plots use matplotlib's Agg backend::

    report/
      tune.md  tune.html
      pareto.png                     throughput vs p99 of every trial, the front, the SLO
      heatmap_throughput.png         over max_delay_s x max_batch_size, when both searched
      heatmap_p99.png
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml  # type: ignore[import-untyped]

from carpool.config import load_config, parse_config
from carpool.errors import ConfigError
from carpool.tools.tune import TrialResult, TuneOutcome, policy_values, rank_key

# NumPy dtype names as KServe v2 datatypes (the ones a sample output is likely to have).
_DATATYPES = {
    "float32": "FP32",
    "float64": "FP64",
    "float16": "FP16",
    "int64": "INT64",
    "int32": "INT32",
    "int8": "INT8",
    "uint8": "UINT8",
    "bool": "BOOL",
}


@dataclass(frozen=True, slots=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True, slots=True)
class Paragraph:
    text: str


@dataclass(frozen=True, slots=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, slots=True)
class Image:
    path: str
    alt: str


@dataclass(frozen=True, slots=True)
class Code:
    text: str
    language: str = ""


Block = Heading | Paragraph | Table | Image | Code


def pareto_front(results: list[TrialResult]) -> list[TrialResult]:
    """Trials no other trial beats on both throughput (higher) and p99 (lower), by p99."""
    measured = [r for r in results if r.measurement.error is None and r.measurement.p99_s > 0]
    front = [
        r
        for r in measured
        if not any(
            o.objective >= r.objective
            and o.measurement.p99_s <= r.measurement.p99_s
            and (o.objective > r.objective or o.measurement.p99_s < r.measurement.p99_s)
            for o in measured
        )
    ]
    return sorted(front, key=lambda r: r.measurement.p99_s)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.2f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def _trial_row(r: TrialResult, names: list[str]) -> tuple[str, ...]:
    m = r.measurement
    values = r.config.as_dict()
    memory = "-" if m.memory_bytes is None else f"{m.memory_bytes / 2**20:.0f}"
    verdict = "yes" if r.is_feasible else "; ".join(r.violations)
    return (
        str(r.trial_id),
        r.stage,
        *(str(values[n]) for n in names),
        _num(r.objective),
        _ms(m.p50_s),
        _ms(m.p99_s),
        _num(m.mean_batch_size),
        memory,
        str(m.num_windows),
        _num(m.spread * 100 if m.spread == m.spread else None),
        verdict,
    )


def report_blocks(outcome: TuneOutcome, target: str, images: dict[str, str]) -> list[Block]:
    """The report's content; ``images`` maps plot kinds to their file names."""
    names = outcome.space.names
    unit = "req/s" if outcome.objective == "throughput" else "items/s"
    best = outcome.best
    blocks: list[Block] = [
        Heading(f"carpool tune: {target}", 1),
        Paragraph(
            f"Search **{outcome.strategy}** over {outcome.space.size} configurations "
            f"({', '.join(f'{p.name} in {list(p.values)}' for p in outcome.space.params)}); "
            f"{len(outcome.results)} trials. Objective: most {unit} with p99 <= "
            f"{outcome.constraints.slo_p99_s * 1e3:g} ms"
            + (
                f" and memory <= {outcome.constraints.memory_budget_bytes / 2**20:.0f} MiB."
                if outcome.constraints.memory_budget_bytes is not None
                else "."
            )
        ),
        Heading("Recommendation"),
    ]
    if best is None:
        blocks.append(Paragraph("No trial met the constraints: relax the SLO or add capacity."))
    else:
        m = best.measurement
        blocks.append(
            Paragraph(
                f"**{best.config.label()}**: {_num(best.objective)} {unit}, p50 "
                f"{_ms(m.p50_s)} ms, p99 {_ms(m.p99_s)} ms, mean batch "
                f"{_num(m.mean_batch_size)} (trial {best.trial_id})."
            )
        )
    header = (
        "#",
        "stage",
        *names,
        unit,
        "p50 ms",
        "p99 ms",
        "batch",
        "MiB",
        "windows",
        "spread %",
        "feasible",
    )
    blocks += [
        Heading("Trials"),
        Table(header, tuple(_trial_row(r, names) for r in outcome.results)),
        Heading("Pareto front (throughput vs p99)"),
        Table(
            ("#", "config", unit, "p99 ms", "within SLO"),
            tuple(
                (
                    str(r.trial_id),
                    r.config.label(),
                    _num(r.objective),
                    _ms(r.measurement.p99_s),
                    "yes" if r.is_feasible else "no",
                )
                for r in pareto_front(outcome.results)
            ),
        ),
    ]
    if "pareto" in images:
        blocks.append(Image(images["pareto"], "throughput vs p99 latency of every trial"))
    if "heatmap_throughput" in images:
        blocks += [
            Heading("max_delay_s x max_batch_size"),
            Paragraph("Each cell: the best trial at that point (other parameters free)."),
            Image(images["heatmap_throughput"], "throughput heatmap"),
            Image(images["heatmap_p99"], "p99 latency heatmap"),
        ]
    if outcome.effects is not None and outcome.design is not None:
        blocks += [
            Heading(f"Main effects ({outcome.design.array.name})"),
            Paragraph(
                f"Mean {unit} at each level (infeasible runs count as 0); rank 1 matters most."
                + ("" if outcome.design.is_exact else " Dummy levels: nearly orthogonal.")
            ),
            Table(
                ("factor", "level means", "delta", "rank", "best level", "S/N dB per level"),
                tuple(
                    (
                        e.factor,
                        ", ".join(
                            f"{v}: {_num(x)}"
                            for v, x in zip(
                                outcome.space.params[i].values, e.level_means, strict=False
                            )
                        ),
                        _num(e.delta),
                        str(e.rank),
                        str(outcome.space.params[i].values[e.best_level]),
                        ", ".join(_num(s) for s in e.sn_db or ()),
                    )
                    for i, e in enumerate(outcome.effects)
                ),
            ),
        ]
    return blocks


def render_markdown(blocks: list[Block]) -> str:
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"{'#' * b.level} {b.text}")
        elif isinstance(b, Paragraph):
            out.append(b.text)
        elif isinstance(b, Table):
            out.append("| " + " | ".join(b.header) + " |")
            out.append("|" + "---|" * len(b.header))
            out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in b.rows]
        elif isinstance(b, Image):
            out.append(f"![{b.alt}]({b.path})")
        else:
            out.append(f"```{b.language}\n{b.text.rstrip()}\n```")
        out.append("")
    return "\n".join(out)


def _inline_html(text: str) -> str:
    parts = html.escape(text).split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))


def render_html(blocks: list[Block], title: str) -> str:
    out = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
        "</title><style>body{font-family:sans-serif;max-width:70em;margin:auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}"
        "</style></head><body>"
    ]
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"<h{b.level}>{html.escape(b.text)}</h{b.level}>")
        elif isinstance(b, Paragraph):
            out.append(f"<p>{_inline_html(b.text)}</p>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{html.escape(h)}</th>" for h in b.header)
            rows = "".join(
                "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                for row in b.rows
            )
            out.append(f"<table><tr>{head}</tr>{rows}</table>")
        elif isinstance(b, Image):
            out.append(f"<p><img src='{html.escape(b.path)}' alt='{html.escape(b.alt)}'></p>")
        else:
            out.append(f"<pre>{html.escape(b.text)}</pre>")
    out.append("</body></html>")
    return "\n".join(out)


def plot_pareto(outcome: TuneOutcome, path: Path) -> None:
    """Throughput against p99 of every trial, the Pareto front and the SLO, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    measured = [r for r in outcome.results if r.measurement.error is None]
    for feasible, color in ((True, "tab:green"), (False, "tab:red")):
        pts = [r for r in measured if r.is_feasible == feasible]
        ax.scatter(
            [r.measurement.p99_s * 1e3 for r in pts],
            [r.objective for r in pts],
            c=color,
            s=18,
            label="within SLO" if feasible else "violates",
        )
    front = pareto_front(outcome.results)
    ax.plot(
        [r.measurement.p99_s * 1e3 for r in front],
        [r.objective for r in front],
        "k--",
        lw=1,
        label="Pareto front",
    )
    ax.axvline(outcome.constraints.slo_p99_s * 1e3, color="gray", lw=1, label="SLO")
    ax.set_xlabel("p99 latency (ms)")
    ax.set_ylabel("req/s" if outcome.objective == "throughput" else "items/s")
    ax.set_xscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heatmaps(outcome: TuneOutcome, folder: Path) -> dict[str, str]:
    """Throughput and p99 over max_delay_s x max_batch_size into ``folder``; returns
    ``{"heatmap_throughput": file name, "heatmap_p99": file name}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    space = outcome.space
    names = space.names
    di, bi = names.index("max_delay_s"), names.index("max_batch_size")
    delays, sizes = space.params[di].values, space.params[bi].values
    best: dict[tuple[int, int], TrialResult] = {}
    for r in outcome.results:  # later stages (longer trials) replace earlier ones
        key = (r.index[di], r.index[bi])
        if key not in best or best[key].index == r.index or rank_key(r) < rank_key(best[key]):
            best[key] = r
    out = {}
    metrics: tuple[tuple[str, str, Callable[[TrialResult], float]], ...] = (
        ("throughput", "req/s", lambda r: r.objective),
        ("p99", "p99 ms", lambda r: r.measurement.p99_s * 1e3),
    )
    for kind, label, value in metrics:
        grid = np.full((len(sizes), len(delays)), np.nan)
        for (d, b), r in best.items():
            grid[b, d] = value(r)
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
        for (b, d), v in np.ndenumerate(grid):
            if not math.isnan(v):
                ax.text(
                    d,
                    b,
                    f"{v:.0f}" if v >= 10 else f"{v:.1f}",
                    ha="center",
                    va="center",
                    color="w",
                    fontsize=7,
                )
        ax.set_xticks(range(len(delays)), [str(d) for d in delays])
        ax.set_yticks(range(len(sizes)), [str(s) for s in sizes])
        ax.set_xlabel("max_delay_s")
        ax.set_ylabel("max_batch_size")
        ax.set_title(label)
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        name = f"heatmap_{kind}.png"
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        out[f"heatmap_{kind}"] = name
    return out


def write_report(outcome: TuneOutcome, folder: Path, target: str) -> Path:
    """Write ``tune.md``, ``tune.html`` and the plots into ``folder``; returns the markdown."""
    folder.mkdir(parents=True, exist_ok=True)
    images: dict[str, str] = {}
    if any(r.measurement.error is None for r in outcome.results):
        plot_pareto(outcome, folder / "pareto.png")
        images["pareto"] = "pareto.png"
    if {"max_delay_s", "max_batch_size"} <= set(outcome.space.names):
        images.update(plot_heatmaps(outcome, folder))
    blocks = report_blocks(outcome, target, images)
    (folder / "tune.html").write_text(render_html(blocks, f"carpool tune: {target}"), "utf-8")
    markdown = folder / "tune.md"
    markdown.write_text(render_markdown(blocks), encoding="utf-8")
    return markdown


def datatype_of(array: Any) -> str:
    """The KServe v2 datatype of a NumPy array's dtype (FP32 for anything unknown)."""
    return _DATATYPES.get(str(np.asarray(array).dtype), "FP32")


def base_entry(path: str | Path, name: str | None = None) -> dict[str, Any]:
    """A model entry of an existing serve config (``name``, else the first), validated."""
    config = load_config(path)
    models = [m for m in config.models if name is None or m.name == name]
    if not models:
        known = [m.name for m in config.models]
        raise ConfigError("--model", name, f"one of {known}", file=str(path))
    return models[0].model_dump(exclude_defaults=True)


def base_document(path: str | Path) -> dict[str, Any]:
    """A whole serve config as :func:`recommended_config` builds on it: validated, its
    file sources and label files absolute (the recommendation may be written to another
    folder)."""
    document = load_config(path).model_dump(exclude_defaults=True)
    folder = Path(path).resolve().parent
    for model in document["models"]:
        for tensor in model.get("outputs", ()):
            labels = tensor.get("label_filename")
            if labels is not None and not Path(labels).is_absolute():
                tensor["label_filename"] = str(folder / labels)
    return document


def recommended_config(
    entry: dict[str, Any], values: dict[str, Any], base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A ``carpool serve`` config: ``entry`` with the tuned ``values`` set, validated;
    given the ``base`` config the entry came from (:func:`base_document`), that config
    whole with the entry in its place (its other models and settings kept: the result
    serves what the base served).

    Raises:
        ConfigError: when the result would not load (a bug in the entry given).
    """
    model = {**entry, **policy_values(values)}  # an on/off level 0 or 1 as the bool it is
    if "devices" in model and "num_replicas" in values:
        del model["devices"]  # the tuned count wins; device then names every replica's
    if base is None:
        document = {"models": [model]}
    else:
        models = [model if m["name"] == entry["name"] else m for m in base["models"]]
        document = {**base, "models": models}
    parse_config(document, file="<recommended>")
    return document


def write_config(document: dict[str, Any], path: Path, notes: list[str]) -> None:
    """Write ``document`` as YAML, ``notes`` as comment lines above it."""
    header = "".join(f"# {line}\n" for line in notes)
    text = yaml.safe_dump(document, sort_keys=False, default_flow_style=None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + text, encoding="utf-8")
