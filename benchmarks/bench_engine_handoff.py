"""The engine's CPU per request for ``--workers`` hand-offs, in one process: the same
requests queued into the same batcher directly (as one process's HTTP layer does) and
through the engine's :class:`~carpool.server.workers.peer.Peer` (INFERS group records
in, RESULTS group records out).

No sockets, no other process, no scheduling: what is left between the two ways is the
hand-off's own work on the engine's side (decoding and splitting the worker's records,
the per-request bookkeeping, grouping and encoding the results). ``bench_workers.py``
measures the whole server, where the engine's process also pays for sharing its core
with the workers; the difference between the two is that.

The model is a no-op (W1's shapes: 256 float32 in, the first 16 out), ``max_batch_size``
64, a 2 ms window; ``--groups`` requests arrive per loop turn (a worker's turn). The ways
alternate round by round; CPU is ``time.process_time`` (the replica's thread included),
the process pinned to ``--cpu`` as ``bench_workers.py`` pins the server; medians of
``--repeat`` rounds.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_engine_handoff.py [--groups 8,32]

Writes benchmarks/results/engine_handoff.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

import benchlib
from carpool.config import load_config
from carpool.server.app import KServeApp
from carpool.server.builder import build_repository
from carpool.server.heap import freeze_startup_heap
from carpool.server.repository import ModelRepository
from carpool.server.workers.peer import Peer
from carpool.server.workers.records import Kind, encode_group

NOOP_MODULE = """\
def noop(inputs):
    return {"OUTPUT0": inputs["INPUT0"][:, :16]}
"""
CONFIG = """\
models:
  - name: noop
    kind: python
    source: engine_handoff_noop:noop
    inputs:  [{name: INPUT0, datatype: FP32, shape: [256]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [16]}]
    max_batch_size: 64
    max_delay_s: 0.002
    executor: thread
"""
OPTIONS = {"priority": None, "timeout_s": None, "cost": None}
WARMUP_TURNS = 50
Way = Callable[[int], Awaitable[None]]  # runs that many turns of requests, to the last answer


class Sink:
    """The channel to a worker, as the peer sees it: records are counted, not sent."""

    def __init__(self) -> None:
        self.num_records = 0
        self.is_open = True

    def send(self, parts: list[bytes | memoryview]) -> None:
        self.num_records += 1

    def flush(self) -> None:
        pass


async def _drain(pending: Callable[[], bool]) -> None:
    # The peer has no event to wait on; a turn of the loop per check is cheap next to
    # the batches it waits for, and the same for both ways.
    while pending():  # noqa: ASYNC110
        await asyncio.sleep(0)
    await asyncio.sleep(0)  # the turn's results grouped and sent


def direct(repository: ModelRepository, group: int) -> Way:
    """``turns`` turns of ``group`` requests each, queued into the batcher directly."""
    model = repository.get("noop")
    batcher = model.require_batcher()
    x = np.random.default_rng(0).random((1, 256), dtype=np.float32)
    outstanding = 0

    def landed(future: asyncio.Future[Any]) -> None:
        nonlocal outstanding
        outstanding -= 1
        if not future.cancelled() and future.exception() is None:
            model.outputs_of(future.result())

    async def run(turns: int) -> None:
        nonlocal outstanding
        for _ in range(turns):
            for _ in range(group):
                queued = batcher.enqueue_many({"INPUT0": x}, **OPTIONS, arrival_s=time.monotonic())
                outstanding += 1
                queued.future.add_done_callback(landed)
            await asyncio.sleep(0)
        await _drain(lambda: outstanding > 0)

    return run


def through_peer(app: KServeApp, group: int) -> Way:
    """The same requests as the engine gets them from a worker: one INFERS record a turn
    (encoded before the clock starts: that is the worker's work)."""
    peer = Peer(0, app, lambda: None)
    sink = Sink()
    peer.channel = sink  # type: ignore[assignment]  # what a Channel is, to the peer
    x = np.random.default_rng(0).random((1, 256), dtype=np.float32)
    next_id = 0

    def record() -> bytearray:
        nonlocal next_id
        items = []
        for _ in range(group):
            next_id += 1
            items.append({"model": "noop", "options": OPTIONS, "arrival_s": 0.0, "id": next_id})
        return bytearray(b"".join(encode_group(Kind.INFERS, items, [{"INPUT0": x}] * group)))

    async def run(turns: int) -> None:
        records = [record() for _ in range(turns)]
        for data in records:
            peer.on_record(data)
            await asyncio.sleep(0)
        await _drain(lambda: peer.num_inflight > 0)

    return run


async def _measure(
    ways: dict[str, Callable[[int], Awaitable[None]]], turns: int
) -> dict[str, float]:
    cpu_us = {}
    for name, run in ways.items():
        await run(WARMUP_TURNS)
        start = time.process_time()
        await run(turns)
        cpu_us[name] = (time.process_time() - start) / turns * 1e6
    return cpu_us


async def _bench(
    folder: Path, groups: list[int], requests: int, repeat: int
) -> list[dict[str, Any]]:
    repository = build_repository(load_config(folder / "config.yaml"))
    app = KServeApp(repository)
    await repository.start()
    freeze_startup_heap()
    rows = []
    try:
        for group in groups:
            ways = {"direct": direct(repository, group), "peer": through_peer(app, group)}
            turns = max(1, requests // group)
            runs: dict[str, list[float]] = {name: [] for name in ways}
            for round_index in range(repeat):  # the order alternates round by round
                order = dict(reversed(ways.items())) if round_index % 2 else ways
                for name, us in (await _measure(order, turns)).items():
                    runs[name].append(us / group)
            base, handed = (statistics.median(runs[k]) for k in ("direct", "peer"))
            print(
                f"{group:3d} requests a turn: direct {base:6.2f} us, through the peer "
                f"{handed:6.2f} us CPU per request (+{handed - base:.2f} us)"
            )
            rows.append(
                {
                    "requests_per_turn": group,
                    "direct_cpu_us": round(base, 2),
                    "peer_cpu_us": round(handed, 2),
                    "handoff_cpu_us": round(handed - base, 2),
                    "runs": {k: [round(v, 2) for v in vs] for k, vs in runs.items()},
                }
            )
    finally:
        await repository.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", default="8,32", help="requests per loop turn")
    parser.add_argument("--requests", type=int, default=20000, help="per way, group and round")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; medians are kept")
    parser.add_argument(
        "--out", "--json", type=Path, default=benchlib.RESULTS / "engine_handoff.json"
    )
    parser.add_argument("--cpu", default=benchlib.SERVER_CPU, help="the CPU to run on")
    args = parser.parse_args()
    os.sched_setaffinity(0, {int(args.cpu)})
    machine = benchlib.machine_info(cpu=args.cpu)
    print(f"machine: {machine}")
    groups = [int(g) for g in args.groups.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "engine_handoff_noop.py").write_text(NOOP_MODULE)
        (folder / "config.yaml").write_text(CONFIG)
        sys.path.insert(0, str(folder))
        rows = uvloop.run(_bench(folder, groups, args.requests, args.repeat))
    benchlib.write_results(
        args.out,
        {"machine": machine, "utc": benchlib.utc_now(), "repeat": args.repeat, "rows": rows},
    )


if __name__ == "__main__":
    main()
