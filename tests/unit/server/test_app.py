"""The ASGI app driven directly: no sockets, a fake clock, a held model; and what Triton
answers that its clients rely on: methods, compressed bodies, statistics."""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
import zlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import pytest

from carpool import Batcher, BatchPolicy
from carpool.core.clock import FakeClock, settle
from carpool.server.access import DEFAULT_ACCESS, Access
from carpool.server.app import KServeApp
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec

from .apps import Exchange, call, double, served, started_app
from .http.fakes import until


class HeldModel:
    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.seen: list[list[float]] = []

    async def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.seen.append(inputs["x"][:, 0].tolist())
        await self.gate.wait()
        return {"y": inputs["x"] * 2}


def _app(model: Any, max_body_bytes: int = 1 << 20, access: Access = DEFAULT_ACCESS) -> KServeApp:
    repository = ModelRepository([served(model, clock=FakeClock())])
    return KServeApp(repository, max_body_bytes=max_body_bytes, access=access)


def _infer_body(value: float) -> bytes:
    tensor = {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [value, value]}
    return orjson.dumps({"inputs": [tensor]})


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
        ("GET", "/health", 503),  # vLLM's probes answer readiness
        ("POST", "/ping", 503),
        ("GET", "/version", 200),
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


# -- what Triton answers: methods, compressed bodies, statistics ----------------------------
# Each test states what Triton does (and what tritonclient users rely on).


@pytest.fixture
async def app() -> AsyncIterator[KServeApp]:
    """Models "m" and "other", doubling, started."""
    async with started_app(served(), served(name="other")) as app:
        yield app


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v2/models/m/infer"),
        ("POST", "/v2/health/live"),
        ("POST", "/health"),  # vLLM's /health is GET only; its /ping takes both
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
    ("method", "path", "status"),
    [("POST", "/v1/foo", 404), ("GET", "/v1/completions", 405)],
    ids=["POST-/v1/foo", "GET-/v1/completions"],
)
async def test_an_unknown_v1_route_is_not_reported_as_model_not_found(app, method, path, status):
    got = await call(app, path, method)
    assert got.status == status
    assert got.json()["error"]["code"] != "model_not_found", got.json()


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


# -- access: the API key, policy updates (carpool.server.access) ----------------------------

KEY = "s3cr3t-k3y"
BEARER = [(b"authorization", b"Bearer " + KEY.encode())]


async def test_a_request_without_the_api_key_is_a_401_before_its_body_is_read() -> None:
    model = HeldModel()
    app = _app(model, access=Access(KEY))
    for headers in ([], [(b"authorization", b"Bearer wrong")]):
        exchange = Exchange("POST", "/v2/models/m/infer", _infer_body(1.0), headers)
        await exchange.run(app)
        assert exchange.status == 401
        assert exchange.headers[b"www-authenticate"] == b"Bearer"
        assert exchange.headers[b"connection"] == b"close"  # the body is left unread
        assert not exchange._sent_body
        error = orjson.loads(exchange.body)["error"]
        assert "Authorization: Bearer <key>" in error and "wrong" not in error
    assert model.seen == []


