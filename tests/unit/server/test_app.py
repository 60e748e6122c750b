"""The ASGI app driven directly: no sockets, a fake clock, a held model."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import orjson
import pytest

from carpool import Batcher, BatchPolicy
from carpool.core.clock import FakeClock, settle
from carpool.server.app import KServeApp
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec


class HeldModel:
    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.seen: list[list[float]] = []

    async def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.seen.append(inputs["x"][:, 0].tolist())
        await self.gate.wait()
        return {"y": inputs["x"] * 2}


def _app(model: Any, max_body_bytes: int = 1 << 20) -> KServeApp:
    batcher = Batcher(
        model, BatchPolicy(max_batch_size=8, max_delay_s=0.0), collate="dict", clock=FakeClock()
    )
    served = ServedModel(
        "m",
        "1",
        "python",
        (TensorSpec("x", "FP32", (2,)),),
        (TensorSpec("y", "FP32", (2,)),),
        batcher,
    )
    return KServeApp(ModelRepository([served]), max_body_bytes=max_body_bytes)


def _infer_body(value: float) -> bytes:
    tensor = {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [value, value]}
    return orjson.dumps({"inputs": [tensor]})


class Exchange:
    """One HTTP request through the app; ``disconnect()`` makes the client go away."""

    def __init__(self, method: str, path: str, body: bytes = b"") -> None:
        self.scope = {"type": "http", "method": method, "path": path, "headers": []}
        self._body = body
        self._sent_body = False
        self._gone = asyncio.Event()
        self.status: int | None = None
        self.body = b""

    async def receive(self) -> dict[str, Any]:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        else:
            self.body += message.get("body", b"")

    def disconnect(self) -> None:
        self._gone.set()

    async def run(self, app: KServeApp) -> None:
        await app(self.scope, self.receive, self.send)


async def test_a_client_that_disconnects_while_queued_is_never_computed() -> None:
    model = HeldModel()
    app = _app(model)
    await app.repository.start()
    try:
        first = Exchange("POST", "/v2/models/m/infer", _infer_body(1.0))
        first_task = asyncio.ensure_future(first.run(app))
        await settle()
        assert model.seen == [[1.0]]  # running, held
        leaver = Exchange("POST", "/v2/models/m/infer", _infer_body(2.0))
        leaver_task = asyncio.ensure_future(leaver.run(app))
        await settle()
        leaver.disconnect()
        await leaver_task
        assert leaver.status is None  # nobody to answer
        model.gate.set()
        await first_task
        assert first.status == 200
        assert model.seen == [[1.0]]  # the leaver's request never reached the model
        snap = app.repository.get("m").batcher.snapshot()
        assert snap.classes["normal"].rejections == {"cancelled": 1}
    finally:
        model.gate.set()
        await app.repository.stop()


async def test_body_over_the_limit_is_a_413() -> None:
    app = _app(HeldModel(), max_body_bytes=10)
    exchange = Exchange("POST", "/v2/models/m/infer", _infer_body(1.0))
    await exchange.run(app)
    assert exchange.status == 413
    assert "limit of 10 bytes" in orjson.loads(exchange.body)["error"]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v2/health/live", 200),
        ("GET", "/v2/health/ready", 503),  # batchers not started
        ("GET", "/v2/models/m/versions/1", 200),
        ("GET", "/v2/models/m/versions/2", 404),
        ("GET", "/v2/models/m/nonsense", 404),
        ("DELETE", "/v2/models/m", 405),
        ("GET", "/v1/anything", 404),
        ("GET", "/metrics", 200),
    ],
)
async def test_routes(method: str, path: str, status: int) -> None:
    exchange = Exchange(method, path)
    await exchange.run(_app(HeldModel()))
    assert exchange.status == status


async def test_unknown_requested_output_is_a_400_naming_it() -> None:
    model = HeldModel()
    model.gate.set()
    app = _app(model)
    await app.repository.start()
    try:
        body = orjson.loads(_infer_body(1.0))
        body["outputs"] = [{"name": "z"}]
        exchange = Exchange("POST", "/v2/models/m/infer", orjson.dumps(body))
        await exchange.run(app)
        assert exchange.status == 400
        assert "unknown output 'z'" in orjson.loads(exchange.body)["error"]
        assert model.seen == []
    finally:
        await app.repository.stop()


async def _ready_statuses(app: KServeApp) -> tuple[int | None, int | None]:
    server, model = Exchange("GET", "/v2/health/ready"), Exchange("GET", "/v2/models/m/ready")
    await server.run(app)
    await model.run(app)
    return server.status, model.status


async def test_a_hung_batch_is_a_504_and_readiness_is_503_until_a_fresh_replica_loads() -> None:
    clock = FakeClock()
    entered, release, second_build = threading.Event(), threading.Event(), threading.Event()
    builds: list[str] = []

    def model(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if (inputs["x"] < 0).any():  # hangs on a negative input
            entered.set()
            release.wait(5.0)
        return {"y": inputs["x"] * 2}

    def factory(device: str) -> Any:
        builds.append(device)
        if len(builds) == 2:
            second_build.wait(5.0)
        return model

    policy = BatchPolicy(max_batch_size=1, max_delay_s=0.0, batch_timeout_s=1.0)
    batcher = Batcher(
        fn_factory=factory, policy=policy, collate="dict", clock=clock, executor="thread"
    )
    served = ServedModel(
        "m", "1", "python", (TensorSpec("x", "FP32", (2,)),), (TensorSpec("y", "FP32", (2,)),),
        batcher,
    )  # fmt: skip
    app = KServeApp(ModelRepository([served]), max_body_bytes=1 << 20)
    await app.repository.start()
    try:
        assert await _ready_statuses(app) == (200, 200)
        hung = Exchange("POST", "/v2/models/m/infer", _infer_body(-1.0))
        hung_task = asyncio.ensure_future(hung.run(app))
        await asyncio.wait_for(asyncio.to_thread(entered.wait, 5.0), 5.0)

        await clock.advance(1.0)

        await asyncio.wait_for(hung_task, 5.0)
        assert hung.status == 504
        assert "batch_timeout_s=1 s" in orjson.loads(hung.body)["error"]
        async with asyncio.timeout(5.0):
            while len(builds) < 2:  # noqa: ASYNC110 - the replica thread builds
                await asyncio.sleep(0.001)
        assert await _ready_statuses(app) == (503, 503)

        second_build.set()
        async with asyncio.timeout(5.0):
            while await _ready_statuses(app) != (200, 200):  # noqa: ASYNC110 - as above
                await asyncio.sleep(0.001)
        again = Exchange("POST", "/v2/models/m/infer", _infer_body(1.0))
        await asyncio.wait_for(again.run(app), 5.0)
        assert again.status == 200
    finally:
        release.set()
        second_build.set()
        await app.repository.stop()
