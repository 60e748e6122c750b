"""soak.py's watcher, run as its own process beside the load generator: health probes
and the server's resident memory, written as JSON lines until its stdin closes.

    python benchmarks/soakmonitor.py --pid PID --port PORT --out FILE [--interval-s 0.1]

Every ``interval_s`` it asks ``/v2/health/ready`` twice, timing each from its first byte
(or connect) to its last: on a new connection, as a kubelet or a load balancer probes
(``{"kind": "health", "t": ..., "latency_s": ..., "status": 200}``), and on one
connection kept open (``"kind": "health_kept"``), which tells a slow accept from a slow
answer. ``status`` is null when the probe failed: refused, reset or past
``--probe-timeout-s``. Every second it reads VmRSS from ``/proc/PID/status`` and writes
``{"kind": "rss", "t": ..., "rss_kib": ...}``. ``t`` is ``time.monotonic()``, the clock
every process of the machine shares, so soak.py can cut the samples by phase. A process
of its own keeps the probes clear of the load generator's busy event loop (it still
shares that core).
"""

from __future__ import annotations

import argparse
import json
import re
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

_STATUS_LINE = re.compile(rb"^HTTP/1\.[01] (\d{3})")
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


def read_rss_kib(pid: int) -> int | None:
    """VmRSS of ``pid`` in KiB; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


REQUEST = b"GET /v2/health/ready HTTP/1.1\r\nHost: soak\r\n\r\n"


def _read_answer(sock: socket.socket) -> int | None:
    """The status of one answer, read to its end (by its Content-Length); None if the
    connection ends first or it is not HTTP."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(4096)
        if not chunk:
            return None
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    match = _STATUS_LINE.match(head)
    length = _CONTENT_LENGTH.search(head)
    missing = (int(length.group(1)) if length else 0) - len(body)
    while missing > 0:
        chunk = sock.recv(min(missing, 65536))
        if not chunk:
            return None
        missing -= len(chunk)
    return int(match.group(1)) if match else None


def probe_new(host: str, port: int, timeout_s: float) -> int | None:
    """GET /v2/health/ready on a new connection: the status, None if none came."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(REQUEST)
            return _read_answer(sock)
    except OSError:
        return None


class KeptProbe:
    """GET /v2/health/ready on one keep-alive connection, opened again after a failure
    (the time to open it again counts in that probe)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.address = (host, port)
        self.timeout_s = timeout_s
        self.sock: socket.socket | None = None

    def probe(self) -> int | None:
        try:
            if self.sock is None:
                self.sock = socket.create_connection(self.address, timeout=self.timeout_s)
            self.sock.sendall(REQUEST)
            status = _read_answer(self.sock)
        except OSError:
            status = None
        if status is None and self.sock is not None:
            self.sock.close()
            self.sock = None
        return status


class Sink:
    """JSON lines to ``out``, from two threads."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        with self.lock:
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()


def _probe_every(
    sink: Sink, kind: str, probe: Callable[[], int | None], interval_s: float, stop: threading.Event
) -> None:
    """``probe`` every ``interval_s`` (or as soon as the last one ends, if it took longer)."""
    while not stop.is_set():
        start = time.monotonic()
        status = probe()
        end = time.monotonic()
        sink.write({"kind": kind, "t": start, "latency_s": end - start, "status": status})
        stop.wait(max(0.0, start + interval_s - end))


def _sample_rss(sink: Sink, pid: int, stop: threading.Event) -> None:
    """VmRSS once a second until the server is gone."""
    while not stop.is_set():
        rss = read_rss_kib(pid)
        if rss is None:
            return
        sink.write({"kind": "rss", "t": time.monotonic(), "rss_kib": rss})
        stop.wait(1.0)


def watch(args: argparse.Namespace, sink: Sink) -> None:
    """Each probe and the sampler on a thread of its own (a probe stuck for seconds holds
    up nothing else), until stdin closes or the server is gone."""
    stop = threading.Event()
    kept = KeptProbe(args.host, args.port, args.probe_timeout_s)
    threads = [
        threading.Thread(target=_sample_rss, args=(sink, args.pid, stop)),
        threading.Thread(
            target=_probe_every,
            args=(
                sink, "health", lambda: probe_new(args.host, args.port, args.probe_timeout_s),
                args.interval_s, stop,
            ),
        ),
        threading.Thread(
            target=_probe_every, args=(sink, "health_kept", kept.probe, args.interval_s, stop)
        ),
    ]  # fmt: skip
    for thread in threads:
        thread.start()
    try:
        while threads[0].is_alive():
            readable, _, _ = select.select([sys.stdin], [], [], 0.5)
            if readable and not sys.stdin.read(1):
                return  # stdin closed: soak.py is done with us
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--interval-s", type=float, default=0.1)
    parser.add_argument("--probe-timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    with args.out.open("w") as out:
        watch(args, Sink(out))


if __name__ == "__main__":
    main()
