"""``carpool tune --html`` (carpool.tools.report_tune): one file, every plot inside as a
data URI; the browser check is tests/integration/test_html_reports.py."""

from __future__ import annotations

import re

from carpool.tools.report_tune import MAIN_EFFECTS_ALT, tune_html

from .test_tune_report import _outcome

_IMAGES = re.compile(r"<img src='data:image/png;base64,[A-Za-z0-9+/=]+' alt='([^']*)'>")


async def test_an_orthogonal_array_run_embeds_pareto_heatmaps_and_main_effects() -> None:
    outcome = await _outcome("taguchi", ("max_delay_s=0,0.01,0.05", "max_batch_size=1,16,64"))
    page = tune_html(outcome, "mod:fn")
    assert _IMAGES.findall(page) == [
        "throughput vs p99 latency of every trial",
        "throughput heatmap",
        "p99 latency heatmap",
        MAIN_EFFECTS_ALT,
    ]
    assert "<h2>Main effects (L9(3^4))</h2>" in page
    assert ".png'" not in page  # no image left as a file name


async def test_one_searched_parameter_has_no_heatmaps_and_no_main_effects() -> None:
    outcome = await _outcome("grid", ("max_batch_size=64,128",))
    page = tune_html(outcome, "mod:fn")
    assert _IMAGES.findall(page) == ["throughput vs p99 latency of every trial"]
    assert "No trial met the constraints" in page
