"""A front-end worker process: carpool's HTTP/1.1 server and the gRPC servicer on ports it
shares with the other workers (SO_REUSEPORT), over mirrors of the engine's models.

What runs here and what is handed to the engine::

    health probes (HTTP, gRPC)            answered here, from the engine's readiness flags
    KServe infer (HTTP fast path, gRPC)   decoded and checked here, queued through the ring
    model metadata (gRPC)                 answered here: the specs do not change
    every other HTTP route, gRPC config
    and statistics                        forwarded whole, answered by the engine

SIGTERM or SIGINT: stop accepting, answer what was accepted (the engine answers its
hand-offs), exit 0. The engine's end of the channel closing (it exited or died): the same,
the requests still waiting failing with 503 / UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import math
import os
import pickle
import signal
import socket
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import uvloop

from carpool.core.policy import BatchPolicy
from carpool.server.access import Access
from carpool.server.app import KServeApp
from carpool.server.banner import use_default_logging
from carpool.server.grpc import bind_grpc_server
from carpool.server.heap import freeze_startup_heap
from carpool.server.http.server import HttpServer
from carpool.server.limits import ServerLimits
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec
from carpool.server.workers.channel import Channel
from carpool.server.workers.forward import WorkerDispatch, WorkerServicer
from carpool.server.workers.front import Link, RemoteFront
from carpool.server.workers.records import Kind
from carpool.server.workers.ring import Ring

log = logging.getLogger("carpool.server.workers")
COUNTS_EVERY_S = 0.5  # how often a worker reports its counters to the engine
GRACE_EXTRA_S = 1.0


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a worker needs of one of the engine's models: its tensors, its policy (for
    the priority levels and timeouts it checks) and where its readiness flag is."""

    name: str
    version: str
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    policy: bytes  # pickled BatchPolicy
    policy_version: int
    devices: tuple[str, ...]
    is_run: bool  # answered by the model's own run (embeddings, generation)
    ready_index: int


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker process starts from (pickled by the spawn)."""

    index: int
    host: str
    port: int
    grpc_port: int | None
    sock: socket.socket  # the worker's end of the notification socket
    to_engine: str  # ring names
    to_worker: str
    ring_bytes: int
    ready_flags: str  # shared memory: one byte per model
    models: tuple[ModelSpec, ...]
    max_request_bytes: int
    limits: ServerLimits
    api_key: str | None
    protect_metrics: bool
    allow_policy_updates: bool
    drain_timeout_s: float
    log_level: int


def run_worker(spec: WorkerSpec) -> None:
    """The worker process's entry point."""
    use_default_logging()
    for name in ("carpool.server.http", "carpool.server.access"):
        logging.getLogger(name).setLevel(spec.log_level)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(spec))


def _mirror(spec: ModelSpec, link: Link, flags: shared_memory.SharedMemory) -> ServedModel:
    policy = pickle.loads(spec.policy)
    assert isinstance(policy, BatchPolicy)
    front = RemoteFront(
        spec.name,
        link,
        policy,
        spec.policy_version,
        spec.devices,
        functools.partial(_is_flagged, flags, spec.ready_index),
        run=spec.is_run,
    )
    return ServedModel(
        name=spec.name,
        version=spec.version,
        platform=spec.platform,
        inputs=spec.inputs,
        outputs=spec.outputs,
        batcher=front,
        infer=front.run if spec.is_run else None,
    )


def _is_flagged(flags: shared_memory.SharedMemory, index: int) -> bool:
    buf = flags.buf
    return buf is not None and buf[index] == 1


