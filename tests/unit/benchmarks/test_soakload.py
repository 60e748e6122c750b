"""soak.py's load generator (benchmarks/soakload.py) against a small asyncio server on
loopback that answers, refuses, resets or never answers as a test tells it: every
request written ends in exactly one count, and the counts name what the server did."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import numpy as np

from carpool.tools.httpclient import encode_request
from carpool.tools.loadgen import Arrival, ArrivalProcess
from soakload import closed_loop, open_loop
from soakstats import Tally

REQUEST = encode_request("POST", "t", "/v2/models/m/infer", b"x" * 10)
Behaviour = Callable[[int], str]  # request number -> "ok" | "refuse" | "reset" | "hang" | "close"


@asynccontextmanager
async def fake_server(behaviour: Behaviour) -> AsyncIterator[int]:
    """A keep-alive HTTP/1.1 server reading fixed-size requests; its port."""
    numbers = itertools.count()
    hung: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readexactly(len(REQUEST))
                what = behaviour(next(numbers))
                if what == "reset":
                    writer.transport.abort()
                    return
                if what == "hang":
                    hung.append(writer)
                    return
                status = b"200 OK" if what in ("ok", "close") else b"429 Too Many Requests"
                close = b"connection: close\r\n" if what == "close" else b""
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 2\r\n" + close)
                writer.write(b"\r\n{}")
                if what == "close":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in hung:
            writer.transport.abort()
        server.close()
        await server.wait_closed()


def _accounted(tally: Tally) -> int:
    return sum(tally.statuses.values()) + tally.num_lost + tally.num_unanswered


async def test_closed_loop_counts_answers_refusals_resets_and_hangs() -> None:
    def behaviour(n: int) -> str:
        return {0: "hang", 7: "reset", 8: "close"}.get(n % 50, "refuse" if n % 3 else "ok")

    async with fake_server(behaviour) as port:
        tally = await closed_loop("127.0.0.1", port, REQUEST, 8, duration_s=0.3, drain_s=0.2)
    assert tally.num_sent > 50
    assert tally.statuses[200] > 0
    assert tally.statuses[429] > 0
    assert tally.num_lost >= 1  # the resets
    assert tally.num_unanswered >= 1  # the hung: given up on after drain_s
    assert tally.num_not_accepted == 0
    assert _accounted(tally) == tally.num_sent
    assert len(tally.answered_s) == tally.statuses[200]
    assert len(tally.refused_s) == tally.statuses[429]


async def test_a_port_nobody_listens_on_is_not_accepted_and_nothing_is_sent() -> None:
    async with fake_server(lambda n: "ok") as port:
        pass  # closed again: connects are refused
    tally = await closed_loop("127.0.0.1", port, REQUEST, 2, duration_s=0.1, drain_s=0.1)
    assert tally.num_not_accepted >= 2
    assert tally.num_sent == 0
    assert _accounted(tally) == 0


async def test_open_loop_sends_each_arrival_once_or_counts_it_unsent() -> None:
    rate_rps, duration_s, seed = 2000.0, 0.3, 3
    scheduled = len(
        ArrivalProcess.steady(rate_rps, Arrival.POISSON).send_times(
            duration_s, np.random.default_rng(seed)
        )
    )
    async with fake_server(lambda n: "reset" if n % 40 == 5 else "ok") as port:
        tally = await open_loop(
            "127.0.0.1", port, REQUEST, rate_rps, duration_s, 0.5, max_connections=4, seed=seed
        )
    assert tally.num_sent + tally.num_unsent == scheduled
    assert _accounted(tally) == tally.num_sent
    assert tally.num_lost >= 1
    assert all(w >= s for w, s in zip(tally.answered_waited_s, tally.answered_s, strict=True))
