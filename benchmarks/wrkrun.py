"""Shared by the HTTP benchmarks: a free loopback port, wrk scripts and one pinned run, parsed."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_post_script(script: Path, body: Path, headers: dict[str, str]) -> None:
    """Writes a wrk Lua script that POSTs the bytes of the file ``body`` with ``headers``."""
    lines = [
        "",
        f'local f = io.open("{body}", "rb")',
        'wrk.method = "POST"',
        'wrk.body = f:read("*all")',
        "f:close()",
        *(f'wrk.headers["{name}"] = "{value}"' for name, value in headers.items()),
        "",
    ]
    script.write_text("\n".join(lines))


def write_w1_binary_body(path: Path) -> int:
    """Writes one W1 request (1 x 256 float32, seed 0) as tritonclient.http sends it by
    default, binary tensors after a JSON header, to ``path``; returns the header's length
    (the ``Inference-Header-Content-Length`` to send with it)."""
    import numpy as np
    import tritonclient.http as httpclient

    x = np.random.default_rng(0).standard_normal((1, 256), dtype=np.float32)
    tensor = httpclient.InferInput("INPUT0", [1, 256], "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor], [output])
    path.write_bytes(body)
    return int(json_size)


def latency_ms(text: str) -> float:
    """wrk's latency text (``850.00us``, ``5.71ms``, ``1.20s``, ``1.00m``) in milliseconds."""
    match = re.fullmatch(r"([0-9.]+)(us|ms|s|m)", text.strip())
    if match is None:
        raise ValueError(f"unexpected wrk latency {text!r}")
    number, unit = match.groups()
    return float(number) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


def run_wrk(
    url: str,
    script: Path,
    connections: int,
    duration_s: float,
    cpu: str,
    timeout_s: int = 10,
    threads: int = 1,
) -> dict[str, Any]:
    """One closed-loop `wrk` run of ``threads`` threads (1: `wrk -t1`) pinned to ``cpu``
    (a CPU list for several): req/s, p50/p99 and error counts."""
    out = subprocess.run(
        ["taskset", "-c", cpu, "wrk", f"-t{threads}", f"-c{connections}", f"-d{duration_s:g}s",
         "--timeout", f"{timeout_s}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout  # fmt: skip
    rate = float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    # Percentile lines are matched at line start: a Stdev column can end in "50%".
    p50 = latency_ms(re.search(r"^\s*50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = latency_ms(re.search(r"^\s*99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sockets = re.search(r"Socket errors: (.*)", out)
    return {
        "rate_rps": rate,
        "p50_ms": p50,
        "p99_ms": p99,
        "non_2xx": int(errors.group(1)) if errors else 0,
        "socket_errors": sockets.group(1).strip() if sockets else "",
    }
