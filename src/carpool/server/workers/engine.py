"""``carpool serve --workers N``: the engine process and its N front-end workers.

::

    carpool serve (the engine)                       worker 0 .. N-1 (spawned)
      holds the ports (SO_REUSEPORT, not listening)    listen on them (SO_REUSEPORT)
      models, batchers, replicas, engines              HTTP/1.1 + codec, gRPC servicer
      one Peer per worker  <== rings + socket ==>      Link: hand-offs, forwarded routes
      readiness flags (shared memory)  ----------->    health probes from the head

Lifecycle::

    hold both ports -> load the models, start batchers -> spawn the workers -> each
    listens -> ready lines ... SIGTERM/SIGINT -> every worker stops accepting, answers
    what it accepted (its hand-offs answered here) and exits 0 -> drain the batchers ->
    exit 0

``--drain-timeout-s`` bounds the whole: past it what is unanswered is cut off and the
exit status is 1. A worker that dies is logged, its hand-offs withdrawn, and it is
spawned again after a backoff; the engine dying closes every channel, and the workers
exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import socket
from multiprocessing import shared_memory
from multiprocessing.process import BaseProcess
from typing import Any

import uvloop

from carpool.core.policy import BatchPolicy, ClassPolicy
from carpool.errors import ConfigError
from carpool.server.access import Access
from carpool.server.app import KServeApp
from carpool.server.banner import logger, ready_lines, use_default_logging
from carpool.server.errors import DEFAULT_MAX_REQUEST_BYTES, PortInUse
from carpool.server.grpc import host_port
from carpool.server.heap import freeze_startup_heap
from carpool.server.limits import ServerLimits
from carpool.server.otlp import start_otlp
from carpool.server.repository import ModelRepository, ServedModel
from carpool.server.run import (
    DEFAULT_DRAIN_TIMEOUT_S,
    LOG_LEVELS,
    DrainDeadline,
    check_ports,
    exit_on_signal_while_loading,
)
from carpool.server.workers.channel import Channel
from carpool.server.workers.counters import WorkerCollector
from carpool.server.workers.peer import Peer
from carpool.server.workers.records import Kind
from carpool.server.workers.ring import Ring
from carpool.server.workers.worker import ModelSpec, WorkerSpec, bind_shared, run_worker

log = logging.getLogger("carpool.server.workers")
RING_BYTES = 8 << 20  # each way, per worker: many requests' worth; a larger one goes inline
READY_TICK_S = 0.1  # how often the readiness flags and policies are refreshed
LISTEN_TIMEOUT_S = 60.0  # a worker's start: interpreter, imports, bind
MIN_BACKOFF_S, MAX_BACKOFF_S = 0.2, 5.0
STOP_EXTRA_S = 3.0  # after the drain deadline, how long workers get before SIGKILL


@dataclasses.dataclass(slots=True)
class PortReservation:
    """The ports the workers share, held by the engine for its whole life (bound with
    SO_REUSEPORT, never listening: the kernel gives connections only to listeners)."""

    port: int
    grpc_port: int | None
    sockets: list[socket.socket]

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def reserve_ports(host: str, port: int, grpc_port: int | None) -> PortReservation:
    """Bind the HTTP and gRPC ports now, before the models load (a taken port fails at
    once); port 0 picks a free one, which the workers then bind too.

    Raises:
        PortInUse: naming the wire, the address and the system's reason.
    """
    check_ports(host, port, grpc_port)  # held by anyone, even with SO_REUSEPORT: fail
    sockets: list[socket.socket] = []
    ports: list[int] = []
    wanted = [("HTTP", port)] + ([("gRPC", grpc_port)] if grpc_port and grpc_port > 0 else [])
    for wire, number in wanted:
        try:
            sock = bind_shared(host, number)
        except OSError as error:
            for held in sockets:
                held.close()
            why = error.strerror or str(error)
            raise PortInUse(
                f"{wire} port {host_port(host, number)}: could not bind ({why})"
            ) from None
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    return PortReservation(ports[0], ports[1] if len(ports) > 1 else None, sockets)


def serve_workers(
    repository: ModelRepository,
    *,
    ports: PortReservation,
    num_workers: int,
    host: str = "127.0.0.1",
    port: int | None = None,
    grpc_port: int | None = None,
    log_level: str = "warning",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
    protect_metrics: bool = False,
    allow_policy_updates: bool = False,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    dashboard: bool = True,
    otlp_endpoint: str | None = None,
    strict_openai: bool = False,
) -> None:
    """Serve with ``num_workers`` front-end worker processes on the ``ports`` held
    (``port`` and ``grpc_port``, as asked, are what they hold: port 0 reserved as the
    one the system picked); as :func:`carpool.server.run.serve` otherwise (same
    errors, same exit statuses; the options are checked by ``carpool serve``)."""
    if num_workers < 1:
        raise ConfigError("workers", num_workers, "an integer >= 1")
    access = Access(api_key, protect_metrics, allow_policy_updates)
    use_default_logging()
    limits = limits if limits is not None else ServerLimits()
    # The dashboard samples and the trace hub record here, where the batchers are: the
    # workers forward /dashboard and /v2/timelines to this app like any other route.
    app = KServeApp(
        repository,
        max_body_bytes=max_request_bytes,
        limits=limits,
        access=access,
        dashboard=dashboard,
        strict_openai=strict_openai,  # the workers forward /v1 completions here
    )
    otlp = None if otlp_endpoint is None else start_otlp(app.timelines, otlp_endpoint)
    template = dict(
        host=host,
        port=ports.port,
        grpc_port=ports.grpc_port,
        max_request_bytes=max_request_bytes,
        limits=limits,
        api_key=api_key,
        protect_metrics=protect_metrics,
        allow_policy_updates=allow_policy_updates,
        drain_timeout_s=drain_timeout_s,
        log_level=LOG_LEVELS[log_level],
    )
    engine = Engine(app, num_workers, template, drain_timeout_s)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(engine.serve())
    finally:
        ports.close()
        if otlp is not None:
            otlp.close()  # the last spans sent


class Engine:
    """The engine's loop: the workers, their peers, the readiness flags, the shutdown."""

    def __init__(
        self, app: KServeApp, num_workers: int, template: dict[str, Any], drain_timeout_s: float
    ) -> None:
        self.app = app
        self.repository = app.repository
        self._template = template
        self._drain_timeout_s = drain_timeout_s
        self._models = list(self.repository)
        self._flags = shared_memory.SharedMemory(create=True, size=max(1, len(self._models)))
        self._policy_versions = {m.name: m.policy_version for m in self._models}
        self.peers = [Peer(i, app, self._send_policies) for i in range(num_workers)]
        self._processes: list[BaseProcess | None] = [None] * num_workers
        self._rings: list[tuple[Ring, Ring] | None] = [None] * num_workers
        self.restarts = [0] * num_workers
        self._backoff_s = [MIN_BACKOFF_S] * num_workers
        self._stopping = False
        self._context = multiprocessing.get_context("spawn")
        app.metrics.registry.register(WorkerCollector(self.peers, self.restarts))

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        restore = exit_on_signal_while_loading(loop)
        try:
            await self.repository.start()
            freeze_startup_heap()  # before any request: as in one process
        finally:
            restore()
        deadline = DrainDeadline(self.repository, self._drain_timeout_s)
        stopped = asyncio.Event()
        try:
            self._refresh()
            ticking = asyncio.ensure_future(self._tick())
            if self.app.dashboard is not None:
                sampling = asyncio.ensure_future(self.app.dashboard.run())
                ticking.add_done_callback(lambda _: sampling.cancel())  # cancelled below
            for index in range(len(self.peers)):
                await self._spawn(index)

            def on_signal() -> None:
                if not self._stopping:
                    logger.info("stopping: no new requests; the workers answer the accepted ones")
                    deadline.arm()
                    self.app.timelines.close()  # a carpool trace in flight answers now
                    self._stopping = True
                    stopped.set()

            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, on_signal)
            await asyncio.wait_for(
                asyncio.gather(*(p.is_listening.wait() for p in self.peers)), LISTEN_TIMEOUT_S
            )
            self._announce()
            await stopped.wait()
            await self._stop_workers()
            ticking.cancel()
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            self._close_all()
            await self.repository.stop()
            deadline.disarm()
        deadline.check()
        logger.info("stopped")

    # -- the workers ---------------------------------------------------------------------------

    async def _spawn(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        peer = self.peers[index]
        ring_bytes = RING_BYTES
        to_engine = Ring(None, ring_bytes, create=True)
        to_worker = Ring(None, ring_bytes, create=True)
        self._rings[index] = (to_engine, to_worker)
        mine, theirs = socket.socketpair()
        spec = WorkerSpec(
            index=index,
            sock=theirs,
            to_engine=to_engine.name,
            to_worker=to_worker.name,
            ring_bytes=ring_bytes,
            ready_flags=self._flags.name,
            models=tuple(self._spec(i, m) for i, m in enumerate(self._models)),
            **self._template,
        )
        process = self._context.Process(
            target=run_worker, args=(spec,), name=f"carpool-worker-{index}", daemon=False
        )
        process.start()
        theirs.close()
        self._processes[index] = process
        channel = Channel(to_worker, to_engine, peer.on_record, lambda: None)
        mine.setblocking(False)
        await loop.create_unix_connection(lambda: channel, sock=mine)
        peer.channel = channel
        loop.add_reader(process.sentinel, self._exited, index, process)

    def _spec(self, ready_index: int, model: ServedModel) -> ModelSpec:
        policy = _worker_policy(model)
        return ModelSpec(
            name=model.name,
            version=model.version,
            platform=model.platform,
            inputs=model.inputs,
            outputs=model.outputs,
            policy=pickle.dumps(policy),
            policy_version=model.policy_version,
            devices=model.batcher.devices if model.batcher is not None else ("cpu",),
            is_run=model.infer is not None,
            ready_index=ready_index,
        )

    def _exited(self, index: int, process: BaseProcess) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(process.sentinel)
        process.join(0)
        dropped = self.peers[index].drop()
        self._close(index)
        if self._stopping:
            return
        self.restarts[index] += 1
        backoff_s = self._backoff_s[index]
        self._backoff_s[index] = min(MAX_BACKOFF_S, backoff_s * 2)
        log.warning(
            f"worker {index} (pid {process.pid}) exited with status {process.exitcode}; "
            f"{dropped} of its requests dropped; starting it again in {backoff_s:g} s"
        )
        loop.call_later(backoff_s, lambda: asyncio.ensure_future(self._respawn(index)))

    async def _respawn(self, index: int) -> None:
        if self._stopping or self._processes[index] is not None:
            return
        await self._spawn(index)
        await self.peers[index].is_listening.wait()
        self._backoff_s[index] = MIN_BACKOFF_S

    async def _stop_workers(self) -> None:
        """SIGTERM every worker, and wait until each has answered what it accepted and
        exited (killed past the drain deadline and a few seconds more)."""
        running = [p for p in self._processes if p is not None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                assert process.pid is not None
                os.kill(process.pid, signal.SIGTERM)
        limit_s = self._drain_timeout_s + STOP_EXTRA_S
        loop = asyncio.get_running_loop()
        end_s = loop.time() + limit_s
        while any(p.is_alive() for p in running):
            if loop.time() > end_s:
                for process in running:
                    if process.is_alive():
                        process.kill()
                break
            await asyncio.sleep(0.02)

    def _close(self, index: int) -> None:
        self._processes[index] = None
        peer = self.peers[index]
        if peer.channel is not None:
            peer.channel.close()
            peer.channel = None
        rings, self._rings[index] = self._rings[index], None
        if rings is not None:
            for ring in rings:
                ring.close()

    def _close_all(self) -> None:
        loop = asyncio.get_running_loop()
        for index, running in enumerate(self._processes):
            if running is not None:
                loop.remove_reader(running.sentinel)
                running.join(STOP_EXTRA_S)
            self.peers[index].drop()
            self._close(index)
        self._flags.close()
        self._flags.unlink()

    # -- what the workers are told ----------------------------------------------------------------

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(READY_TICK_S)
            self._refresh()

    def _refresh(self) -> None:
        buf = self._flags.buf
        assert buf is not None, "a mapped shared memory block has a buffer"
        for index, model in enumerate(self._models):
            buf[index] = 1 if model.is_ready else 0
        self._send_policies()

    def _send_policies(self) -> None:
        """Every worker gets a model's policy as soon as it changed (``POST .../policy``
        answered by any of them): before that answer goes back, so the next request to
        any worker reads it."""
        for model in self._models:
            version = model.policy_version
            if version == self._policy_versions[model.name]:
                continue
            self._policy_versions[model.name] = version
            blob = pickle.dumps(_worker_policy(model))
            for peer in self.peers:
                peer.send(Kind.POLICY, {"model": model.name, "version": version}, None, blob)

    def _announce(self) -> None:
        template = self._template
        host = template["host"]
        grpc_port = template["grpc_port"]
        grpc = host_port(host, grpc_port) if grpc_port else None
        for line in ready_lines(self.repository, host_port(host, template["port"]), grpc):
            logger.info(line)
        logger.info(f"{len(self.peers)} front-end workers share the ports (--workers)")


def _worker_policy(model: ServedModel) -> BatchPolicy:
    """What a worker needs of a model's policy (priority levels, class timeouts): the
    batcher's, without its cost function (which may not pickle, and the engine's
    batcher costs the requests); a generation model's classes as a policy of its own."""
    if model.generation is not None:
        classes = model.generation.classes
        return BatchPolicy(
            classes=tuple(ClassPolicy(name) for name in classes), default_class=classes[0]
        )
    policy = model.policy
    assert policy is not None, "a model with a batcher has a policy"
    return dataclasses.replace(policy, cost_fn=None)