async def test_an_openai_route_without_the_api_key_answers_openais_error_object() -> None:
    exchange = Exchange("GET", "/v1/models")
    await exchange.run(_app(HeldModel(), access=Access(KEY)))
    assert exchange.status == 401
    error = orjson.loads(exchange.body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_api_key"  # as OpenAI answers a missing or wrong key
    assert error["message"].startswith("no API key was sent")


@pytest.mark.parametrize(
    ("path", "protect_metrics", "status"),
    [
        ("/v2/health/live", True, 200),
        ("/v2/health/ready", True, 503),  # answered, not refused: batchers not started
        ("/metrics", False, 200),
        ("/metrics", True, 401),
        ("/v2", False, 401),
        ("/v2/models/m", False, 401),
        ("/v2/models/m/policy", False, 401),
        ("/v2/models/stats", False, 401),
    ],
)
async def test_without_the_key_only_probes_and_unprotected_metrics_are_answered(
    path: str, protect_metrics: bool, status: int
) -> None:
    app = _app(HeldModel(), access=Access(KEY, protect_metrics=protect_metrics))
    exchange = Exchange("GET", path)
    await exchange.run(app)
    assert exchange.status == status
    with_key = Exchange("GET", path, headers=BEARER)
    await with_key.run(app)
    assert with_key.status != 401


async def test_a_policy_post_is_a_403_unless_policy_updates_are_allowed() -> None:
    app = _app(HeldModel())
    exchange = Exchange("POST", "/v2/models/m/policy", b'{"max_batch_size": 2}')
    await exchange.run(app)
    assert exchange.status == 403
    assert "--allow-policy-updates" in orjson.loads(exchange.body)["error"]
    assert app.repository.get("m").batcher.policy.max_batch_size == 8  # unchanged
    shown = Exchange("GET", "/v2/models/m/policy")
    await shown.run(app)
    assert shown.status == 200 and orjson.loads(shown.body)["max_batch_size"] == 8


@pytest.mark.parametrize(
    ("changes", "bound"),
    [
        ({"timeout_s": 1e-6}, "under 0.001 s"),
        ({"timeout_s": 0}, "under 0.001 s"),
        ({"max_delay_s": 1e9}, "over 10.0 s"),
        ({"max_delay_s": 10.5, "max_batch_size": 2}, "over 10.0 s"),
    ],
)
async def test_a_policy_past_the_network_bounds_is_a_400_naming_the_bound(
    changes: dict[str, Any], bound: str
) -> None:
    app = _app(HeldModel(), access=Access(allow_policy_updates=True))
    exchange = Exchange("POST", "/v2/models/m/policy", orjson.dumps(changes))
    await exchange.run(app)
    assert exchange.status == 400
    assert bound in orjson.loads(exchange.body)["error"]
    policy = app.repository.get("m").batcher.policy
    assert (policy.max_batch_size, policy.max_delay_s, policy.timeout_s) == (8, 0.0, None)


async def test_the_configured_policy_is_taken_back_past_the_network_bounds() -> None:
    """What ``carpool tune`` restores after its trials (and what a GET gave) is accepted
    whatever the bounds: a config's 12 s window and 0.1 ms timeout, changed and given back.
    A value past them that the config did not set is still refused."""
    configured = BatchPolicy(max_batch_size=8, max_delay_s=12.0, timeout_s=1e-4)
    model = Batcher(double, configured, collate="dict", clock=FakeClock())
    spec_in, spec_out = TensorSpec("x", "FP32", (2,)), TensorSpec("y", "FP32", (2,))
    served_model = ServedModel("m", "1", "python", (spec_in,), (spec_out,), model)
    app = KServeApp(ModelRepository([served_model]), access=Access(allow_policy_updates=True))
    shown = Exchange("GET", "/v2/models/m/policy")
    await shown.run(app)
    document = orjson.loads(shown.body)
    fields = ("max_delay_s", "max_batch_size", "timeout_s")
    trial = {"max_delay_s": 0.001, "max_batch_size": 4, "timeout_s": 1.0}
    for changes in (trial, {k: document[k] for k in fields}):
        exchange = Exchange("POST", "/v2/models/m/policy", orjson.dumps(changes))
        await exchange.run(app)
        assert exchange.status == 200, exchange.body
    assert model.policy == configured
    for changes, bound in (({"max_delay_s": 11.0}, "over 10.0 s"), ({"timeout_s": 2e-4}, "under")):
        exchange = Exchange("POST", "/v2/models/m/policy", orjson.dumps(changes))
        await exchange.run(app)
        assert exchange.status == 400 and bound in orjson.loads(exchange.body)["error"]
    assert model.policy == configured


async def test_a_policy_within_the_network_bounds_is_applied() -> None:
    app = _app(HeldModel(), access=Access(allow_policy_updates=True))
    for changes in ({"timeout_s": 0.001, "max_delay_s": 10}, {"timeout_s": None}):
        exchange = Exchange("POST", "/v2/models/m/policy", orjson.dumps(changes))
        await exchange.run(app)
        assert exchange.status == 200, exchange.body
        assert orjson.loads(exchange.body) | changes == orjson.loads(exchange.body)


async def _ready_statuses(app: KServeApp) -> tuple[int | None, int | None]:
    server, model = Exchange("GET", "/v2/health/ready"), Exchange("GET", "/v2/models/m/ready")
    await server.run(app)
    await model.run(app)
    return server.status, model.status


async def test_a_hung_batch_is_a_504_and_readiness_is_503_until_a_fresh_replica_loads() -> None:
    clock = FakeClock()
    entered, release, second_build = threading.Event(), threading.Event(), threading.Event()
    rebuilding = threading.Event()
    builds: list[str] = []

    def model(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if (inputs["x"] < 0).any():  # hangs on a negative input
            entered.set()
            release.wait(5.0)
        return {"y": inputs["x"] * 2}

    def factory(device: str) -> Any:
        builds.append(device)
        if len(builds) == 2:
            rebuilding.set()
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
        assert await asyncio.wait_for(asyncio.to_thread(rebuilding.wait, 5.0), 5.0)
        assert await _ready_statuses(app) == (503, 503)

        second_build.set()
        await until(lambda: app.repository.is_ready)  # the fresh replica loaded
        assert await _ready_statuses(app) == (200, 200)
        again = Exchange("POST", "/v2/models/m/infer", _infer_body(1.0))
        await asyncio.wait_for(again.run(app), 5.0)
        assert again.status == 200
    finally:
        release.set()
        second_build.set()
        await app.repository.stop()


# -- mounted on another ASGI server ----------------------------------------------------------


async def test_the_app_is_served_by_uvicorn_as_a_plain_asgi_app() -> None:
    """carpool serves the app over its own HTTP protocol; any ASGI server may mount it
    instead (here uvicorn, through its public API), lifespan starting and draining it."""
    import httpx
    import uvicorn

    model = HeldModel()
    model.gate.set()
    batcher = Batcher(model, BatchPolicy(max_batch_size=8, max_delay_s=0.0), collate="dict")
    spec_in, spec_out = TensorSpec("x", "FP32", (2,)), TensorSpec("y", "FP32", (2,))
    served = ServedModel("m", "1", "python", (spec_in,), (spec_out,), batcher)
    app = KServeApp(ModelRepository([served]))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    serving = asyncio.ensure_future(server.serve(sockets=[listener]))
    try:
        await until(lambda: server.started, timeout_s=10)  # uvicorn says when it listens
        async with httpx.AsyncClient() as client:
            ready = await client.get(f"{url}/v2/health/ready")
            answer = await client.post(f"{url}/v2/models/m/infer", content=_infer_body(1.5))
        assert ready.status_code == 200  # the lifespan started the models
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [3.0, 3.0]
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
        listener.close()
    assert not app.repository.get("m").batcher.is_running  # and drained it
