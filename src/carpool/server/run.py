"""Runs the KServe v2 HTTP app (uvicorn, httptools) and the KServe v2 gRPC service
(grpc.aio) in one process, on one event loop, over one model repository.

Lifecycle, owned here rather than by the ASGI lifespan so both wires follow it::

    bind both ports -> load the models, start batchers -> bind and start gRPC -> listen
    on HTTP ... SIGTERM/SIGINT ... stop accepting on both -> finish the accepted HTTP and
    gRPC requests -> drain batchers -> exit 0

``drain_timeout_s`` after the signal, whatever is still unanswered is cut off (503,
UNAVAILABLE: a hung model must not hold the exit for ever) and :func:`serve` raises
:class:`DrainTimedOut` (``carpool serve`` exits with status 1).

Both ports are bound before the models load, so a taken port fails at once rather than
after minutes of loading (vLLM binds its port first for the same reason); neither listens
until the models are loaded, so clients are refused meanwhile rather than left waiting.
A signal while the models load exits at once, with status 0: no request was accepted yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn
import uvloop

from carpool.errors import ConfigError
from carpool.server.accept import Acceptor
from carpool.server.access import Access
from carpool.server.app import KServeApp
from carpool.server.banner import logger, ready_lines, use_default_logging
from carpool.server.errors import DEFAULT_MAX_REQUEST_BYTES, DrainTimedOut, PortInUse
from carpool.server.fasthttp import protocol_for
from carpool.server.grpc import InferenceServicer, bind_grpc_server, host_port
from carpool.server.limits import ServerLimits
from carpool.server.memory import TICK_S, Trimmer, malloc_trim
from carpool.server.repository import ModelRepository

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# After a cut-off, how long connections and gRPC calls get to send their 503s and
# UNAVAILABLEs before uvicorn and grpcio cancel what is left; and how long after a cut-off
# the process ends at once (status 1) if its shutdown is still held by something stuck
# that the cut-off cannot reach.
CUT_OFF_ANSWER_S = 1.0
CUT_OFF_EXIT_S = 3.0
YOUNG_GC_THRESHOLD = 100_000  # see _freeze_startup_heap


class _DrainingServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would
    die by the signal. Here the shutdown drains every accepted request first, which makes
    the exit a clean one: status 0. ``on_exit`` runs on the first signal, so the gRPC
    server stops accepting at the same moment as HTTP."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_exit: Callable[[], object] | None,
        on_started: Callable[[uvicorn.Server], object],
    ) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._on_started = on_started
        self._acceptor: Acceptor | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # bound; not when binding failed (uvicorn then exits)
            if sockets:  # uvloop's accept, one a loop turn, is too slow under load
                config, state = self.config, self.server_state
                protocol: Any = config.http_protocol_class  # as uvicorn builds it
                factory = functools.partial(
                    protocol, config=config, server_state=state, app_state={}
                )
                self._acceptor = Acceptor(asyncio.get_running_loop(), sockets, factory)
            self._on_started(self)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._acceptor is not None:
            self._acceptor.stop()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()
        if self._on_exit is not None:
            on_exit, self._on_exit = self._on_exit, None
            on_exit()


def serve(
    repository: ModelRepository,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    grpc_port: int | None = 8001,
    log_level: str = "warning",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
    protect_metrics: bool = False,
    allow_policy_updates: bool = False,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
) -> None:
    """Serve HTTP on ``port`` and gRPC on ``grpc_port`` (None or <= 0: no gRPC) until
    SIGINT/SIGTERM; then stop accepting, drain every batcher, return (exit status 0).
    An HTTP body or gRPC message over ``max_request_bytes`` is refused (413,
    RESOURCE_EXHAUSTED). ``limits``: connections, request bytes held and the body's
    time to arrive (:class:`~carpool.server.limits.ServerLimits`; its defaults if None).
    With ``api_key`` every request needs ``Authorization: Bearer
    <api_key>`` but health probes (and ``/metrics`` unless ``protect_metrics``);
    ``allow_policy_updates`` lets ``POST .../policy`` change a batch policy
    (:mod:`carpool.server.access`).
    What is unanswered ``drain_timeout_s`` after the signal is cut
    off: 503 / UNAVAILABLE.

    Raises:
        ConfigError: ``api_key`` is empty or not printable ASCII.
        PortInUse: ``port`` or ``grpc_port`` cannot be bound (before any model loads).
        DrainTimedOut: the shutdown ran past ``drain_timeout_s`` (the process should exit
            non-zero: ``carpool serve`` exits 1).
        ConfigError: ``drain_timeout_s`` is not a finite number >= 0.
    """
    access = Access(api_key, protect_metrics, allow_policy_updates)
    if isinstance(drain_timeout_s, bool) or not 0 <= drain_timeout_s < math.inf:
        raise ConfigError("drain_timeout_s", drain_timeout_s, "a finite number of seconds >= 0")
    use_default_logging()
    app = KServeApp(repository, max_body_bytes=max_request_bytes, limits=limits, access=access)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_for(app),  # httptools, with the infer fast path
        proxy_headers=False,  # nothing here reads the client address
        access_log=False,  # at log level warning it printed nothing, at a cost per request
        lifespan="off",  # the repository is started and drained by _serve
        ws="none",  # no websocket route: an upgrade is answered as plain HTTP, not a 500
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(drain_timeout_s + CUT_OFF_ANSWER_S),
    )
    # uvloop, as HTTP ran before gRPC was added: grpc.aio (grpcio 1.85) serves on it; the
    # gRPC integration tests (tritonclient.grpc, SIGTERM drain, exit 0) run on this loop.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(
            _serve(repository, config, host, grpc_port, max_request_bytes, access, drain_timeout_s)
        )


def _freeze_startup_heap() -> None:
    """Keep the cyclic garbage collector off the request path.

    Everything allocated at startup (torch, the models, their weights' Python objects)
    moves out of the collector's reach: without it the collector re-walked that heap
    every few thousand requests, 17% of the event loop's CPU under load (``perf`` on W1 at
    concurrency 256, ``docs/benchmarks.md``). And a young generation far larger than the
    container objects in-flight requests keep alive (about ten each): at the default of
    700 the collector ran every few requests at concurrency 256, walking the live ones.
    Requests free their objects by reference counting; cycles are still collected.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, older, oldest)


