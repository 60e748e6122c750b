"""KServe v2 (Open Inference Protocol) over gRPC, served from the same repository as REST.

Only the wire differs from REST: a ``ModelInferRequest`` is decoded by the KServe codec
(:mod:`carpool.server.kserve.grpc_codec`) into the same typed request, checked by the same
``ServedModel.payload`` and ``submit_options``, and submitted to the same batcher, so gRPC
and HTTP requests share batches; the answer is encoded by the same codec.

Configuration and statistics are the REST JSON (``ServedModel.config()``,
:func:`~carpool.server.stats.model_stats`) parsed into the proto messages, so both wires
say the same thing. On a ``ModelStreamInfer`` stream each request runs as soon as it
arrives, so requests on one stream share batches with each other and with everyone else,
and the answers go back in request order, as Triton writes them for a model that is not
decoupled (a request done early waits for the ones before it)::

    client --> req a, req b, req c, (half-close)
    server <-- resp a, resp b, error c, (end: every request answered)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints
from google.protobuf import json_format  # type: ignore[import-untyped]  # no stubs installed
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from carpool import __version__
from carpool.errors import InvalidInput
from carpool.server.access import Access, grpc_interceptors
from carpool.server.classification import class_counts
from carpool.server.errors import (
    DEFAULT_MAX_REQUEST_BYTES,
    NotFound,
    PortInUse,
    echo,
    error_message,
    grpc_status,
)
from carpool.server.kserve.grpc_codec import decode_infer_request, encode_infer_response
from carpool.server.kserve.requested import wanted_outputs
from carpool.server.proto import grpc_service_pb2 as pb
from carpool.server.repository import ModelRepository, ServedModel
from carpool.server.stats import model_stats

__all__ = [
    "EXTENSIONS",
    "MAX_MESSAGE_BYTES",
    "MAX_RESPONSE_BYTES",
    "MAX_STREAM_UNANSWERED",
    "InferenceServicer",
    "bind_grpc_server",
    "host_port",
    "model_config",
    "model_statistics",
    "start_grpc_server",
]

# REST's (server/app.py) but binary_tensor_data, which is HTTP's.
EXTENSIONS = [
    "classification", "model_configuration", "statistics", "parameters", "schedule_policy"
]  # fmt: skip
MAX_MESSAGE_BYTES = DEFAULT_MAX_REQUEST_BYTES  # requests, as the REST body limit
# Responses, as Triton's server and tritonclient's channel: a protobuf message's ceiling. A
# smaller limit would fail an answer after its model ran (REST bounds no response).
MAX_RESPONSE_BYTES = 2**31 - 1
# Requests one ModelStreamInfer stream may have read and not yet answered. Past it the
# stream stops reading, so HTTP/2 flow control holds the client's further sends back:
# without a bound a client that never read its answers made the server read, run and
# keep answers for as long as it sent (700 MB of RSS in 25 s). Several batches' worth, so
# that one busy stream still fills batches while its earlier answers go out.
MAX_STREAM_UNANSWERED = 256
# A status's details, in characters: at most 4 bytes each in UTF-8, each byte outside
# printable ASCII three once percent-encoded, so under the 8 KiB a client takes (_details).
MAX_DETAILS_CHARS = 640


class InferenceServicer:
    """``inference.GRPCInferenceService`` over a :class:`ModelRepository`.

    Errors become gRPC statuses with the REST messages (:func:`grpc_status`). When the
    client goes away, grpc.aio cancels the handler, which takes a still-queued request out
    of its batcher before it reaches the model.
    """

    def __init__(self, repository: ModelRepository) -> None:
        self.repository = repository
        self.is_draining = False
        self._stream_readers: set[asyncio.Task[None]] = set()

    def drain(self) -> None:
        """The server is shutting down: every open ModelStreamInfer stream stops reading,
        answers the requests it has read and ends (UNAVAILABLE, unless its client had
        half-closed), so that an idle stream does not hold the shutdown for its whole
        grace. New calls are grpcio's to refuse (``server.stop``)."""
        self.is_draining = True
        for reader in self._stream_readers:
            reader.cancel()

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.repository.is_ready)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelReadyResponse:
        try:
            model = self.repository.get(request.name, request.version or None)
        except NotFound:  # not an error: Triton answers ready=false, as REST's 404 reads
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=model.is_ready)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="carpool", version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelMetadataResponse:
        try:
            model = self.repository.get(request.name, request.version or None)
        except Exception as exc:
            return refused_call(context, exc, pb.ModelMetadataResponse())
        meta = model.metadata()
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta["inputs"]],
            outputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta["outputs"]],
        )

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelInferResponse:
        try:
            return await self._infer(request)
        except Exception as exc:
            return refused_call(context, exc, pb.ModelInferResponse())

    async def ModelStreamInfer(
        self,
        requests: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Answer the stream's requests in the order they came, as Triton answers a
        model that is not decoupled; each is submitted as soon as it arrives, so requests
        of one stream still share batches. A failed request is an ``error_message``
        answer and the stream goes on. Once ``MAX_STREAM_UNANSWERED`` requests await
        their answers, reading pauses until the next answer is sent (sending waits for
        the client to read: HTTP/2 flow control). The stream ends once the client has
        half-closed and every request is answered; a message that is not a
        ``ModelInferRequest`` ends it with INVALID_ARGUMENT, and :meth:`drain` with
        UNAVAILABLE, after the answers owed before. When the client cancels, requests
        still queued are taken out of their batchers."""
        owed: asyncio.Queue[asyncio.Task[pb.ModelStreamInferResponse] | None] = asyncio.Queue()
        running: set[asyncio.Task[pb.ModelStreamInferResponse]] = set()
        room = asyncio.Semaphore(MAX_STREAM_UNANSWERED)

        async def read() -> None:
            try:
                async for request in requests:
                    task = asyncio.create_task(self._stream_answer(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    owed.put_nowait(task)
                    await room.acquire()  # released once an answer is sent
            finally:
                owed.put_nowait(None)  # also when reading fails: the writer must stop

        reader = asyncio.create_task(read())
        self._stream_readers.add(reader)
        reader.add_done_callback(self._stream_readers.discard)
        if self.is_draining:
            reader.cancel()
        try:
            while (task := await owed.get()) is not None:
                yield await task
                room.release()
            if reader.cancelled():  # by drain(): what the client sends next is not read
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "the server is shutting down: this stream's earlier requests are "
                    "answered, later ones were not read; send them again on a new stream",
                )
            try:
                await reader  # re-raises a failed read, which ends the RPC with its status
            except InvalidInput as exc:  # a message that did not parse (_strict_parser)
                await _abort(context, exc)
        finally:
            for pending in (reader, *running):
                pending.cancel()

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelConfigResponse:
        try:
            model = self.repository.get(request.name, request.version or None)
        except Exception as exc:
            return refused_call(context, exc, pb.ModelConfigResponse())
        return pb.ModelConfigResponse(config=model_config(model))

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelStatisticsResponse:
        try:
            if request.name:
                models = [self.repository.get(request.name, request.version or None)]
            else:  # as Triton: no name, every model
                models = list(self.repository)
        except Exception as exc:
            return refused_call(context, exc, pb.ModelStatisticsResponse())
        return pb.ModelStatisticsResponse(model_stats=[model_statistics(m) for m in models])

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RepositoryIndexResponse:
        index = pb.RepositoryIndexResponse()
        for entry in self.repository.index(is_ready_only=request.ready):
            index.models.add(**entry)
        return index

    async def _infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        arrival_s = time.monotonic()  # the message is in; the deadline counts from here
        model = self.repository.get(request.model_name, request.model_version or None)
        infer = decode_infer_request(request)
        payload = model.payload(infer)
        options = model.submit_options(infer)
        wanted = wanted_outputs(model, infer.outputs)
        classes = class_counts(infer.outputs, wanted)
        result = await model.run(payload, options, arrival_s)
        return encode_infer_response(model, infer.request_id, wanted, result, classes)

    async def _stream_answer(self, request: pb.ModelInferRequest) -> pb.ModelStreamInferResponse:
        try:
            answer = pb.ModelStreamInferResponse(infer_response=await self._infer(request))
        except Exception as exc:
            which = pb.ModelInferResponse(
                model_name=request.model_name, model_version=request.model_version, id=request.id
            )
            answer = pb.ModelStreamInferResponse(
                error_message=error_message(exc), infer_response=which
            )
        # As Triton, on every stream answer: this is the request's last (and only) one.
        # Clients that ask for triton_enable_empty_final_response wait for it.
        answer.infer_response.parameters["triton_final_response"].bool_param = True
        return answer


def model_config(model: ServedModel) -> pb.ModelConfig:
    """``model.config()``, the REST ``/config`` JSON, as Triton's ``ModelConfig`` message.

    Keys the proto subset lacks are dropped (a unit test checks that none are)."""
    config = pb.ModelConfig()
    json_format.ParseDict(model.config(), config, ignore_unknown_fields=True)
    return config


def model_statistics(model: ServedModel) -> pb.ModelStatistics:
    """:func:`model_stats`, the REST ``/stats`` JSON, as Triton's ``ModelStatistics``."""
    stats = pb.ModelStatistics()
    json_format.ParseDict(model_stats(model), stats, ignore_unknown_fields=True)
    return stats


_Response = TypeVar("_Response")


def refused_call(
    context: grpc.aio.ServicerContext[Any, Any], exc: Exception, empty: _Response
) -> _Response:
    """End a unary RPC with ``exc``'s status and message: the handler returns ``empty``
    with the status set. Not ``context.abort()``: the exception it raises kept every
    refused call's request alive (grpcio 1.85: 40 refused 5 MB calls held 600 MiB)."""
    context.set_code(grpc.StatusCode[grpc_status(exc)])
    context.set_details(_details(exc))
    return empty


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> NoReturn:
    """End the RPC with ``exc``'s status and message."""
    await context.abort(grpc.StatusCode[grpc_status(exc)], _details(exc))
    raise AssertionError("grpc.aio's context.abort() returned instead of raising")


def _details(exc: Exception) -> str:
    """``exc``'s message as a status's details, cut (:func:`echo`) to
    :data:`MAX_DETAILS_CHARS`. The details travel percent-encoded in the trailers, and past
    the client's metadata limit (grpc's 8 KiB soft, 16 KiB hard) the client gets
    RESOURCE_EXHAUSTED instead: an error repeating a long string the client sent would
    lose its status and its message."""
    return echo(error_message(exc), MAX_DETAILS_CHARS)


async def start_grpc_server(repository: ModelRepository, host: str, port: int) -> grpc.aio.Server:
    """Bind ``host:port`` and start serving ``repository``; the caller stops the server.

    Raises:
        PortInUse: the address cannot be bound.
    """
    server = bind_grpc_server(repository, host, port)
    await server.start()
    return server


def bind_grpc_server(
    repository: ModelRepository,
    host: str,
    port: int,
    servicer: InferenceServicer | None = None,
    *,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    access: Access | None = None,
    reuse_port: bool = False,
) -> grpc.aio.Server:
    """A gRPC server for ``repository`` (through ``servicer``, whose :meth:`drain
    <InferenceServicer.drain>` the caller calls on shutdown) bound to ``host:port``, not
    yet started. grpcio listens as soon as it binds: ``carpool serve`` binds it once the
    models are loaded, holding the port with a plain socket until then. A request message
    over ``max_message_bytes`` is refused with RESOURCE_EXHAUSTED; one without the API key
    of ``access``, if it has one, with UNAUTHENTICATED (:mod:`carpool.server.access`).
    ``reuse_port``: share the port with the other front-end workers (``--workers``).

    Raises:
        PortInUse: the address cannot be bound.
    """
    address = host_port(host, port)
    server = grpc.aio.server(
        interceptors=grpc_interceptors(access),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
            # grpcio sets SO_REUSEPORT by default: a second server on a port another gRPC
            # server holds would bind, and the kernel would split connections between them.
            ("grpc.so_reuseport", int(reuse_port)),
        ],
    )
    add_servicer(server, servicer or InferenceServicer(repository))
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises when the address is taken
        bound = 0
    if bound == 0:  # older grpcio: 0 instead of raising
        raise PortInUse(f"gRPC port {address}: could not bind (address in use?)")
    return server


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:8001``), as gRPC and URLs
    write it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def add_servicer(server: grpc.aio.Server, servicer: InferenceServicer) -> None:
    """Serve every RPC of ``inference.GRPCInferenceService`` on ``server`` with
    ``servicer``'s method of the same name, the handlers read from the proto's own
    service descriptor (what protoc's ``_pb2_grpc`` module would hold, without its base
    class of unimplemented methods: ``InferenceServicer`` implements all of them)."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in service.methods:
        request, response = (
            getattr(pb, method.input_type.name),
            getattr(pb, method.output_type.name),
        )
        behavior = getattr(servicer, method.name)
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                behavior,
                request_deserializer=_strict_parser(request),
                response_serializer=response.SerializeToString,
            )
        else:  # parsed in the handler, where a failure can be answered INVALID_ARGUMENT
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _parsing(behavior, request, response),
                response_serializer=response.SerializeToString,
            )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers), _NotServed())
    )


def _not_parsed(message: type[Any], error: DecodeError) -> InvalidInput:
    name = message.DESCRIPTOR.full_name
    return InvalidInput(
        f"the request message is not a valid {name} protobuf ({error}); send a serialized "
        f"{name}, as tritonclient.grpc does"
    )


def _parsing(
    behavior: Callable[[Any, Any], Awaitable[Any]], message: type[Any], response: type[Any]
) -> Any:
    """A unary handler that parses its request itself: grpcio answers a request that its
    deserializer cannot parse with UNKNOWN and the exception's repr."""
    parse = message.FromString

    async def handle(data: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            request = parse(data)
        except DecodeError as error:
            return refused_call(context, _not_parsed(message, error), response())
        return await behavior(request, context)

    return handle


def _strict_parser(message: type[Any]) -> Callable[[bytes], Any]:
    """A stream's deserializer: a message that does not parse raises InvalidInput, which
    the stream's reader hands on (ModelStreamInfer ends the stream INVALID_ARGUMENT)."""
    parse = message.FromString

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as error:
            raise _not_parsed(message, error) from None

    return deserialize


class _NotServed(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpcio has no hints
    """The RPCs of Triton's service that carpool does not serve (repository load/unload,
    shared memory, tracing, logging): UNIMPLEMENTED naming the RPC, where grpcio would
    say only "Method not found!"."""

    _PREFIX = "/inference.GRPCInferenceService/"

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        if not method.startswith(self._PREFIX):
            return None
        name = method.removeprefix(self._PREFIX)

        async def refuse(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"carpool does not serve {name}: repository load/unload, shared memory, "
                "tracing and log settings are not supported",
            )

        return grpc.unary_unary_rpc_method_handler(refuse)
