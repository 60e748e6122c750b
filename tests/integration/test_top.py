"""``carpool top URL`` in a real terminal: a tmux pane 160x50 shows a live server under
load (the model's name, a batch size above zero), says reconnecting... while the server
is away and recovers when it is back, and quits on ``q``."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import ServedProcess, StartServer, start_served_process, wait_until
from .liveload import TWO_MODELS_CONFIG, Load

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux on PATH")
# A row of the selected model's batch-size histogram: size, batches, bar.
HISTOGRAM_ROW = re.compile(r"│\s+(\d+)\s+(\d+)\s+█")


class Pane:
    """One tmux pane on a private tmux server (its own socket: no other session seen)."""

    def __init__(self, socket_name: str, command: str) -> None:
        self._tmux = ["tmux", "-L", socket_name]
        self._run("new-session", "-d", "-s", "top", "-x", "160", "-y", "50", command)

    def _run(self, *args: str) -> str:
        done = subprocess.run([*self._tmux, *args], capture_output=True, text=True, check=True)
        return done.stdout

    def text(self) -> str:
        return self._run("capture-pane", "-p", "-t", "top")

    def press(self, key: str) -> None:
        self._run("send-keys", "-t", "top", key)

    def close(self) -> None:
        subprocess.run([*self._tmux, "kill-server"], capture_output=True, check=False)


@pytest.fixture
def pane_for() -> Iterator[list[Pane]]:
    panes: list[Pane] = []
    yield panes
    for pane in panes:
        pane.close()


def _top_command(served: ServedProcess, log: Path) -> str:
    env = f"PYTHONPATH={shlex.quote(os.environ.get('PYTHONPATH', ''))} TERM=xterm-256color"
    top = f"{shlex.quote(sys.executable)} -m carpool.cli top http://{served.http_url}"
    # After top exits the pane stays, showing how it ended.
    return f"{env} {top} 2>{shlex.quote(str(log))}; echo top-exited-$?; sleep 60"


def _batch_sizes(text: str) -> list[int]:
    return [int(size) for size, count in HISTOGRAM_ROW.findall(text) if int(count) > 0]


def test_top_shows_a_loaded_model_survives_a_restart_and_quits_on_q(
    start_server: StartServer, pane_for: list[Pane], tmp_path: Path
) -> None:
    served = start_server(TWO_MODELS_CONFIG)
    log = tmp_path / "top.err"
    pane = Pane(f"carpool-top-{os.getpid()}", _top_command(served, log))
    pane_for.append(pane)
    wait_until(lambda: "alpha" in pane.text(), f"top to list alpha; stderr: {log}")
    with Load(served.http_url, ["alpha", "beta"]):
        wait_until(lambda: _batch_sizes(pane.text()), "a batch size in top's histogram")
    shown = pane.text()
    assert "alpha (batch)" in shown and "beta" in shown
    assert max(_batch_sizes(shown)) >= 1

    pane.press("Down")  # pick beta: its panel replaces alpha's
    wait_until(lambda: "beta (batch)" in pane.text(), "the arrow key to pick beta")

    port = int(served.http_url.rsplit(":", 1)[1])
    assert served.stop() == 0
    wait_until(lambda: "reconnecting..." in pane.text(), "top to say reconnecting...")
    again_folder = tmp_path / "again"
    again_folder.mkdir()
    again = start_served_process(TWO_MODELS_CONFIG, again_folder, ports=(port, 0))
    try:
        wait_until(lambda: "reconnecting..." not in pane.text(), "top to reconnect")
        pane.press("q")
        wait_until(lambda: "top-exited-" in pane.text(), "top to quit on q")
        assert "top-exited-0" in pane.text(), log.read_text()
    finally:
        assert again.stop() == 0