def check_ports(host: str, port: int, grpc_port: int | None) -> None:
    """Fail now if a port cannot be bound, before a config's models are built: building
    already loads a generation or embeddings model's weights (minutes for a large one).
    The ports are bound for good later, in :func:`serve`; one taken in between fails
    there, as a taken port did before this check.

    Raises:
        PortInUse: naming the wire, the address and the system's reason.
    """
    _close(_bind_port(host, port))
    if grpc_port is not None and grpc_port > 0:
        _close(_bind_port(host, grpc_port, wire="gRPC"))


@contextlib.contextmanager
def exit_on_signal_while_building() -> Iterator[None]:
    """Around building the models, before the event loop runs: SIGINT and SIGTERM end
    the process at once with status 0, as while the replicas load (nothing listens yet).
    On another thread than the main one nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    use_default_logging()  # so the line saying why reaches stderr
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.getsignal(signum) for signum in signals}
    for signum in signals:
        signal.signal(signum, lambda number, _: _exit_now(signal.Signals(number).name))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _exit_now(name: str) -> None:
    """End the process at once, status 0, saying that a signal came while loading."""
    logger.info(f"stopping: {name} while the models were loading; nothing was served")
    _exit(0)


def _exit(status: int) -> None:
    """End the process at once with ``status``, once what was logged is written."""
    for handler in [*logger.handlers, *logging.getLogger().handlers]:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _bind_port(host: str, port: int, *, wire: str = "HTTP") -> list[socket.socket]:
    """Sockets bound (not yet listening) to every address ``host`` names, as
    ``loop.create_server`` binds them: for HTTP, uvicorn listens on them once the models
    are loaded; for gRPC, they hold the port until grpcio binds it (see :func:`_serve`),
    an IPv6 one for both families, as grpcio binds it.

    Bound without SO_REUSEADDR where the port allows it: Linux lets any socket with
    SO_REUSEADDR (uvicorn's, grpcio's, a second ``carpool serve``'s) bind a port that
    sockets with it hold without listening, so a port held that way while the models
    load would be taken over meanwhile. With SO_REUSEADDR only when that bind fails,
    which a previous server's connections in TIME_WAIT make it do on a restart; the HTTP
    listeners get it once they listen (:func:`_serve`), so that their connections'
    TIME_WAIT allows that second bind.

    Raises:
        PortInUse: naming ``wire``, the address and the system's reason.
    """
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            if family == socket.AF_INET6:
                # HTTP: IPv6 only, as asyncio binds it for uvicorn. gRPC: both families,
                # as grpcio binds "[::]:port", so "--host ::" holds its IPv4 side too.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, wire != "gRPC")
            try:
                sock.bind(address)
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    raise
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
    except OSError as error:
        _close(sockets)
        why = error.strerror or str(error)
        raise PortInUse(f"{wire} port {host_port(host, port)}: could not bind ({why})") from None
    return sockets


def _close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def _exit_on_signal_while_loading(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Until the returned function is called, SIGINT and SIGTERM end the process at once
    with status 0: the models are loading, nothing listens and no request was accepted,
    and a model's loading thread cannot be interrupted (waiting for it could take
    minutes). On another thread than the main one, where no signal reaches a handler
    (uvicorn then serves without its own), nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, _exit_now, signal.Signals(signum).name)

    def restore() -> None:
        for signum in signals:
            loop.remove_signal_handler(signum)

    return restore


async def _serve(
    repository: ModelRepository,
    config: uvicorn.Config,
    host: str,
    grpc_port: int | None,
    max_request_bytes: int,
    access: Access,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
) -> None:
    loop = asyncio.get_running_loop()
    wants_grpc = grpc_port is not None and grpc_port > 0
    # Both ports are held while the models load, bound but not listening: a client of
    # either wire is refused at once (gRPC: UNAVAILABLE) instead of waiting on a server
    # that is not started. grpcio cannot bind without listening, so its port is held by
    # a plain socket until the gRPC server binds it, once the models are loaded.
    held = _bind_port(host, grpc_port or 0, wire="gRPC") if wants_grpc else []
    try:
        sockets = _bind_port(config.host, config.port)
    except PortInUse:
        _close(held)
        raise
    restore_signals = _exit_on_signal_while_loading(loop)
    try:
        await repository.start()
        # A full collection over the models' heap takes a while: still nothing accepted,
        # so a signal meanwhile still exits at once (not with the default handler's -15).
        _freeze_startup_heap()
    except BaseException:  # a model failed to load: serve nothing
        _close(sockets)
        _close(held)
        raise
    finally:
        restore_signals()
    grpc_server = None
    servicer = InferenceServicer(repository)
    deadline = _DrainDeadline(repository, drain_timeout_s)
    try:
        if wants_grpc:
            _close(held)
            try:
                grpc_server = bind_grpc_server(
                    repository,
                    host,
                    grpc_port or 0,
                    servicer,
                    max_message_bytes=max_request_bytes,
                    access=access,
                )
            except PortInUse:  # taken in the instant between: nothing was served
                _close(sockets)
                raise
            await grpc_server.start()
        grpc_stopped: asyncio.Future[None] | None = None

        def stop_grpc() -> None:  # stop accepting; let accepted RPCs finish within the grace
            nonlocal grpc_stopped
            if grpc_server is not None and grpc_stopped is None:
                grace_s = drain_timeout_s + CUT_OFF_ANSWER_S
                grpc_stopped = asyncio.ensure_future(grpc_server.stop(grace_s))
                servicer.drain()  # open streams end once answered, not at the grace's end

        def on_exit() -> None:
            logger.info("stopping: no new requests; answering the accepted ones")
            deadline.arm()
            stop_grpc()

        # The signal handler may run outside a loop callback: hop onto the loop.
        grpc_address = host_port(host, grpc_port or 0) if grpc_server is not None else None
        http = _DrainingServer(
            config,
            on_exit=lambda: loop.call_soon_threadsafe(on_exit),
            on_started=lambda server: _announce(server, repository, grpc_address),
        )
        app = config.app
        assert isinstance(app, KServeApp), "serve() built it"
        trimming = asyncio.ensure_future(_trim_after_bursts(http, app, repository))
        try:
            for sock in sockets:
                # Only now, as they start listening: the connections they accept inherit
                # it, so those the server closes first leave a TIME_WAIT that does not
                # block the next bind of the port (a restart right after a stop).
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            await http.serve(sockets)
        finally:
            trimming.cancel()
            stop_grpc()
            if grpc_stopped is not None:
                await grpc_stopped
    finally:
        await repository.stop()
        deadline.disarm()
    deadline.check()
    logger.info("stopped")


async def _trim_after_bursts(
    http: uvicorn.Server, app: KServeApp, repository: ModelRepository
) -> None:
    """Give memory back to the system each time the server falls quiet after a burst
    (:mod:`carpool.server.memory`)."""
    trim = malloc_trim()
    if trim is None:
        return

    def is_idle() -> bool:
        return app.inflight.held_bytes == 0 and all(m.num_pending == 0 for m in repository)

    trimmer = Trimmer(lambda: http.server_state.total_requests, is_idle, trim)
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(TICK_S)
        if trimmer.tick():
            await loop.run_in_executor(None, trim)


class _DrainDeadline:
    """``drain_timeout_s`` after the stop signal: cut off what is still unanswered."""

    def __init__(self, repository: ModelRepository, drain_timeout_s: float) -> None:
        self._repository = repository
        self._drain_timeout_s = drain_timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._num_cut_off: int | None = None  # None: the deadline did not pass

    def arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._drain_timeout_s, self._cut)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _cut(self) -> None:
        self._num_cut_off = self._repository.cut_off()
        logger.warning(
            f"stopping: --drain-timeout-s {self._drain_timeout_s:g} passed; "
            f"{self._num_cut_off} request(s) still unanswered were cut off (503, gRPC "
            "UNAVAILABLE); exiting with status 1"
        )
        self._timer = asyncio.get_running_loop().call_later(CUT_OFF_EXIT_S, self._exit)

    def _exit(self) -> None:
        logger.error(f"stopping: still not stopped {CUT_OFF_EXIT_S:g} s after the cut-off")
        _exit(1)

    def check(self) -> None:
        """Raises DrainTimedOut when the deadline passed before the shutdown ended."""
        if self._num_cut_off is not None:
            raise DrainTimedOut(self._num_cut_off, self._drain_timeout_s)


def _announce(http: uvicorn.Server, repository: ModelRepository, grpc: str | None) -> None:
    """The ready lines, with the address uvicorn bound (port 0 included)."""
    host, port = http.servers[0].sockets[0].getsockname()[:2]
    for line in ready_lines(repository, host_port(host, port), grpc):
        logger.info(line)
