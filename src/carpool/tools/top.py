"""``carpool top [URL]``: a live terminal view of a running server, refreshed each second.

Each second it fetches ``GET /v2/models/stats`` (each model's live document under its
``"carpool"`` key, server/live.py) and the adaptive controller's gauges from ``/metrics``
when the server has them, turns two fetches into the second's rates
(:func:`carpool.server.dashboard_samples.sample`, as the dashboard does) and draws
:func:`carpool.tools.top_view.render` with rich's ``Live``. Keys: ``q`` quits, arrows pick
a model, ``s`` sorts, ``?`` shows help. It sends ``CARPOOL_API_KEY`` as its key when set.
A failed fetch keeps the last figures and says
"reconnecting..." until the server answers again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.live import Live

from carpool.server.access import API_KEY_ENV
from carpool.server.dashboard_samples import sample
from carpool.tools.top_view import SORT_KEYS, ModelView, TopState, render

REFRESH_S = 1.0
FETCH_TIMEOUT_S = 2.0
# The adaptive controller's gauges (issue 25), by the short name top shows them under.
ADAPTIVE_METRICS = {
    "carpool_adaptive_delay_seconds": "delay_s",
    "carpool_adaptive_batch_size": "batch_size",
}
_KEYS = {b"\x1b[A": "up", b"\x1bOA": "up", b"\x1b[B": "down", b"\x1bOB": "down"}


def press(state: TopState, key: str) -> TopState | None:
    """The state after ``key``; None when it quits."""
    if key in ("q", "Q", "\x03"):
        return None
    if key == "up":
        return dataclasses.replace(state, selected=max(0, state.selected - 1))
    if key == "down":
        last = max(0, len(state.models) - 1)
        return dataclasses.replace(state, selected=min(last, state.selected + 1))
    if key == "s":
        following = SORT_KEYS[(SORT_KEYS.index(state.sort_key) + 1) % len(SORT_KEYS)]
        return dataclasses.replace(state, sort_key=following)
    if key == "?":
        return dataclasses.replace(state, show_help=not state.show_help)
    return state


def keys_of(data: bytes) -> list[str]:
    """The keys in what the terminal sent: arrows (escape sequences) and single characters."""
    out: list[str] = []
    while data:
        for sequence, name in _KEYS.items():
            if data.startswith(sequence):
                out.append(name)
                data = data[len(sequence) :]
                break
        else:
            out.append(data[:1].decode("latin-1"))
            data = data[1:]
    return out


class Poller:
    """Fetches the server's figures and keeps the previous fetch for the rates."""

    def __init__(self, client: httpx.Client) -> None:
        self._client = client
        self._previous: dict[str, dict[str, Any]] = {}
        self._previous_s = 0.0

    def poll(self, state: TopState) -> TopState:
        """``state`` with fresh figures, or with ``error`` set (and the old figures)."""
        try:
            documents = self._documents()
            adaptive = self._adaptive()
        except (httpx.HTTPError, ValueError, KeyError) as error:
            self._previous = {}  # a restarted server's counters start again
            return dataclasses.replace(state, error=str(error) or type(error).__name__)
        now_s = time.monotonic()
        dt_s = now_s - self._previous_s
        views = tuple(
            ModelView(name, document, sample(document, self._previous.get(name), dt_s))
            for name, document in documents.items()
        )
        self._previous, self._previous_s = documents, now_s
        selected = min(state.selected, max(0, len(views) - 1))
        return dataclasses.replace(
            state, models=views, adaptive=adaptive, error=None, selected=selected
        )

    def _documents(self) -> dict[str, dict[str, Any]]:
        response = self._client.get("/v2/models/stats")
        response.raise_for_status()
        stats = response.json()["model_stats"]
        return {m["name"]: m["carpool"] for m in stats if "carpool" in m}

    def _adaptive(self) -> dict[str, dict[str, float]]:
        response = self._client.get("/metrics", params={"name[]": list(ADAPTIVE_METRICS)})
        if response.status_code != 200:  # protected by the API key: top goes without
            return {}
        out: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(response.text):
            for s in family.samples:
                short = ADAPTIVE_METRICS.get(s.name)
                if short is not None and "model" in s.labels:
                    # per class where the server has classes: the model's largest
                    figures = out.setdefault(s.labels["model"], {})
                    figures[short] = max(figures.get(short, 0.0), float(s.value))
        return out


@contextlib.contextmanager
def _cbreak() -> Iterator[int | None]:
    """Keys as they are pressed (no Enter, no echo) while inside; None without a terminal."""
    if not sys.stdin.isatty():
        yield None
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _read_keys(fd: int | None, timeout_s: float) -> list[str]:
    if fd is None:
        time.sleep(max(0.0, timeout_s))
        return []
    ready, _, _ = select.select([fd], [], [], max(0.0, timeout_s))
    return keys_of(os.read(fd, 64)) if ready else []


def run_top(url: str) -> None:
    """Show ``url``'s server until ``q`` (or Ctrl-C)."""
    state = TopState(url=url.rstrip("/"))
    console = Console()
    key = os.environ.get(API_KEY_ENV)
    headers = {} if not key else {"authorization": f"Bearer {key}"}
    with (
        httpx.Client(base_url=state.url, timeout=FETCH_TIMEOUT_S, headers=headers) as client,
        _cbreak() as fd,
        Live(console=console, screen=True, auto_refresh=False) as live,
    ):
        poller = Poller(client)
        next_fetch_s = 0.0
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                if time.monotonic() >= next_fetch_s:
                    state = poller.poll(state)
                    next_fetch_s = time.monotonic() + REFRESH_S
                live.update(render(state, console.width), refresh=True)
                for key in _read_keys(fd, next_fetch_s - time.monotonic()):
                    pressed = press(state, key)
                    if pressed is None:
                        return
                    state = pressed
