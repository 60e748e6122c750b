"""``carpool bench ... --html`` and ``carpool tune ... --html`` from short real runs, the
files opened in headless Chromium: its DOM must hold each plot as an embedded image, the
file must fetch nothing, and a screenshot is written next to it (the test's output)."""

from __future__ import annotations

import base64
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import DOUBLER_CONFIG, ServedProcess, start_served_process

RUN_TIMEOUT_S = 180.0  # a net against a hung run, not a timing assertion
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
_DATA_IMG = re.compile(r"<img src=\"data:image/png;base64,([A-Za-z0-9+/=]+)\" alt=\"([^\"]*)\"")

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    process = start_served_process(DOUBLER_CONFIG, tmp_path_factory.mktemp("serve-report"))
    yield process
    assert process.stop() == 0, process.output()


def _run(*argv: str, cwd: Path) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "carpool.cli", *argv],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=cwd,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def _chromium(page: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    profile = page.parent / f"{page.stem}-chromium-profile"
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={profile}", *flags, page.as_uri(),
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "an embedded image that is no PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _report(page: Path, *argv: str) -> dict[str, tuple[int, int]]:
    """Run ``carpool *argv --html page``; its plots as :func:`_plots_in_browser` finds
    them, each a real image."""
    output = _run(*argv, "--html", str(page), cwd=page.parent)
    assert f"wrote {page}" in output
    plots = _plots_in_browser(page)
    assert all(w > 100 and h > 100 for w, h in plots.values())
    return plots


def _plots_in_browser(page: Path) -> dict[str, tuple[int, int]]:
    """Each embedded plot of ``page`` as Chromium's DOM holds it: its alt text to its
    PNG's size. Also writes ``page``'s screenshot beside it."""
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"(src|href)=['\"]https?:", text), "the report fetches something"
    dom = _chromium(page, "--dump-dom").stdout
    plots = {alt: _png_size(base64.b64decode(data)) for data, alt in _DATA_IMG.findall(dom)}
    screenshot = page.with_suffix(".png")
    _chromium(page, f"--screenshot={screenshot}", "--window-size=1200,2400")
    assert _png_size(screenshot.read_bytes()) == (1200, 2400)
    print(f"screenshot of {page.name}: {screenshot}")
    return plots


@needs_chromium
def test_bench_html_report_embeds_its_plots(served: ServedProcess, tmp_path: Path) -> None:
    page = tmp_path / "bench.html"
    plots = _report(
        page, "bench", f"http://{served.http_url}", "--model", "doubler",
        "--input-shape", "1,4", "--concurrency", "1,4", "--duration", "0.5s",
        "--warmup", "0.1s", "--no-progress",
    )  # fmt: skip
    assert set(plots) == {
        "Latency against throughput: p50 and p99 at each point",
        "Latency CDF of each point (from the scheduled send time)",
        "Batch-size distribution on the server, per point",
    }
    text = page.read_text(encoding="utf-8")
    assert "concurrency=1" in text and "concurrency=4" in text


@needs_chromium
def test_tune_html_report_embeds_heatmaps_and_main_effects(tmp_path: Path) -> None:
    plots = _report(
        tmp_path / "tune.html", "tune", "numpy:negative", "--shape", "4",
        "--slo-p99-ms", "1000", "--out", str(tmp_path / "tuned.yaml"), "--search", "taguchi",
        "--param", "max_delay_s=0,0.002", "--param", "max_batch_size=1,8",
        "--trial-duration", "0.2s", "--warmup", "0.05s", "--window", "0.1s",
        "--concurrency", "4",
    )  # fmt: skip
    assert set(plots) == {
        "throughput vs p99 latency of every trial",
        "throughput heatmap",
        "p99 latency heatmap",
        "main effects: mean objective at each level of each factor",
    }
