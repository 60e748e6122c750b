"""Runs carpool's HTTP/1.1 server (:mod:`carpool.server.http`) and the KServe v2 gRPC
service (grpc.aio) in one process, on one event loop (uvloop), over one model repository.

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
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator

import uvloop

from carpool.errors import ConfigError
from carpool.server.access import Access
from carpool.server.app import KServeApp
from carpool.server.banner import logger, ready_lines, use_default_logging
from carpool.server.errors import DEFAULT_MAX_REQUEST_BYTES, DrainTimedOut, PortInUse
from carpool.server.grpc import InferenceServicer, bind_grpc_server, host_port
from carpool.server.heap import freeze_startup_heap
from carpool.server.http.server import HttpServer
from carpool.server.limits import ServerLimits
from carpool.server.memory import TICK_S, Trimmer, malloc_trim
from carpool.server.otlp import start_otlp
from carpool.server.repository import ModelRepository

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# After a cut-off, how long connections and gRPC calls get to send their 503s and
# UNAVAILABLEs before what is left is cancelled; and how long after a cut-off the process
# ends at once (status 1) if its shutdown is still held by something stuck that the
# cut-off cannot reach.
CUT_OFF_ANSWER_S = 1.0
CUT_OFF_EXIT_S = 3.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The log levels `carpool serve --log-level` takes (uvicorn's names; "trace" below debug).
LOG_LEVELS = {
    "critical": logging.CRITICAL,
    "error": logging.ERROR,
    "warning": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": 5,
}


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
    dashboard: bool = True,
    otlp_endpoint: str | None = None,
    strict_openai: bool = False,
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
    off: 503 / UNAVAILABLE. ``dashboard``: sample every model each second for
    ``/dashboard`` (server/dashboard.py); off, ``/dashboard`` is a 404. With
    ``otlp_endpoint``, each request's timeline goes there as OpenTelemetry spans
    (:mod:`carpool.server.otlp`). ``strict_openai``: refuse (400) the OpenAI request
    fields neither OpenAI nor vLLM defines, instead of ignoring them.

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
    if log_level not in LOG_LEVELS:
        raise ConfigError("log_level", log_level, f"one of {', '.join(LOG_LEVELS)}")
    use_default_logging()
    for name in ("carpool.server.http", "carpool.server.access"):
        logging.getLogger(name).setLevel(LOG_LEVELS[log_level])
    app = KServeApp(
        repository,
        max_body_bytes=max_request_bytes,
        limits=limits,
        access=access,
        dashboard=dashboard,
        strict_openai=strict_openai,
    )
    otlp = None if otlp_endpoint is None else start_otlp(app.timelines, otlp_endpoint)
    # uvloop, as HTTP ran before gRPC was added: grpc.aio (grpcio 1.85) serves on it; the
    # gRPC integration tests (tritonclient.grpc, SIGTERM drain, exit 0) run on this loop.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            runner.run(_serve(app, host, port, grpc_port, max_request_bytes, drain_timeout_s))
        finally:
            if otlp is not None:
                otlp.close()  # the last spans sent


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
    previous = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
    for signum in _STOP_SIGNALS:
        signal.signal(signum, lambda number, _: _exit_now(signal.Signals(number).name))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _exit_now(name: str) -> None:
    """End the process at once, status 0, saying that a signal came while loading; a local
    Ray started for ``executor: ray`` is stopped first (its processes would outlive this
    one, whose exit hooks do not run)."""
    logger.info(f"stopping: {name} while the models were loading; nothing was served")
    ray_cluster = sys.modules.get("carpool.core.ray_cluster")
    if ray_cluster is not None:
        try:
            ray_cluster.stop_local()
        except Exception:
            logger.exception("stopping the local Ray failed; its processes may be left")
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
    ``loop.create_server`` binds them: for HTTP, the server listens on them once the models
    are loaded; for gRPC, they hold the port until grpcio binds it (see :func:`_serve`),
    an IPv6 one for both families, as grpcio binds it.

    Bound without SO_REUSEADDR where the port allows it: Linux lets any socket with
    SO_REUSEADDR (grpcio's, a second ``carpool serve``'s) bind a port that
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
                # HTTP: IPv6 only, as asyncio's create_server binds it. gRPC: both families,
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


def exit_on_signal_while_loading(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Until the returned function is called, SIGINT and SIGTERM end the process at once
    with status 0: the models are loading, nothing listens and no request was accepted,
    and a model's loading thread cannot be interrupted (waiting for it could take
    minutes). On another thread than the main one, where no signal reaches a handler
    (the server then serves without its own), nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    for signum in _STOP_SIGNALS:
        loop.add_signal_handler(signum, _exit_now, signal.Signals(signum).name)

    def restore() -> None:
        for signum in _STOP_SIGNALS:
            loop.remove_signal_handler(signum)

    return restore


async def _serve(
    app: KServeApp,
    host: str,
    port: int,
    grpc_port: int | None,
    max_request_bytes: int,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
) -> None:
    repository = app.repository
    loop = asyncio.get_running_loop()
    wants_grpc = grpc_port is not None and grpc_port > 0
    # Both ports are held while the models load, bound but not listening: a client of
    # either wire is refused at once (gRPC: UNAVAILABLE) instead of waiting on a server
    # that is not started. grpcio cannot bind without listening, so its port is held by
    # a plain socket until the gRPC server binds it, once the models are loaded.
    held = _bind_port(host, grpc_port or 0, wire="gRPC") if wants_grpc else []
    try:
        sockets = _bind_port(host, port)
    except PortInUse:
        _close(held)
        raise
    restore_signals = exit_on_signal_while_loading(loop)
    try:
        await repository.start()
        # A full collection over the models' heap takes a while: still nothing accepted,
        # so a signal meanwhile still exits at once (not with the default handler's -15).
        freeze_startup_heap()
    except BaseException:  # a model failed to load: serve nothing
        _close(sockets)
        _close(held)
        raise
    finally:
        restore_signals()
    grpc_server = None
    servicer = InferenceServicer(repository)
    deadline = DrainDeadline(repository, drain_timeout_s)
    http = HttpServer(app)
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
                    access=app.access,
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

        stopping = asyncio.Event()

        def on_signal(signum: int) -> None:
            if stopping.is_set():  # a second Ctrl-C: stop waiting for the accepted ones
                if signum == signal.SIGINT:
                    http.cut()
                return
            logger.info("stopping: no new requests; answering the accepted ones")
            deadline.arm()
            app.timelines.close()  # a carpool trace in flight answers now, not at its end
            stop_grpc()
            stopping.set()

        grpc_address = host_port(host, grpc_port or 0) if grpc_server is not None else None
        restore_signals = _stop_on_signal(loop, on_signal)
        trimming = asyncio.ensure_future(_trim_after_bursts(http, repository))
        if app.dashboard is not None:
            sampling = asyncio.ensure_future(app.dashboard.run())
            trimming.add_done_callback(lambda _: sampling.cancel())  # cancelled below
        try:
            for sock in sockets:
                # Only now, as they start listening: the connections they accept inherit
                # it, so those the server closes first leave a TIME_WAIT that does not
                # block the next bind of the port (a restart right after a stop).
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            http.start(sockets)
            _announce(http, repository, grpc_address)
            await stopping.wait()
            await http.shutdown(math.ceil(drain_timeout_s + CUT_OFF_ANSWER_S))
        finally:
            restore_signals()
            trimming.cancel()
            http.close()
            stop_grpc()
            if grpc_stopped is not None:
                await grpc_stopped
    finally:
        _close(sockets)
        await repository.stop()
        deadline.disarm()
    deadline.check()
    logger.info("stopped")


def _stop_on_signal(
    loop: asyncio.AbstractEventLoop, on_signal: Callable[[int], None]
) -> Callable[[], None]:
    """Until the returned function is called, SIGINT and SIGTERM call ``on_signal``
    (with the signal's number) on the loop. On another thread than the main one, where
    no signal reaches a handler, nothing is installed: the server runs until its process
    ends."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    for signum in _STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)

    def restore() -> None:
        for signum in _STOP_SIGNALS:
            loop.remove_signal_handler(signum)

    return restore


async def _trim_after_bursts(http: HttpServer, repository: ModelRepository) -> None:
    """Give memory back to the system each time the server falls quiet after a burst
    (:mod:`carpool.server.memory`)."""
    trim = malloc_trim()
    if trim is None:
        return
    inflight = http.app.inflight

    def is_idle() -> bool:
        return inflight.held_bytes == 0 and all(m.num_pending == 0 for m in repository)

    trimmer = Trimmer(lambda: http.num_requests, is_idle, trim)
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(TICK_S)
        if trimmer.tick():
            await loop.run_in_executor(None, trim)


class DrainDeadline:
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


def _announce(http: HttpServer, repository: ModelRepository, grpc: str | None) -> None:
    """The ready lines, with the address the HTTP server listens on (port 0 included)."""
    host, port = http.addresses[0]
    for line in ready_lines(repository, host_port(host, port), grpc):
        logger.info(line)
