"""Where a request goes once its head is in (carpool.server.http.dispatch): the infer fast
path (decoded on the spot, queued, answered from the future's callback, no task), probes
answered from the head, early refusals and the waiting room, and every other route through
its handler. Raw HTTP/1.1 bytes are fed to a connection on a fake transport; each test
checks the wire bytes a client would read, and where a request went."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import pytest

from carpool import Batcher, BatchPolicy
from carpool.core.clock import FakeClock, settle
from carpool.server.access import Access
from carpool.server.app import KServeApp
from carpool.server.http import dispatch
from carpool.server.http.server import HttpServer
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec

from .fakes import (
    FakeTransport,
    Recorder,
    Responses,
    Server,
    binary_output,
    binary_request,
    connector,
    json_request,
    serving,
    until,
)


async def test_binary_infer_is_answered_in_one_write_without_a_task(server: Server) -> None:
    _, connect, model = server
    protocol, transport = connect()
    writes: list[bytes] = []
    transport.write = writes.append  # type: ignore[method-assign]
    protocol.data_received(binary_request(1.5))
    assert not protocol.tasks  # no task was started for it
    await until(lambda: bool(writes))
    assert len(writes) == 1
    (response,) = Responses(writes[0]).items
    np.testing.assert_array_equal(binary_output(response), [[3.0, 3.0]])
    assert int(response[1][b"content-length"]) == len(response[2])
    assert model.seen == [1.5]


async def test_concurrent_connections_share_a_batch(server: Server) -> None:
    _, connect, model = server
    connections = [connect() for _ in range(6)]
    for i, (protocol, _) in enumerate(connections):
        protocol.data_received(binary_request(float(i)))
    await until(lambda: all(t.data for _, t in connections))
    for i, (_, transport) in enumerate(connections):
        (response,) = Responses(bytes(transport.data)).items
        np.testing.assert_array_equal(binary_output(response), [[2.0 * i, 2.0 * i]])
    assert max(model.batches) > 1


async def test_bad_request_gets_400_and_its_batch_neighbours_succeed(server: Server) -> None:
    _, connect, _ = server
    good, bad = connect(), connect()
    good[0].data_received(binary_request(2.0))
    wrong_shape = {
        "inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]
    }
    bad[0].data_received(json_request(wrong_shape))
    await until(lambda: bool(good[1].data and bad[1].data))
    ((status, _, body),) = Responses(bytes(bad[1].data)).items
    assert status == 400
    assert "input 'x': shape [1, 3], expected [-1, 2]" in orjson.loads(body)["error"]
    np.testing.assert_array_equal(binary_output(Responses(bytes(good[1].data)).items[0]), [[4, 4]])
    assert not bad[1].closed  # a 400 keeps the connection


async def test_json_request_gets_a_json_answer(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    document = {
        "inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}]
    }
    protocol.data_received(json_request(document))
    await until(lambda: bool(transport.data))
    ((status, headers, body),) = Responses(bytes(transport.data)).items
    assert status == 200 and headers[b"content-type"] == b"application/json"
    output = orjson.loads(body)["outputs"][0]
    assert output == {"name": "y", "datatype": "FP32", "shape": [2, 2], "data": [2, 4, 6, 8]}


async def test_other_routes_and_models_go_through_their_route_handlers(server: Server) -> None:
    _, connect, _ = server
    requests = {
        "metadata": b"GET /v2/models/m HTTP/1.1\r\nHost: t\r\n\r\n",
        "unknown model": binary_request(1.0, path=b"/v2/models/nope/infer"),
        "custom infer": binary_request(1.0, path=b"/v2/models/custom/infer"),
        "version": binary_request(1.0, path=b"/v2/models/m/versions/1/infer"),
        "wrong version": binary_request(1.0, path=b"/v2/models/m/versions/9/infer"),
        "query": binary_request(1.0, path=b"/v2/models/m/infer?trace=1"),
    }
    transports = {}
    for name, raw in requests.items():
        protocol, transports[name] = connect()
        protocol.data_received(raw)
    await until(lambda: all(t.data for t in transports.values()))
    answers = {name: Responses(bytes(t.data)).items[0] for name, t in transports.items()}
    assert orjson.loads(answers["metadata"][2])["name"] == "m"
    assert answers["unknown model"][0] == 404
    assert "model 'nope'" in orjson.loads(answers["unknown model"][2])["error"]
    np.testing.assert_array_equal(binary_output(answers["custom infer"]), [[3, 3]])
    np.testing.assert_array_equal(binary_output(answers["version"]), [[2, 2]])
    assert answers["wrong version"][0] == 404
    np.testing.assert_array_equal(binary_output(answers["query"]), [[2, 2]])


async def test_infer_routes_are_remembered_only_for_served_models(server: Server) -> None:
    """The fast path keeps each infer URL it served with its model, so a later request
    skips parsing the path. Answers are the same the second time round, and URLs that
    name no served model (any client can send thousands) are never kept."""
    app, connect, _ = server
    paths = [b"/v2/models/nope-%d/infer" % i for i in range(100)]
    paths += [b"/v2/models/m/versions/%d/infer" % i for i in range(2, 100)]
    paths += [b"/v2/models/m/infer", b"/v2/models/m/versions/1/infer"]
    paths += [b"/v2/models/custom/infer", b"/v2/models/m/infer?x=1", b"/v2/models/m//infer"]
    rounds = []
    for _ in range(2):
        transports = []
        for path in paths:
            protocol, transport = connect()
            protocol.data_received(binary_request(1.0, path=path))
            transports.append(transport)
        await until(lambda: all(t.data for t in transports))  # noqa: B023
        rounds.append([Responses(bytes(t.data)).items[0][0] for t in transports])
    assert rounds[0] == rounds[1]
    assert rounds[0][:198] == [404] * 198 and rounds[0][198:202] == [200] * 4
    assert set(app.infer_routes) <= {
        b"/v2/models/m/infer",
        b"/v2/models/m/versions/1/infer",
        b"/v2/models/custom/infer",
    }


async def test_a_client_that_leaves_withdraws_its_queued_request(server: Server) -> None:
    app, connect, model = server
    batcher = app.repository.get("m").batcher
    batcher.update_policy(max_delay_s=60.0)  # the request stays queued until withdrawn
    protocol, transport = connect()
    protocol.data_received(binary_request(7.0))
    await until(lambda: batcher.num_pending == 1)
    protocol.connection_lost(None)
    await settle()
    assert batcher.num_pending == 0
    assert 7.0 not in model.seen
    assert transport.data == b""
    rejections = batcher.snapshot().classes["normal"].rejections
    assert rejections["cancelled"] == 1


async def test_a_request_deadline_counts_from_its_first_byte() -> None:
    # timeout 200 ms (Triton's parameter, in µs); the body trickles in over 300 ms of the
    # clock the batcher and the server's reads share: it is past its deadline before it
    # is parsed, and never reaches the model.
    clock = FakeClock()
    async with serving(clock=clock) as (_, connect, model):
        protocol, transport = connect()
        document = {
            "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [7.0, 7.0]}],
            "parameters": {"timeout": 200_000},
        }
        request = json_request(document)
        protocol.data_received(request[:-5])
        await clock.advance(0.3)
        protocol.data_received(request[-5:])
        await until(lambda: bool(transport.data))
        ((status, _, body),) = Responses(bytes(transport.data)).items
        assert status == 503, body
        assert b"past its timeout" in body
        assert 7.0 not in model.seen


@contextlib.asynccontextmanager
async def _bounded(max_queue_size: int) -> AsyncIterator[tuple[Any, Recorder, asyncio.Event]]:
    """A served model whose replica is held, with a queue bound: the first request
    runs, the next ``max_queue_size`` wait, and the rest are refused."""
    gate = asyncio.Event()
    model = Recorder()

    async def held(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        await gate.wait()
        return await model(inputs)

    policy = BatchPolicy(max_batch_size=1, max_delay_s=0.0, max_queue_size=max_queue_size)
    batcher = Batcher(held, policy, collate="dict")
    spec_in, spec_out = TensorSpec("x", "FP32", (2,)), TensorSpec("y", "FP32", (2,))
    repository = ModelRepository(
        [ServedModel("m", "1", "python", (spec_in,), (spec_out,), batcher)]
    )
    await repository.start()
    app = KServeApp(repository, max_body_bytes=100_000)
    connect = connector(HttpServer(app), FakeTransport)
    try:
        yield connect, model, gate
    finally:
        gate.set()
        await repository.stop()


async def test_a_full_queue_refuses_from_the_head_without_decoding_the_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with _bounded(max_queue_size=1) as (connect, model, gate):
        for value in (1.0, 2.0):  # one runs (held), one waits
            connect()[0].data_received(binary_request(value))
            await settle()
        decoded: list[bytes] = []
        real = dispatch.prepare_infer
        monkeypatch.setattr(
            dispatch, "prepare_infer", lambda m, body, *a: decoded.append(body) or real(m, body, *a)
        )
        protocol, transport = connect()
        # Refused once its head is in: the answer does not wait for the body.
        request = binary_request(3.0)
        head_end = request.index(b"\r\n\r\n") + 4
        protocol.data_received(request[:head_end])
        protocol.data_received(request[head_end:])
        # Its retry, read by a transport that reads while paused, waits for room.
        protocol.data_received(binary_request(4.0))
        responses = Responses(bytes(transport.data)).items
        assert [r[0] for r in responses] == [429]
        _, headers, body = responses[0]
        assert headers[b"retry-after"] == b"1"
        assert b"is full" in body
        assert not transport.closed  # the body was read: the connection stays usable
        assert decoded == []
        gate.set()
        # Room again: the same connection is served, its retry first.
        await until(lambda: len(Responses(bytes(transport.data)).items) == 2)
        protocol.data_received(binary_request(5.0))
        await until(lambda: len(Responses(bytes(transport.data)).items) == 3)
        assert [r[0] for r in Responses(bytes(transport.data)).items] == [429, 200, 200]
        assert model.seen == [1.0, 2.0, 4.0, 5.0]


KEY = b"s3cr3t-k3y"


async def test_an_infer_without_the_api_key_is_a_401_never_decoded_nor_queued() -> None:
    async with serving(Access(KEY.decode())) as (_, connect, model):
        undecodable = (
            b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\n{nope"
        )
        requests = [
            undecodable,  # a 400 if it were decoded
            binary_request(1.0),
            binary_request(2.0, extra=b"Authorization: Bearer wrong\r\n"),
            binary_request(3.0, extra=b"Authorization: " + KEY + b"\r\n"),  # no scheme
        ]
        transports = []
        for raw in requests:
            protocol, transport = connect()
            protocol.data_received(raw)
            transports.append(transport)
        await until(lambda: all(t.data for t in transports))
        for transport in transports:
            ((status, headers, body),) = Responses(bytes(transport.data)).items
            assert status == 401, body
            assert headers[b"www-authenticate"] == b"Bearer"
            assert b"Authorization: Bearer <key>" in body and KEY not in body
        assert model.seen == []


async def test_an_infer_with_the_api_key_takes_the_fast_path_and_its_repeats() -> None:
    async with serving(Access(KEY.decode())) as (_, connect, model):
        protocol, transport = connect()
        keyed = binary_request(1.5, extra=b"authorization: bearer " + KEY + b"\r\n")
        protocol.data_received(keyed)
        assert not protocol.tasks  # the fast path: no task
        await until(lambda: bool(transport.data))
        protocol.data_received(keyed + keyed)  # the head kept: taken without the parser
        await until(lambda: len(Responses(bytes(transport.data)).items) == 3)
        protocol.data_received(binary_request(9.0, extra=b"authorization: bearer k\r\n"))
        await until(lambda: len(Responses(bytes(transport.data)).items) == 4)
        statuses = [status for status, _, _ in Responses(bytes(transport.data)).items]
        assert statuses == [200, 200, 200, 401]
        assert model.seen == [1.5, 1.5, 1.5]


async def test_a_refused_connection_is_not_read_until_its_model_has_room() -> None:
    async with _bounded(max_queue_size=1) as (connect, model, gate):
        for value in (1.0, 2.0):  # one runs (held), one waits
            connect()[0].data_received(binary_request(value))
            await settle()
        refused, refused_transport = connect()
        refused.data_received(binary_request(3.0))
        assert Responses(bytes(refused_transport.data)).items[0][0] == 429
        assert refused.is_read_paused  # its retry waits in the socket, costing nothing
        room = refused._app.waiting_room
        assert room.num_waiting == 1
        gate.set()
        await until(lambda: not refused.is_read_paused)
        assert room.num_waiting == 0
        refused.data_received(binary_request(4.0))  # the retry, read once there is room
        await until(lambda: len(Responses(bytes(refused_transport.data)).items) == 2)
        assert Responses(bytes(refused_transport.data)).items[1][0] == 200
        assert 4.0 in model.seen


async def _fill(connect: Any) -> list[Any]:
    """Three requests on connections of their own to a model of ``_bounded(2)``: one runs
    (held), two wait in the queue, which is full."""
    queued = []
    for value in (1.0, 2.0, 3.0):
        protocol, _ = connect()
        protocol.data_received(binary_request(value))
        queued.append(protocol)
        await settle()
    return queued


async def test_a_waiting_connection_keeps_its_place_from_newcomers() -> None:
    async with _bounded(max_queue_size=2) as (connect, model, gate):
        queued = await _fill(connect)
        waiting, _ = connect()
        waiting.data_received(binary_request(4.0))
        assert waiting.is_read_paused  # refused: it waits for room
        queued[2].connection_lost(None)  # a place frees: the waiting connection's
        newcomer, newcomer_transport = connect()
        newcomer.data_received(binary_request(5.0))
        assert Responses(bytes(newcomer_transport.data)).items[0][0] == 429
        await until(lambda: not waiting.is_read_paused)
        assert newcomer.is_read_paused  # behind it
        waiting.data_received(binary_request(6.0))  # its retry has the place
        gate.set()
        await until(lambda: 6.0 in model.seen)
        assert 5.0 not in model.seen


async def _let_in(connect: Any, *values: float) -> list[tuple[Any, Any]]:
    """Connections refused by a full ``_bounded(2)`` model, one per value, waiting for
    room; then a place frees and the first of them is let in."""
    queued = await _fill(connect)
    refused = []
    for value in values:
        protocol, transport = connect()
        protocol.data_received(binary_request(value))
        refused.append((protocol, transport))
    queued[2].connection_lost(None)
    await until(lambda: not refused[0][0].is_read_paused)
    return refused


async def test_a_connection_let_in_holds_its_place_until_its_request_is_read() -> None:
    # Let in, the waiting connection's retry is read a loop turn or more later: a request
    # read first on another connection must not take its place, which would refuse the
    # retry after all its wait.
    async with _bounded(max_queue_size=2) as (connect, model, gate):
        [(waiting, waiting_transport)] = await _let_in(connect, 4.0)  # its retry not yet read
        newcomer, newcomer_transport = connect()
        newcomer.data_received(binary_request(5.0))
        assert Responses(bytes(newcomer_transport.data)).items[0][0] == 429
        waiting.data_received(binary_request(6.0))
        gate.set()
        await until(lambda: len(Responses(bytes(waiting_transport.data)).items) == 2)
        assert [r[0] for r in Responses(bytes(waiting_transport.data)).items] == [429, 200]
        assert 5.0 not in model.seen


async def test_no_more_connections_are_let_in_than_there_is_room_for() -> None:
    async with _bounded(max_queue_size=2) as (connect, _, _):
        (first, _), (second, _) = await _let_in(connect, 4.0, 5.0)  # room for one
        room = first._app.waiting_room
        for _ in range(3):  # checks before the first one's retry is read: the room is its
            room._check()
        assert second.is_read_paused
        assert room.num_waiting_for(first._app.repository.get("m").batcher) == 2


async def test_a_place_lapses_when_the_connection_let_in_sends_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from carpool.server import waiting

    monkeypatch.setattr(waiting, "PROMISE_S", 0.02)
    async with _bounded(max_queue_size=2) as (connect, _, gate):
        [(silent, _)] = await _let_in(connect, 4.0)
        batcher = silent._app.repository.get("m").batcher
        room = silent._app.waiting_room
        await until(lambda: room.num_waiting_for(batcher) == 0)  # it lapsed
        newcomer, newcomer_transport = connect()
        newcomer.data_received(binary_request(5.0))
        gate.set()
        await until(lambda: bool(newcomer_transport.data))
        assert Responses(bytes(newcomer_transport.data)).items[0][0] == 200


async def test_a_connection_waits_for_room_at_most_its_retry_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from carpool.server import waiting

    monkeypatch.setattr(waiting, "MAX_WAIT_S", 0.05)
    async with _bounded(max_queue_size=1) as (connect, _, _):
        for value in (1.0, 2.0):  # one runs (held), one waits: no room for a long while
            connect()[0].data_received(binary_request(value))
            await settle()
        refused, refused_transport = connect()
        refused.data_received(binary_request(3.0))
        assert refused.is_read_paused
        await until(lambda: not refused.is_read_paused)  # read again: a health probe
        refused.data_received(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")  # is answered
        await until(lambda: len(Responses(bytes(refused_transport.data)).items) == 2)
        assert Responses(bytes(refused_transport.data)).items[1][0] == 200


async def test_health_probes_are_answered_without_a_task_in_their_turn(server: Server) -> None:
    app, connect, _ = server
    protocol, transport = connect()
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"
    ready = b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"
    vllm = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"  # vLLM's probe: readiness
    protocol.data_received(binary_request(1.0) + ready + live + vllm)  # behind an infer
    assert not protocol.tasks  # no task: nothing to queue behind
    await until(lambda: len(Responses(bytes(transport.data)).items) == 4)
    statuses = [status for status, _, _ in Responses(bytes(transport.data)).items]
    assert statuses == [200, 200, 200, 200]  # in order: the infer's answer first
    assert not transport.closed
    await app.repository.stop()  # not ready any more; still alive
    protocol.data_received(ready + live + vllm)
    await until(lambda: len(Responses(bytes(transport.data)).items) == 7)
    statuses = [status for status, _, _ in Responses(bytes(transport.data)).items][4:]
    assert statuses == [503, 200, 503]


async def test_a_client_gone_before_its_handler_ran_reaches_the_model_and_is_withdrawn(
    server: Server,
) -> None:
    """Only the model's work is watched for a client that leaves: a request read in full
    reaches its model (as on the ASGI path), is withdrawn there and counted cancelled,
    and nothing is written to the lost connection."""
    app, connect, model = server
    batcher = app.repository.get("m").batcher
    batcher.update_policy(max_delay_s=60.0)  # the request stays queued until withdrawn
    protocol, transport = connect()
    protocol.data_received(binary_request(7.0, path=b"/v2/models/m/infer?via=handler"))
    protocol.connection_lost(None)  # before its handler's task took a step
    await until(lambda: not protocol.tasks)
    assert batcher.snapshot().classes["normal"].rejections["cancelled"] == 1
    assert 7.0 not in model.seen and transport.data == b""
