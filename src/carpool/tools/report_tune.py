"""``carpool tune ... --html report.html``: the tuning report as one self-contained file.

The same blocks as ``--report DIR`` (:func:`carpool.tools.tune_report.report_blocks`:
recommendation, trials, Pareto front, the max_delay_s x max_batch_size heatmaps, the
main-effects table), with every plot embedded as a ``data:`` URI, and, when an orthogonal
array ran (``--search taguchi``), a main-effects plot: the mean objective at each level
of each factor.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from carpool.tools.report import png_data_uri
from carpool.tools.tune import TuneOutcome
from carpool.tools.tune_report import (
    Image,
    plot_heatmaps,
    plot_pareto,
    render_html,
    report_blocks,
)

MAIN_EFFECTS_ALT = "main effects: mean objective at each level of each factor"


def tune_html(outcome: TuneOutcome, target: str) -> str:
    """The report of ``outcome`` as one HTML document, its plots inside."""
    with tempfile.TemporaryDirectory(prefix="carpool-report-") as name:
        folder = Path(name)
        images: dict[str, str] = {}
        if any(r.measurement.error is None for r in outcome.results):
            plot_pareto(outcome, folder / "pareto.png")
            images["pareto"] = png_data_uri(folder / "pareto.png")
        if {"max_delay_s", "max_batch_size"} <= set(outcome.space.names):
            for kind, file_name in plot_heatmaps(outcome, folder).items():
                images[kind] = png_data_uri(folder / file_name)
        blocks = report_blocks(outcome, target, images)
        if outcome.effects:
            _plot_main_effects(outcome, folder / "main_effects.png")
            blocks.append(Image(png_data_uri(folder / "main_effects.png"), MAIN_EFFECTS_ALT))
    return render_html(blocks, f"carpool tune: {target}")


def _plot_main_effects(outcome: TuneOutcome, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    effects = outcome.effects or []
    unit = "req/s" if outcome.objective == "throughput" else "items/s"
    fig, axes = plt.subplots(
        1, len(effects), figsize=(3.2 * len(effects), 3.4), sharey=True, squeeze=False
    )
    for ax, effect in zip(axes[0], effects, strict=True):
        param = next(p for p in outcome.space.params if p.name == effect.factor)
        levels = [str(v) for v in param.values][: len(effect.level_means)]
        ax.plot(levels, effect.level_means[: len(levels)], "o-")
        ax.set_title(f"{effect.factor} (rank {effect.rank})", fontsize=9)
        ax.set_xlabel("level")
    axes[0][0].set_ylabel(f"mean {unit}")
    fig.suptitle("Main effects")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
