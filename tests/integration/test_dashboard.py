"""``/dashboard`` in a real browser: headless Chromium (Debian's package) loads the page
from a live server under load; its DOM has one panel per model whose charts have data
points; a screenshot goes to the test's folder. ``--no-dashboard`` turns it off."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from .conftest import DOUBLER_CONFIG, StartServer, wait_until
from .liveload import TWO_MODELS_CONFIG, Load

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_LIMIT_S = 90  # a net against a hung browser, never a timing assertion
VIRTUAL_TIME_MS = 4000  # the page's own clock: a few of its one-second refreshes


class Panels(HTMLParser):
    """``{model: {chart title: data points}}`` from the page's DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.models: dict[str, dict[str, int]] = {}
        self._model: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "section" and found.get("data-model"):
            self._model = found["data-model"]
            assert self._model not in self.models, f"two panels for {self._model}"
            self.models[self._model] = {}
        elif "chart" in (found.get("class") or "").split() and self._model is not None:
            self.models[self._model][found["data-title"] or ""] = int(found["data-points"] or 0)


def _chromium(url: str, profile: Path, *output: str) -> str:
    assert CHROMIUM is not None
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={profile}", "--window-size=1500,1600",
        f"--virtual-time-budget={VIRTUAL_TIME_MS}", *output, url,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_LIMIT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _has_requests(url: str, models: set[str]) -> bool:
    series = httpx.get(f"{url}/dashboard/series", timeout=5.0).json()["models"]
    return all(
        any(v for v in series.get(m, {}).get("series", {}).get("requests_per_s", []))
        for m in models
    )


@pytest.mark.skipif(CHROMIUM is None, reason="needs the chromium binary (apt-get install chromium)")
def test_the_page_draws_one_panel_per_model_with_data_under_load(
    start_server: StartServer, tmp_path: Path
) -> None:
    served = start_server(TWO_MODELS_CONFIG)
    url = f"http://{served.http_url}"
    with Load(served.http_url, ["alpha", "beta"]):
        wait_until(lambda: _has_requests(url, {"alpha", "beta"}), "a second of load sampled")
        dom = _chromium(f"{url}/dashboard", tmp_path / "profile", "--dump-dom")
        screenshot = tmp_path / "dashboard.png"
        _chromium(f"{url}/dashboard", tmp_path / "profile", f"--screenshot={screenshot}")
    panels = Panels()
    panels.feed(dom)
    assert set(panels.models) == {"alpha", "beta"}
    for model, charts in panels.models.items():
        assert charts.get("requests/s", 0) > 0, (model, charts)
        assert charts.get("batch size (mean of the second)", 0) > 0, (model, charts)
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {screenshot}")


def test_no_dashboard_serves_none(start_server: StartServer) -> None:
    served = start_server(DOUBLER_CONFIG, args=["--no-dashboard"])
    url = f"http://{served.http_url}"
    assert httpx.get(f"{url}/dashboard", timeout=5.0).status_code == 404
    assert httpx.get(f"{url}/dashboard/series", timeout=5.0).status_code == 404
    assert httpx.get(f"{url}/v2/health/ready", timeout=5.0).status_code == 200
