"""The gRPC port against hostile or clumsy clients: messages over the limits or not
protobuf at all, streams nobody reads, floods of calls and streams, keepalive ping floods,
HTTP/1.1 on the gRPC port, deadlines shorter than the batching delay, and SIGTERM with
streams open. Each test runs while steady good requests go on over gRPC and HTTP; those
must all be answered correctly, and the server's memory must not follow what the bad
client sends.

The tests whose docstrings start "Was:" failed before the fixes they name."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from carpool.server.grpc import MAX_MESSAGE_BYTES, MAX_STREAM_UNANSWERED

from .conftest import (
    SendOne,
    ServedProcess,
    StartServer,
    Steady,
    read_until_closed,
    rss_kb,
    start_served_process,
    wait_until,
)

CONFIG = """\
models:
  - name: doubler
    kind: python
    source: configmodels:double
    inputs: [{name: INPUT0, datatype: FP32, shape: [-1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [-1]}]
    max_batch_size: 16
    max_delay_s: 0.002
  - name: slow
    kind: python
    source: configmodels:slow_double
    inputs: [{name: INPUT0, datatype: FP32, shape: [1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [1]}]
    max_batch_size: 8
    max_delay_s: 0.05
"""
GATED = """\
models:
  - name: gated
    kind: python
    source: configmodels:gated
    inputs: [{name: X, datatype: INT64, shape: [1]}]
    outputs: [{name: Y, datatype: INT64, shape: [1]}]
    max_batch_size: 1
    max_delay_s: 0.001
"""
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
LIMIT_S = 30.0  # a net against a hung call, never a timing assertion
MEMORY_SLACK_KB = 32 * 1024  # far below what the bad clients send


def _request(i: int, *, width: int = 2, model: str = "doubler") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=str(i))
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, width])
    request.raw_input_contents.append(np.full(width, i, dtype="<f4").tobytes())
    return request


def _doubled(response: pb.ModelInferResponse) -> list[float]:
    return np.frombuffer(response.raw_output_contents[0], dtype="<f4").tolist()


@contextlib.contextmanager
def _grpc_and_http_session(served: ServedProcess) -> Iterator[SendOne]:
    """Good requests over gRPC (its own channel) and HTTP, each i on both (Steady's)."""
    assert served.grpc_url is not None
    url = f"http://{served.http_url}/v2/models/doubler/infer"
    with grpc.insecure_channel(served.grpc_url) as channel, httpx.Client(timeout=60) as http:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def send(i: int) -> str | None:
            answer = stub.ModelInfer(_request(i), timeout=60)
            body = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32"}]}
            body["inputs"][0]["data"] = [i]
            over_http = http.post(url, json=body)
            if _doubled(answer) != [2 * i, 2 * i] or answer.id != str(i):
                return f"gRPC {answer}"
            if over_http.json()["outputs"][0]["data"] != [2 * i]:
                return f"HTTP {over_http.status_code} {over_http.text}"
            return None

        yield send


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    process = start_served_process(CONFIG, tmp_path_factory.mktemp("grpc-abuse"), grpc=True)
    try:
        yield process
    finally:
        assert process.stop() == 0, process.output()
    assert "Traceback" not in process.output()


@pytest.fixture
def steady(served: ServedProcess) -> Iterator[Steady]:
    stream = Steady(lambda: _grpc_and_http_session(served))
    yield stream
    stream.check()


@pytest.fixture
def channel(served: ServedProcess) -> Iterator[grpc.Channel]:
    assert served.grpc_url is not None
    unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(served.grpc_url, options=unlimited) as channel:
        yield channel


def _raw(channel: grpc.Channel, method: str, *, is_stream: bool = False) -> Any:
    """A call that sends bytes as they are, and hands back the answers' bytes."""
    make = channel.stream_stream if is_stream else channel.unary_unary
    return make(method, request_serializer=bytes, response_deserializer=bytes)


# -- messages ------------------------------------------------------------------------------


def test_bytes_that_are_not_a_protobuf_are_invalid_argument(
    channel: grpc.Channel, steady: Steady
) -> None:
    """Was: grpcio's own answer to a failed deserializer, UNKNOWN "Unexpected <class
    'google.protobuf.message.DecodeError'>: ...", on the unary call and the stream."""
    garbage = b"\xff\xff\xff\xff not a protobuf"
    with pytest.raises(grpc.RpcError) as unary:
        _raw(channel, INFER)(garbage, timeout=LIMIT_S)
    answers: list[pb.ModelStreamInferResponse] = []
    messages = [_request(1).SerializeToString(), garbage, _request(2).SerializeToString()]
    with pytest.raises(grpc.RpcError) as stream:
        for answer in _raw(channel, STREAM_INFER, is_stream=True)(iter(messages), timeout=LIMIT_S):
            answers.append(pb.ModelStreamInferResponse.FromString(answer))
    for caught in (unary.value, stream.value):
        assert caught.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid inference.ModelInferRequest protobuf" in caught.details()
    # The request before the bad message was read, so it is answered before the end.
    assert [a.infer_response.id for a in answers] == ["1"]
    assert _doubled(answers[0].infer_response) == [2.0, 2.0]


def test_a_request_just_over_the_receive_limit_is_resource_exhausted(
    served: ServedProcess, channel: grpc.Channel, steady: Steady
) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    big = _request(1, width=MAX_MESSAGE_BYTES // 4 + 1)
    before = rss_kb(served.process.pid)
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(big, timeout=LIMIT_S)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"larger than max ({big.ByteSize()} vs. {MAX_MESSAGE_BYTES})" in caught.value.details()
    assert rss_kb(served.process.pid) - before < MEMORY_SLACK_KB
    assert _doubled(stub.ModelInfer(_request(3), timeout=LIMIT_S)) == [6.0, 6.0]


@pytest.mark.parametrize(
    "metadata",
    [[("x-big", "a" * 17_000)], [(f"x-h{i}", "v") for i in range(2000)]],
    ids=["one-17kb-value", "2000-entries"],
)
def test_metadata_over_grpcs_limit_is_resource_exhausted(
    channel: grpc.Channel, steady: Steady, metadata: list[tuple[str, str]]
) -> None:
    # grpc core's own limits (grpc.max_metadata_size: 8 KiB soft, 16 KiB hard), which
    # carpool keeps; over HTTP the head limit is 64 KiB.
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(_request(1), metadata=metadata, timeout=LIMIT_S)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_malformed_requests_get_invalid_argument_naming_the_problem(
    channel: grpc.Channel, steady: Steady
) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    many = pb.ModelInferRequest(model_name="doubler")
    for i in range(5000):
        many.inputs.add(name=f"IN{i}", datatype="FP32", shape=[1, 1])
        many.raw_input_contents.append(b"\0\0\0\0")
    extra_raw = _request(2)
    extra_raw.raw_input_contents.append(b"1234")
    huge_shape = pb.ModelInferRequest(model_name="doubler")
    huge_shape.inputs.add(name="INPUT0", datatype="FP32", shape=[2**40, 2**40])
    huge_shape.raw_input_contents.append(b"")
    cases = [
        (many, "unknown input 'IN0' for model 'doubler'; expected ['INPUT0']"),
        (extra_raw, "raw_input_contents has 2 entries but the request has 1 inputs"),
        (huge_shape, "raw_input_contents has 0 bytes but 1208925819614629174706176 elements"),
    ]
    for request, message in cases:
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request, timeout=LIMIT_S)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in caught.value.details()


def test_unknown_fields_are_skipped_as_protobuf_does(channel: grpc.Channel) -> None:
    # Field 99, a varint: what a newer client's field looks like to an older server.
    message = _request(7).SerializeToString() + b"\x98\x06\x01"
    answer = pb.ModelInferResponse.FromString(_raw(channel, INFER)(message, timeout=LIMIT_S))
    assert answer.id == "7" and _doubled(answer) == [14.0, 14.0]


# -- streams -------------------------------------------------------------------------------


def test_a_stream_whose_answers_are_never_read_is_held_back(
    served: ServedProcess, steady: Steady
) -> None:
    """Was: the stream read, ran and kept every request's answer for as long as the
    client sent: 95,000 requests and 600 MB of RSS in 24 s. Now it stops reading
    after MAX_STREAM_UNANSWERED unanswered requests, and HTTP/2 flow control stops
    the client's sends."""
    assert served.grpc_url is not None
    limit = 20_000  # 80 MB of requests; far more than the bound and the HTTP/2 windows
    sent = itertools.count()
    counted = [0]

    def requests() -> Iterator[pb.ModelInferRequest]:
        for i in range(limit):
            counted[0] = next(sent)
            yield _request(i, width=1024)

    before = rss_kb(served.process.pid)
    with grpc.insecure_channel(served.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer(requests())  # never read
        last = [-1]

        def is_held_back() -> bool:
            # A send blocked for a second: the server held the client back, as meant.
            if counted[0] == last[0] or counted[0] == limit - 1:
                return True
            last[0] = counted[0]
            threading.Event().wait(1.0)
            return False

        wait_until(is_held_back, "the client's sends to stop or run out")
        grown_kb = rss_kb(served.process.pid) - before
        call.cancel()
    assert counted[0] < limit - 1, "the server read 80 MB of requests nobody read answers for"
    assert counted[0] > MAX_STREAM_UNANSWERED
    assert grown_kb < MEMORY_SLACK_KB


def test_thousands_of_concurrent_streams_from_one_client_are_all_answered(
    served: ServedProcess, steady: Steady
) -> None:
    assert served.grpc_url is not None
    url = served.grpc_url

    async def run() -> list[list[pb.ModelStreamInferResponse]]:
        async with grpc.aio.insecure_channel(url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            calls = [stub.ModelStreamInfer(iter([_request(i)])) for i in range(1000)]

            async def answers(call: Any) -> list[pb.ModelStreamInferResponse]:
                return [answer async for answer in call]

            return await asyncio.gather(*(answers(call) for call in calls))

    results = asyncio.run(run())
    assert [[a.infer_response.id for a in r] for r in results] == [[str(i)] for i in range(1000)]
    assert all(not r[0].error_message for r in results)


def test_a_stream_cancelled_halfway_harms_nothing(served: ServedProcess, steady: Steady) -> None:
    assert served.grpc_url is not None
    pending: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()

    def requests() -> Iterator[pb.ModelInferRequest]:
        while (request := pending.get()) is not None:
            yield request

    with grpc.insecure_channel(served.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer(requests())
        for i in range(40):
            pending.put(_request(i, width=1, model="slow"))
        first = next(call)
        call.cancel()
        pending.put(None)
        assert first.infer_response.id == "0"
        again = stub.ModelStreamInfer(iter([_request(5, width=1, model="slow")]))
        assert [_doubled(a.infer_response) for a in again] == [[10.0]]


# -- connections ---------------------------------------------------------------------------


def test_a_keepalive_ping_flood_gets_goaway_and_harms_no_one(
    served: ServedProcess, steady: Steady
) -> None:
    # grpc core's defaults, which carpool keeps (as Triton's): pings without data closer
    # than 5 minutes are strikes; after 2 the connection gets GOAWAY too_many_pings.
    assert served.grpc_url is not None
    flood = [
        ("grpc.keepalive_time_ms", 10),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    with grpc.insecure_channel(served.grpc_url, options=flood) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert _doubled(stub.ModelInfer(_request(1), timeout=LIMIT_S)) == [2.0, 2.0]
        held = threading.Event()

        def nothing() -> Iterator[pb.ModelInferRequest]:
            held.wait(LIMIT_S)  # an open stream that sends no data: only pings go
            yield from ()

        with pytest.raises(grpc.RpcError) as caught:
            list(stub.ModelStreamInfer(nothing(), timeout=LIMIT_S))
        held.set()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "Too many pings" in caught.value.details()


def test_http11_on_the_grpc_port_is_closed_without_harm(
    served: ServedProcess, steady: Steady
) -> None:
    assert served.grpc_url is not None
    host, port = served.grpc_url.split(":")
    with socket.create_connection((host, int(port)), timeout=LIMIT_S) as sock:
        sock.sendall(b"POST /v2/models/doubler/infer HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = read_until_closed(sock)
    assert not answer.startswith(b"HTTP/1.1")  # HTTP/2 frames (SETTINGS, GOAWAY), then a close


def test_many_idle_channels_cost_a_descriptor_each_and_free_it(
    served: ServedProcess, steady: Steady
) -> None:
    assert served.grpc_url is not None
    fds = Path(f"/proc/{served.process.pid}/fd")
    before = len(list(fds.iterdir()))
    own_pool = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
    channels = [grpc.insecure_channel(served.grpc_url, options=own_pool) for _ in range(300)]
    try:
        for channel in channels:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ServerLive(pb.ServerLiveRequest(), timeout=LIMIT_S).live
        assert len(list(fds.iterdir())) >= before + 300  # idle gRPC connections are kept
    finally:
        for channel in channels:
            channel.close()
    wait_until(lambda: len(list(fds.iterdir())) < before + 10, "the connections to be closed")


def test_a_deadline_shorter_than_the_batching_delay_is_deadline_exceeded(
    channel: grpc.Channel, steady: Steady
) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    for i in range(20):  # the slow model waits up to 50 ms for a batch to fill
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(_request(i, width=1, model="slow"), timeout=0.005)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    answer = stub.ModelInfer(_request(9, width=1, model="slow"), timeout=LIMIT_S)
    assert _doubled(answer) == [18.0]


# -- SIGTERM with streams open -------------------------------------------------------------


def _gated(value: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="gated", id=str(value))
    request.inputs.add(name="X", datatype="INT64", shape=[1, 1])
    request.raw_input_contents.append(np.array([value], dtype="<i8").tobytes())
    return request


def _pending(http_url: str) -> float:
    text = httpx.get(f"http://{http_url}/metrics", timeout=LIMIT_S).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("carpool_pending_requests{") and 'model="gated"' in line
    )


def test_sigterm_answers_every_stream_request_and_ends_open_streams(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Was: a stream its client kept open (idle, or with every request answered) held
    the shutdown for the whole 30 s grace, then ended "Cancelling all calls"."""
    seen, gate = tmp_path / "seen.txt", tmp_path / "gate"
    gate.touch()
    env = {"CARPOOL_TEST_SEEN": str(seen), "CARPOOL_TEST_GATE": str(gate)}
    server = start_server(GATED, grpc=True, env=env)
    assert server.grpc_url is not None
    outcomes: dict[str, list[Any]] = {"idle": [], "busy": []}
    feeds: dict[str, queue.Queue[pb.ModelInferRequest | None]] = {
        name: queue.Queue() for name in outcomes
    }

    def follow(name: str, call: Any) -> None:
        try:
            for answer in call:
                outcomes[name].append(answer.infer_response.id or answer.error_message)
        except grpc.RpcError as end:
            outcomes[name].append((end.code(), end.details()))

    def requests(name: str) -> Iterator[pb.ModelInferRequest]:
        while (request := feeds[name].get()) is not None:
            yield request

    channel = grpc.insecure_channel(server.grpc_url)
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        readers = [
            threading.Thread(
                target=follow, args=(name, stub.ModelStreamInfer(requests(name))), daemon=True
            )
            for name in outcomes
        ]
        for reader in readers:
            reader.start()
        for value in range(1, 11):
            feeds["busy"].put(_gated(value))
        wait_until(lambda: seen.exists() and "1" in seen.read_text().split(), "1 to run")
        # 1 runs; 2 may wait in the batch formed behind it; the rest are queued: all read.
        wait_until(lambda: _pending(server.http_url) >= 8, "2 to 10 to be queued")
        server.process.send_signal(signal.SIGTERM)
        server.stopped = True
        wait_until(lambda: "stopping" in server.output(), "the server to begin its drain")
        gate.unlink()
        for reader in readers:
            reader.join(timeout=60)
        status = server.process.wait(timeout=60)
    finally:
        gate.unlink(missing_ok=True)
        for feed in feeds.values():
            feed.put(None)
        channel.close()
    assert status == 0, server.output()
    assert outcomes["busy"][:-1] == [str(v) for v in range(1, 11)]
    for name in outcomes:
        code, details = outcomes[name][-1]
        assert code == grpc.StatusCode.UNAVAILABLE
        assert details.startswith("the server is shutting down"), details
    assert "Traceback" not in server.output()


def test_a_huge_model_version_is_not_found_with_the_echo_cut(
    channel: grpc.Channel, served: ServedProcess, steady: Steady
) -> None:
    """Was: a 1 MiB model_version was echoed in the NOT_FOUND details, over the 16 KiB of
    metadata a status may carry, so the client got RESOURCE_EXHAUSTED instead."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = _request(1)
    request.model_version = "9" * (1 << 20)
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request, timeout=LIMIT_S)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(caught.value.details()) < 1024
    assert "... (cut: " in caught.value.details()
    long_name = "m" * 60_000
    answer = httpx.get(f"http://{served.http_url}/v2/models/{long_name}", timeout=LIMIT_S)
    assert answer.status_code == 404
    assert len(answer.content) < 1024


@pytest.mark.parametrize("char", ["x", "\u00e9"])  # one byte in UTF-8, and two (six encoded)
def test_an_error_repeating_a_long_input_name_stays_invalid_argument(
    channel: grpc.Channel, steady: Steady, char: str
) -> None:
    """Was: an unknown input's 20,000-character name was repeated whole in the details,
    past the client's 16 KiB of metadata, so the client got RESOURCE_EXHAUSTED and no
    message."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = pb.ModelInferRequest(model_name="doubler")
    request.inputs.add(name=char * 20_000, datatype="FP32", shape=[1, 1])
    request.raw_input_contents.append(b"\0\0\0\0")
    for _ in range(5):  # between the soft and hard limits grpc refused some calls only
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request, timeout=LIMIT_S)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("unknown input '" + char * 100)
        assert caught.value.details().endswith("characters)")


def test_refused_calls_leave_the_servers_memory_flat(
    channel: grpc.Channel, served: ServedProcess, steady: Steady
) -> None:
    """Was: every refused call kept about 1-3x its message (grpc.aio's context.abort()):
    40 refused 5 MB calls took the server from 473 to 1,094 MiB RSS."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = _request(1, width=256 * 1024, model="no-such-model")  # 1 MiB of FP32

    def refuse(count: int) -> None:
        for _ in range(count):
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(request, timeout=LIMIT_S)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    garbage = b"\xff" * (1 << 20)  # not a protobuf: refused before it is parsed

    def refuse_unparsed(count: int) -> None:
        for _ in range(count):
            with pytest.raises(grpc.RpcError) as caught:
                _raw(channel, INFER)(garbage, timeout=LIMIT_S)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    refuse(20)  # allocator and grpcio warm-up
    refuse_unparsed(20)
    before = rss_kb(served.process.pid)
    refuse(200)  # 200 MiB sent: a leak of even half of it shows
    refuse_unparsed(200)
    assert rss_kb(served.process.pid) - before < MEMORY_SLACK_KB
