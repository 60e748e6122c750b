"""The server's faces other than the infer fast path, held to Triton and the KServe v2 spec.

Each test states what Triton does (and what ``tritonclient`` users rely on); all failed
before the fixes of the commit that added them (gRPC ModelReady of an unknown model,
GET /v2/models/stats, compressed bodies, 405, the statistics schema, counts of what
succeeded)."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import orjson
import pytest
import tritonclient.grpc.aio as grpcclient

from carpool import Batcher, BatchPolicy
from carpool.server.app import KServeApp
from carpool.server.grpc import InferenceServicer, add_servicer
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec
from carpool.server.stats import model_stats

from .apps import started_app


def double(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": inputs["x"] * 2}


def broken(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    raise RuntimeError("boom")


def _served(fn: Any = double, name: str = "m") -> ServedModel:
    batcher = Batcher(fn, BatchPolicy(max_batch_size=8, max_delay_s=0.0), collate="dict")
    return ServedModel(
        name,
        "1",
        "python",
        (TensorSpec("x", "FP32", (2,)),),
        (TensorSpec("y", "FP32", (2,)),),
        batcher,
    )


def _infer_body(value: float) -> bytes:
    tensor = {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [value, value]}
    return orjson.dumps({"inputs": [tensor]})


class Exchange:
    """One HTTP request through the ASGI app."""

    def __init__(
        self, method: str, path: str, body: bytes = b"", headers: list[Any] | None = None
    ) -> None:
        self.scope = {"type": "http", "method": method, "path": path, "headers": headers or []}
        self._body = body
        self._sent = False
        self.status: int | None = None
        self.headers: list[Any] = []
        self.body = b""

    async def receive(self) -> dict[str, Any]:
        if not self._sent:
            self._sent = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = message["headers"]
        else:
            self.body += message.get("body", b"")

    async def run(self, app: KServeApp) -> Exchange:
        await app(self.scope, self.receive, self.send)
        return self


@pytest.fixture
async def app() -> AsyncIterator[KServeApp]:
    async with started_app(_served(), _served(name="other")) as app:
        yield app


@pytest.fixture
async def grpc_client() -> AsyncIterator[grpcclient.InferenceServerClient]:
    repository = ModelRepository([_served()])
    await repository.start()
    server = grpc.aio.server()
    add_servicer(server, InferenceServicer(repository))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        yield client
    finally:
        await client.close()
        await server.stop(None)
        await repository.stop()


# -- gRPC ModelReady ----------------------------------------------------------------------


@pytest.mark.parametrize(("name", "version"), [("nope", ""), ("m", "2")])
async def test_grpc_model_ready_of_an_unknown_model_is_false_not_an_error(
    grpc_client: grpcclient.InferenceServerClient, name: str, version: str
) -> None:
    # Triton's ModelIsReady answers ready=false with status OK for a model or version it
    # does not have, so tritonclient.grpc's is_model_ready() returns False (as the HTTP
    # client does on carpool's 404). carpool aborts with NOT_FOUND, so it raises.
    assert await grpc_client.is_model_ready("m")
    assert await grpc_client.is_model_ready(name, version) is False


# -- REST statistics -----------------------------------------------------------------------


async def test_rest_stats_without_a_model_name_reports_every_model(app: KServeApp) -> None:
    # Triton's statistics extension: GET v2/models[/${MODEL}[/versions/${V}]]/stats; with no
    # name, every model. tritonclient.http's get_inference_statistics() with no model name
    # (its default) requests exactly "v2/models/stats". The gRPC face already does this.
    exchange = await Exchange("GET", "/v2/models/stats").run(app)
    assert exchange.status == 200, exchange.body
    names = sorted(s["name"] for s in orjson.loads(exchange.body)["model_stats"])
    assert names == ["m", "other"]


async def test_rest_stats_carry_every_key_of_tritons_schema(app: KServeApp) -> None:
    # Triton's $model_stat / $inference_stats / $batch_stats have these keys (none marked
    # #optional in docs/protocol/extension_statistics.md).
    await Exchange("POST", "/v2/models/m/infer", _infer_body(1.0)).run(app)
    exchange = await Exchange("GET", "/v2/models/m/stats").run(app)
    (stat,) = orjson.loads(exchange.body)["model_stats"]
    missing = [k for k in ("last_inference",) if k not in stat]
    missing += [
        f"inference_stats.{k}"
        for k in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
        if k not in stat["inference_stats"]
    ]
    missing += [
        f"batch_stats[].{k}"
        for k in ("compute_input", "compute_infer", "compute_output")
        if k not in stat["batch_stats"][0]
    ]
    assert missing == []


async def test_stats_count_only_successful_inferences() -> None:
    # Triton: inference_count / execution_count are the cumulative counts of *successful*
    # inferences / executions. A model that raised on its only batch has done none.
    model = _served(broken)
    await model.batcher.start()
    try:
        with pytest.raises(Exception, match="boom"):
            await model.run({"x": np.ones((3, 2), np.float32)}, {})
    finally:
        await model.batcher.stop()
    stats = model_stats(model)
    assert stats["inference_stats"]["fail"]["count"] == 1
    assert (stats["inference_count"], stats["execution_count"]) == (0, 0)


# -- REST methods and encodings ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v2/models/m/infer"),
        ("POST", "/v2/health/live"),
        ("HEAD", "/v2/models/m/infer"),  # HEAD goes with GET only
        ("POST", "/v2/models/m/ready"),
        ("DELETE", "/v2/models/m"),
    ],
)
async def test_wrong_method_on_a_known_route_is_405(app: KServeApp, method: str, path: str) -> None:
    # Triton answers a known route with the wrong method 405 "Method Not Allowed"
    # (http_server.cc: RETURN_AND_RESPOND_WITH_ERR(req, EVHTP_RES_METHNALLOWED, ...)).
    exchange = await Exchange(method, path).run(app)
    assert exchange.status == 405, exchange.body


@pytest.mark.parametrize(
    ("encoding", "compress"), [(b"gzip", gzip.compress), (b"deflate", zlib.compress)]
)
async def test_compressed_request_body_is_accepted(
    app: KServeApp, encoding: bytes, compress: Any
) -> None:
    # tritonclient.http's infer(request_compression_algorithm="gzip"|"deflate") sends the
    # body compressed with Content-Encoding; Triton decompresses it before parsing
    # (http_server.cc DecompressBuffer). Inference-Header-Content-Length, when sent, counts
    # the uncompressed JSON header.
    body = compress(_infer_body(1.5))
    headers = [(b"content-encoding", encoding), (b"content-length", str(len(body)).encode())]
    exchange = await Exchange("POST", "/v2/models/m/infer", body, headers).run(app)
    assert exchange.status == 200, exchange.body
    assert orjson.loads(exchange.body)["outputs"][0]["data"] == [3.0, 3.0]
