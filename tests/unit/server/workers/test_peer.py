"""The engine's side of one worker (carpool.server.workers.peer.Peer)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from carpool.server.limits import InflightBytes
from carpool.server.workers.peer import Peer
from carpool.server.workers.records import Kind, encode


def _counts_record(**counts: Any) -> bytearray:
    return bytearray(b"".join(encode(Kind.COUNTS, {"requests": 0, **counts})))


def _listening_record() -> bytearray:
    return _counts_record(listening=True)


def _peer(index: int = 0, app: Any = None) -> Peer:
    """A peer of an engine whose app holds only the in-flight figures (all this path reads)."""
    app = app if app is not None else SimpleNamespace(inflight=InflightBytes(0))
    return Peer(index, app, lambda: None)


async def test_a_worker_started_again_before_it_first_listened_ends_the_startup_wait() -> None:
    """The engine's start-up waits for every worker to listen; a worker that died first
    is dropped and started again, and its successor's "listening" ends that same wait."""
    peer = _peer()
    waiting = asyncio.ensure_future(peer.is_listening.wait())
    await asyncio.sleep(0)
    peer.drop()  # the worker died before it listened
    assert not peer.is_listening.is_set()
    await asyncio.sleep(0.05)
    assert not waiting.done()  # its successor has not said it listens yet
    peer.on_record(_listening_record())
    await asyncio.wait_for(waiting, 1.0)


async def test_a_dropped_worker_no_longer_counts_as_listening() -> None:
    peer = _peer()
    peer.on_record(_listening_record())
    assert peer.is_listening.is_set()
    peer.drop()
    assert not peer.is_listening.is_set()


def test_the_engine_shows_the_sum_of_its_workers_inflight_bytes_and_refusals() -> None:
    """Each worker holds its own --max-inflight-bytes; /metrics (the engine's figures)
    shows their sum. A worker that dies no longer holds anything; its refusals stay."""
    app = SimpleNamespace(inflight=InflightBytes(0))
    first, second = _peer(0, app), _peer(1, app)
    first.on_record(_counts_record(inflight_bytes=300, refused_inflight=2))
    second.on_record(_counts_record(inflight_bytes=100, refused_inflight=1))
    assert (app.inflight.held_bytes, app.inflight.num_refused) == (400, 3)
    first.on_record(_counts_record(inflight_bytes=50, refused_inflight=5))
    assert (app.inflight.held_bytes, app.inflight.num_refused) == (150, 6)
    first.drop()
    assert (app.inflight.held_bytes, app.inflight.num_refused) == (100, 6)
    first.on_record(_counts_record(inflight_bytes=10, refused_inflight=1))  # its next life
    assert (app.inflight.held_bytes, app.inflight.num_refused) == (110, 7)