def bind_shared(host: str, port: int, *, listens: bool = False) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT, so every worker (and the
    engine, holding the port) binds it: the kernel spreads connections over the ones
    that listen.

    A worker's socket (``listens``) has SO_REUSEADDR too: the connections it accepts
    inherit it, so their TIME_WAIT after a stop does not hold the port against the next
    server's check (:func:`carpool.server.run.check_ports`, which retries with it). The
    engine's holding socket binds without it, so that a second server's check does not
    get the port while it is held and not yet listened on; only where a previous run's
    TIME_WAIT without SO_REUSEPORT (a server without workers) refuses that bind, it binds
    with SO_REUSEADDR and then clears it (a later bind sees the option as it is now)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    def bound(reuse_address: bool) -> socket.socket:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if reuse_address:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
        except OSError:
            sock.close()
            raise
        return sock

    if listens:
        return bound(True)
    try:
        return bound(False)
    except OSError as error:
        if error.errno != errno.EADDRINUSE:
            raise
    sock = bound(True)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    return sock


async def _serve(spec: WorkerSpec) -> None:
    loop = asyncio.get_running_loop()
    flags = shared_memory.SharedMemory(spec.ready_flags)
    to_engine = Ring(spec.to_engine, spec.ring_bytes, create=False)
    to_worker = Ring(spec.to_worker, spec.ring_bytes, create=False)
    stopping = asyncio.Event()
    link = Link()

    def engine_lost() -> None:
        # What waits on the engine fails now (503, UNAVAILABLE): the drain below waits
        # for every accepted request's answer, which a dead engine would never send.
        link.lost()
        stopping.set()

    channel = Channel(to_engine, to_worker, link.on_record, engine_lost)
    spec.sock.setblocking(False)
    await loop.create_unix_connection(lambda: channel, sock=spec.sock)
    link.channel = channel
    repository = ModelRepository([_mirror(m, link, flags) for m in spec.models])
    access = Access(spec.api_key, spec.protect_metrics, spec.allow_policy_updates)
    app = KServeApp(
        repository, max_body_bytes=spec.max_request_bytes, limits=spec.limits, access=access
    )
    http = HttpServer(app)
    http.dispatch = WorkerDispatch(app, link, lambda: _counts(spec.index, http))
    listener = bind_shared(spec.host, spec.port, listens=True)
    grpc_server = None
    servicer = WorkerServicer(repository, link)
    if spec.grpc_port:
        grpc_server = bind_grpc_server(
            repository,
            spec.host,
            spec.grpc_port,
            servicer,
            max_message_bytes=spec.max_request_bytes,
            access=access,
            reuse_port=True,
        )
        await grpc_server.start()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    freeze_startup_heap()  # the collector off the request path, as in one process
    http.start([listener])
    link.send(Kind.COUNTS, {**_counts(spec.index, http), "listening": True})
    reporting = asyncio.ensure_future(_report(link, spec.index, http))
    await stopping.wait()
    link.is_stopping = True  # new hand-offs refused (503), accepted ones answered
    grace_s = spec.drain_timeout_s + GRACE_EXTRA_S
    grpc_stopped = None
    if grpc_server is not None:
        grpc_stopped = asyncio.ensure_future(grpc_server.stop(grace_s))
        servicer.drain()
    await http.shutdown(math.ceil(grace_s))
    http.close()
    if grpc_stopped is not None:
        await grpc_stopped
    reporting.cancel()
    if link.is_open:
        link.send(Kind.COUNTS, _counts(spec.index, http))
    channel.close()
    link.lost()
    to_engine.close()
    to_worker.close()
    flags.close()
    log.debug("worker %d (pid %d) stopped", spec.index, os.getpid())


def _counts(index: int, http: HttpServer) -> dict[str, Any]:
    inflight = http.app.inflight  # this worker's own --max-inflight-bytes
    return {
        "worker": index,
        "requests": http.num_requests,
        "connections": http.num_accepted,
        "inflight_bytes": inflight.held_bytes,
        "refused_inflight": inflight.num_refused,
    }


async def _report(link: Link, index: int, http: HttpServer) -> None:
    while link.is_open:
        await asyncio.sleep(COUNTS_EVERY_S)
        if link.is_open:
            link.send(Kind.COUNTS, _counts(index, http))
