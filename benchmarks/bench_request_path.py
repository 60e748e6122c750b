"""carpool's own CPU per HTTP inference request, without sockets or a model.

The server's protocol (`carpool.server.http`, as `carpool serve` runs it) is fed raw
HTTP/1.1 requests by fake transports: N connections each send one
``POST /v2/models/mlp/infer`` per round (the binary KServe body bench_http.py sends, or
with ``--json`` the JSON body of bench_peers.py), and a round ends when every connection
has its answer. The model is an ``async`` slice of its input, so what is timed is parsing,
decoding, checking, batching (max 64, 2 ms), encoding and answering: carpool's time per
request, the part of the server's per-request cost that is not the kernel's or the
model's. The event loop thread's CPU time is measured over 7 windows of rounds after a
warm-up; the best window is reported (the machine is shared; the best is the least
disturbed). The garbage collector is set up as ``carpool serve`` sets it.

    taskset -c 0 .venv/bin/python benchmarks/bench_request_path.py [--connections 256] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import numpy as np
import orjson
import uvloop

import benchlib
from carpool.core.batcher import Batcher
from carpool.core.policy import BatchPolicy
from carpool.server.app import KServeApp
from carpool.server.heap import freeze_startup_heap
from carpool.server.http.server import HttpServer
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec
from wrkrun import write_w1_binary_body

WINDOWS = 7


class CountingTransport:
    """What the protocol needs of a transport; counts the answers written to it."""

    def __init__(self) -> None:
        self.answers = 0

    def write(self, data: bytes) -> None:
        self.answers += 1

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return False  # no half-close: a lingering close closes at once

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _slice(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"OUTPUT0": inputs["INPUT0"][:, :16]}


def _request(as_json: bool) -> bytes:
    if as_json:
        x = np.random.default_rng(0).standard_normal(256).astype(np.float32)
        tensor = {"name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": x.tolist()}
        body = orjson.dumps({"inputs": [tensor]})
        head = b"Content-Type: application/json\r\n"
    else:
        with TemporaryDirectory() as tmp:
            header_length = write_w1_binary_body(Path(tmp) / "body")
            body = (Path(tmp) / "body").read_bytes()
        head = b"Content-Type: application/octet-stream\r\n"
        head += b"Inference-Header-Content-Length: %d\r\n" % header_length
    start = b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    return start + head + b"Content-Length: %d\r\n\r\n" % len(body) + body


async def measure(connections: int, as_json: bool, rounds: int) -> float:
    """Best window's event-loop CPU microseconds per request."""
    specs_in, specs_out = (
        (TensorSpec("INPUT0", "FP32", (256,)),),
        (TensorSpec("OUTPUT0", "FP32", (16,)),),
    )
    batcher = Batcher(_slice, BatchPolicy(max_batch_size=64, max_delay_s=0.002), collate="dict")
    repository = ModelRepository([ServedModel("mlp", "1", "python", specs_in, specs_out, batcher)])
    await repository.start()
    server = HttpServer(KServeApp(repository))
    pairs = []
    for _ in range(connections):
        protocol = server.connection()
        transport = CountingTransport()
        protocol.connection_made(transport)  # type: ignore[arg-type]
        pairs.append((protocol, transport))
    raw = _request(as_json)

    async def one_round() -> None:
        for protocol, _ in pairs:
            protocol.data_received(raw)
        want = pairs[0][1].answers + 1
        while any(t.answers < want for _, t in pairs):  # noqa: ASYNC110 (answers come from callbacks)
            await asyncio.sleep(0)

    for _ in range(20):
        await one_round()
    freeze_startup_heap()
    windows = []
    for _ in range(WINDOWS):
        start = time.thread_time()
        for _ in range(rounds):
            await one_round()
        windows.append((time.thread_time() - start) / (rounds * connections))
    await repository.stop()
    return min(windows) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=40, help="rounds per window")
    parser.add_argument("--json", action="store_true", help="KServe JSON bodies, not binary")
    args = parser.parse_args()
    print(f"machine: {benchlib.machine_info()}")
    per_request = uvloop.run(measure(args.connections, args.json, args.rounds))
    body = "JSON" if args.json else "binary"
    print(
        f"{body} requests, {args.connections} connections: {per_request:.1f} us of event-loop "
        f"CPU per request (best of {WINDOWS} windows of {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
