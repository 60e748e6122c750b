"""`carpool serve`'s port flags on loopback: a taken gRPC port is one line, an out-of-range
port is refused (bounded: each process is killed at 20 s)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from .test_serve_config import CONFIG as SERVE_CONFIG

HERE = Path(__file__).resolve().parent
# The python model of the serve-config tests, without the ONNX one (its file is built there).
CONFIG = SERVE_CONFIG.split("  - name: affine")[0]


def _run_serve(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str] | None:
    """The finished ``carpool serve``, or None when it was still serving after 20 s."""
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG)
    paths = [str(HERE), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    command = [sys.executable, "-m", "carpool.cli", "serve", str(config), *flags]
    try:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=20)
    except subprocess.TimeoutExpired:  # subprocess.run kills the child
        return None


def test_grpc_port_in_use_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _run_serve(tmp_path, "--port", "0", "--grpc-port", str(port))
    assert done is not None and done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-600:]


def test_http_port_out_of_range_is_refused(tmp_path: Path) -> None:
    # Today it serves on 70000 - 65536 = 4464 while logging ...:70000.
    done = _run_serve(tmp_path, "--port", "70000", "--grpc-port", "0")
    assert done is not None, "carpool serve --port 70000 started serving"
    assert done.returncode == 2
