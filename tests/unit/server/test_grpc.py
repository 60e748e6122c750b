"""The gRPC service: the proto against Triton's own descriptors, config and statistics
messages, a stream driven directly, without sockets, and ModelReady as tritonclient reads
it, on loopback (decoding and encoding are the codec's:
tests/unit/server/kserve/test_grpc_codec.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, EnumDescriptor

from carpool import Batcher, BatchPolicy, ClassPolicy
from carpool.core.clock import settle
from carpool.server.errors import PortInUse
from carpool.server.grpc import (
    InferenceServicer,
    add_servicer,
    model_config,
    model_statistics,
    start_grpc_server,
)
from carpool.server.proto import grpc_service_pb2 as pb
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec

# ---------------------------------------------------------------------------------------
# The proto against Triton's


def _triton_pool() -> Any:
    from tritonclient.grpc import model_config_pb2, service_pb2

    assert service_pb2.DESCRIPTOR.pool is model_config_pb2.DESCRIPTOR.pool
    return service_pb2.DESCRIPTOR.pool


def _messages(descriptor: Descriptor) -> list[Descriptor]:
    nested = [m for n in descriptor.nested_types for m in _messages(n)]
    return [descriptor, *nested]


def _enums() -> list[EnumDescriptor]:
    top = list(pb.DESCRIPTOR.enum_types_by_name.values())
    messages = [m for d in pb.DESCRIPTOR.message_types_by_name.values() for m in _messages(d)]
    return top + [e for m in messages for e in m.enum_types]


def _field_type(field: Any) -> str:
    kind = field.message_type or field.enum_type
    return kind.full_name if kind is not None else str(field.type)


def test_every_message_field_has_tritons_number_and_type() -> None:
    triton = _triton_pool()
    messages = [m for d in pb.DESCRIPTOR.message_types_by_name.values() for m in _messages(d)]
    assert len(messages) > 30
    for message in messages:
        theirs = triton.FindMessageTypeByName(message.full_name)
        for field in message.fields:
            their = theirs.fields_by_name[field.name]
            where = f"{message.full_name}.{field.name}"
            assert field.number == their.number, where
            assert _field_type(field) == _field_type(their), where
            assert field.is_repeated == their.is_repeated, where
            oneof = field.containing_oneof
            their_oneof = their.containing_oneof
            assert (oneof and oneof.name) == (their_oneof and their_oneof.name), where


def test_every_enum_value_is_tritons() -> None:
    triton = _triton_pool()
    enums = _enums()
    assert {e.full_name for e in enums} == {
        "inference.DataType",
        "inference.ModelInstanceGroup.Kind",
        "inference.ModelQueuePolicy.TimeoutAction",
    }
    for enum in enums:
        theirs = triton.FindEnumTypeByName(enum.full_name)
        assert {v.name: v.number for v in enum.values} == {v.name: v.number for v in theirs.values}


def test_every_rpc_has_tritons_signature() -> None:
    theirs = _triton_pool().FindServiceByName("inference.GRPCInferenceService")
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert {"ModelStreamInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex"} <= set(
        ours.methods_by_name
    )
    for method in ours.methods:
        their = theirs.methods_by_name[method.name]
        assert method.input_type.full_name == their.input_type.full_name
        assert method.output_type.full_name == their.output_type.full_name
        assert method.client_streaming == their.client_streaming, method.name
        assert method.server_streaming == their.server_streaming, method.name


@pytest.mark.parametrize(
    "modules",
    [
        ("tritonclient.grpc", "carpool.server.grpc"),
        ("carpool.server.grpc", "tritonclient.grpc"),
    ],
)
def test_imports_alongside_tritonclient(modules: tuple[str, str]) -> None:
    # A fresh interpreter: in this one both may already be imported, in either order.
    code = "; ".join(f"import {m}" for m in modules) + (
        "; from carpool.server.proto import grpc_service_pb2 as pb"
        "; from tritonclient.grpc import service_pb2"
        "; assert pb.ModelConfigResponse.FromString("
        "service_pb2.ModelConfigResponse(config={'name': 'm'}).SerializeToString()"
        ").config.name == 'm'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------
# Configuration and statistics


def _served(infer: Any = None, num_replicas: int = 1) -> ServedModel:
    policy = BatchPolicy(
        max_batch_size=8,
        max_delay_s=0.002,
        preferred_batch_sizes=(4, 8),
        classes=(ClassPolicy("high"), ClassPolicy("normal"), ClassPolicy("low")),
        default_class="normal",
    )
    batcher = Batcher(
        lambda inputs: {
            "y": inputs["x"],
            "tag": np.array([[b"t"]] * len(inputs["x"]), dtype=object),
        },
        policy,
        collate="dict",
        num_replicas=num_replicas,
    )
    return ServedModel(
        "m",
        "1",
        "python",
        (TensorSpec("x", "FP32", (2,)), TensorSpec("ids", "INT64", (-1,), ragged=True)),
        (TensorSpec("y", "FP32", (2,)), TensorSpec("tag", "BYTES", (1,))),
        batcher,
        infer=infer,
    )


def test_model_config_carries_every_key_of_the_rest_config() -> None:
    model = _served(num_replicas=2)
    strict = json_format.ParseDict(model.config(), pb.ModelConfig())  # raises on unknown keys
    config = model_config(model)
    assert config == strict
    assert (config.name, config.platform, config.max_batch_size) == ("m", "python", 8)
    x, ids = config.input
    assert (x.data_type, list(x.dims), x.allow_ragged_batch) == (pb.TYPE_FP32, [2], False)
    assert (ids.data_type, list(ids.dims), ids.allow_ragged_batch) == (pb.TYPE_INT64, [-1], True)
    assert config.output[1].data_type == pb.TYPE_STRING
    batching = config.dynamic_batching
    assert list(batching.preferred_batch_size) == [4, 8]
    assert batching.max_queue_delay_microseconds == 2000
    assert (batching.priority_levels, batching.default_priority_level) == (3, 2)
    (group,) = config.instance_group
    assert (group.count, group.kind) == (2, pb.ModelInstanceGroup.KIND_CPU)


def test_model_config_shows_each_class_queue_as_tritons_queue_policy() -> None:
    # A Triton user reads a model's queue bounds and timeouts from dynamic_batching's
    # default_queue_policy / priority_queue_policy; carpool's classes are its levels.
    policy = BatchPolicy(
        max_batch_size=8,
        max_queue_size=100,  # shared by every class
        timeout_s=2.0,
        classes=(
            ClassPolicy("interactive", max_queue_size=10, timeout_s=0.05),
            ClassPolicy("normal"),
            ClassPolicy("background", max_queue_size=500),
        ),
        default_class="normal",
    )
    batcher = Batcher(lambda inputs: inputs, policy, collate="dict")
    spec = TensorSpec("x", "FP32", (2,))
    served = ServedModel("m", "1", "python", (spec,), (spec,), batcher)
    rest = served.config()["dynamic_batching"]
    expected = {
        "1": {"max_queue_size": 10, "default_timeout_microseconds": 50_000},
        "2": {"max_queue_size": 100, "default_timeout_microseconds": 2_000_000},
        "3": {"max_queue_size": 100, "default_timeout_microseconds": 2_000_000},
    }
    for level, values in expected.items():
        queue = rest["priority_queue_policy"][level]
        assert {k: queue[k] for k in values} == values, level
        assert (queue["timeout_action"], queue["allow_timeout_override"]) == ("REJECT", True)
    assert rest["default_queue_policy"] == rest["priority_queue_policy"]["2"]
    batching = model_config(served).dynamic_batching
    assert batching.priority_queue_policy[1].max_queue_size == 10
    assert batching.priority_queue_policy[1].default_timeout_microseconds == 50_000
    assert batching.default_queue_policy.max_queue_size == 100
    assert batching.default_queue_policy.timeout_action == pb.ModelQueuePolicy.REJECT


def test_model_config_of_a_model_without_bounds_has_unbounded_queues() -> None:
    batcher = Batcher(lambda inputs: inputs, BatchPolicy(max_batch_size=4), collate="dict")
    spec = TensorSpec("x", "FP32", (2,))
    served = ServedModel("m", "1", "python", (spec,), (spec,), batcher)
    batching = served.config()["dynamic_batching"]
    levels = batching["priority_queue_policy"]
    assert sorted(levels) == ["1", "2", "3"]  # the default classes
    for level in levels.values():
        assert (level["max_queue_size"], level["default_timeout_microseconds"]) == (0, 0)


async def test_model_statistics_carry_every_key_of_the_rest_stats() -> None:
    from carpool.server.stats import model_stats

    model = _served()
    await model.batcher.start()
    try:
        await model.run({"x": np.ones((3, 2), np.float32)}, {})
    finally:
        await model.batcher.stop()
    strict = json_format.ParseDict(model_stats(model), pb.ModelStatistics())
    stats = model_statistics(model)
    assert stats == strict
    assert (stats.inference_count, stats.execution_count) == (3, 1)
    assert stats.inference_stats.success.count == 1
    assert [(b.batch_size, b.compute_infer.count) for b in stats.batch_stats] == [(3, 1)]


# ---------------------------------------------------------------------------------------
# ModelReady, as tritonclient reads it


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


@pytest.mark.parametrize(("name", "version"), [("nope", ""), ("m", "2")])
async def test_grpc_model_ready_of_an_unknown_model_is_false_not_an_error(
    grpc_client: grpcclient.InferenceServerClient, name: str, version: str
) -> None:
    # Triton's ModelIsReady answers ready=false with status OK for a model or version it
    # does not have, so tritonclient.grpc's is_model_ready() returns False (as the HTTP
    # client does on carpool's 404). carpool aborts with NOT_FOUND, so it raises.
    assert await grpc_client.is_model_ready("m")
    assert await grpc_client.is_model_ready(name, version) is False


# ---------------------------------------------------------------------------------------
# Streaming


class GatedInfer:
    """Answers ``y = x`` for a request once the gate of its first value opens."""

    def __init__(self) -> None:
        self.gates: dict[float, asyncio.Event] = {}
        self.entered: dict[float, asyncio.Event] = {}
        self.answered: dict[float, asyncio.Event] = {}
        self.cancelled = asyncio.Event()  # some request was cancelled at its gate

    def gate(self, value: float) -> asyncio.Event:
        return self.gates.setdefault(value, asyncio.Event())

    def entry(self, value: float) -> asyncio.Event:
        return self.entered.setdefault(value, asyncio.Event())

    def answer(self, value: float) -> asyncio.Event:
        return self.answered.setdefault(value, asyncio.Event())

    async def __call__(self, payload: dict[str, np.ndarray], options: dict[str, Any]) -> Any:
        x = payload["x"]
        value = float(x[0, 0])
        self.entry(value).set()
        try:
            await self.gate(value).wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.answer(value).set()
        return {"y": x, "tag": np.array([[b"t"]] * len(x), dtype=object)}


def _stream_request(request_id: str, value: float, width: int = 2) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", id=request_id)
    request.inputs.add(name="x", datatype="FP32", shape=[1, width])
    request.inputs.add(name="ids", datatype="INT64", shape=[1, 1])
    request.raw_input_contents.extend(
        [np.full((1, width), value, "<f4").tobytes(), np.zeros((1, 1), "<i8").tobytes()]
    )
    request.outputs.add(name="y")
    return request


async def test_stream_runs_requests_at_once_and_answers_them_in_order() -> None:
    infer = GatedInfer()
    servicer = InferenceServicer(ModelRepository([_served(infer)]))
    incoming: asyncio.Queue[pb.ModelInferRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        while (request := await incoming.get()) is not None:
            yield request

    stream = servicer.ModelStreamInfer(requests(), context=None)
    incoming.put_nowait(_stream_request("slow", 1.0))
    incoming.put_nowait(_stream_request("bad", 3.0, width=3))
    incoming.put_nowait(_stream_request("fast", 2.0))
    first = asyncio.ensure_future(anext(stream))
    infer.gate(2.0).set()
    await infer.entry(1.0).wait()  # "slow" reached its model ...
    await infer.entry(2.0).wait()  # ... and so did "fast", behind it on the stream
    await infer.answer(2.0).wait()
    await settle()
    assert not first.done()  # "fast" is done, but "slow" is owed its answer first
    infer.gate(1.0).set()
    incoming.put_nowait(None)  # the client half-closes
    answers = [await first, await anext(stream), await anext(stream)]
    assert [a.infer_response.id for a in answers] == ["slow", "bad", "fast"]
    slow, bad, fast = answers
    assert slow.error_message == fast.error_message == ""
    (y,) = fast.infer_response.raw_output_contents
    assert np.frombuffer(y, "<f4").tolist() == [2.0, 2.0]
    assert "shape [1, 3]" in bad.error_message
    assert bad.infer_response.model_name == "m"
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_cancelling_a_stream_cancels_its_running_requests() -> None:
    infer = GatedInfer()
    servicer = InferenceServicer(ModelRepository([_served(infer)]))

    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        yield _stream_request("held", 1.0)
        await asyncio.Event().wait()  # the client never half-closes

    stream = servicer.ModelStreamInfer(requests(), context=None)
    waiting = asyncio.ensure_future(anext(stream))
    await infer.entry(1.0).wait()
    waiting.cancel()  # as grpc.aio does when the client cancels the call
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await infer.cancelled.wait()  # set by the handler's cleanup, which cancels the request


async def test_a_grpc_port_another_grpc_server_holds_is_refused() -> None:
    # docs/server.md: a port already taken, HTTP or gRPC, stops carpool serve (exit 3).
    # grpcio binds with SO_REUSEPORT unless told not to, so a second server would share it.
    import socket

    with socket.socket() as probe:  # a free port, for `first` to take
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    repository = ModelRepository([])
    first = await start_grpc_server(repository, "127.0.0.1", port)
    try:
        with pytest.raises(PortInUse, match=str(port)):
            second = await start_grpc_server(repository, "127.0.0.1", port)
            await second.stop(None)
    finally:
        await first.stop(None)
