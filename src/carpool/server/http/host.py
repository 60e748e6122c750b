"""What a connection needs of the server that accepted it (:class:`Host`, which
:class:`~carpool.server.http.server.HttpServer` is): the server builds its connections,
so a connection names it by this protocol rather than importing it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from carpool.server.app import KServeApp
from carpool.server.http.answer import AnswerHeads, DateHeader
from carpool.server.http.dispatch import Dispatch


class Host(Protocol):
    """The server's state its connections share."""

    app: KServeApp
    dispatch: Dispatch
    timeout_keep_alive_s: float
    access_log: bool  # one INFO line per answer
    monotonic: Callable[[], float]  # when a read came, on the batchers' clock
    num_requests: int  # answered, over the server's life
    connections: set[Any]  # its Connections
    tasks: set[asyncio.Task[None]]  # route handlers running
    answer_heads: AnswerHeads
    date: DateHeader
