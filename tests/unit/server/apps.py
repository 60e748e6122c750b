"""A started app over served models, and requests through it as an ASGI server sends
them, for tests that drive the ASGI app in-process, without sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import orjson

from carpool import Batcher, BatchPolicy
from carpool.server.app import KServeApp
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec


@asynccontextmanager
async def started_app(*models: ServedModel) -> AsyncIterator[KServeApp]:
    """The app serving ``models``, their batchers started; stopped on the way out."""
    app = KServeApp(ModelRepository(list(models)))
    await app.repository.start()
    try:
        yield app
    finally:
        await app.repository.stop()


def double(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": inputs["x"] * 2}


def served(fn: Any = double, name: str = "m", **batcher: Any) -> ServedModel:
    """Model ``name`` (input ``x``, output ``y``: FP32, 2 per row) whose batches of up to 8
    rows ``fn`` runs at once; ``batcher``: more of the Batcher's keywords (a clock)."""
    model = Batcher(fn, BatchPolicy(max_batch_size=8, max_delay_s=0.0), collate="dict", **batcher)
    spec_in, spec_out = TensorSpec("x", "FP32", (2,)), TensorSpec("y", "FP32", (2,))
    return ServedModel(name, "1", "python", (spec_in,), (spec_out,), model)


class Exchange:
    """One HTTP request through the app: its body at once, then the client stays until
    :meth:`disconnect`, or until ``leave_after`` chunks of the answer's body came."""

    def __init__(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: list[tuple[bytes, bytes]] | None = None,
        *,
        leave_after: int | None = None,
    ) -> None:
        self.scope = {"type": "http", "method": method, "path": path, "headers": headers or []}
        self._body = body
        self._sent_body = False
        self._gone = asyncio.Event()
        self._leave_after = leave_after
        self.status: int | None = None
        self.headers: dict[bytes, bytes] = {}
        self.chunks: list[bytes] = []

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    async def receive(self) -> dict[str, Any]:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = dict(message["headers"])
        elif message.get("body"):
            self.chunks.append(message["body"])
            if self._leave_after is not None and len(self.chunks) >= self._leave_after:
                self._gone.set()

    def disconnect(self) -> None:
        self._gone.set()

    async def run(self, app: KServeApp) -> Exchange:
        await app(self.scope, self.receive, self.send)
        return self

    def json(self) -> Any:
        return orjson.loads(self.body)

    def events(self) -> list[Any]:
        """The data of each server-sent event of a streamed answer."""
        lines = self.body.decode().split("\n\n")
        assert lines[-1] == ""
        return [line.removeprefix("data: ") for line in lines[:-1]]


async def call(app: KServeApp, path: str, method: str = "POST", **body: Any) -> Exchange:
    """``body`` as a JSON object sent to ``path``, answered."""
    return await Exchange(method, path, orjson.dumps(body)).run(app)
