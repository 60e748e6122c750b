"""The ``carpool`` command (typer).

``carpool serve [CONFIG.yaml]`` serves the models a config lists (the built-in ones without
one) over KServe v2 HTTP and gRPC and OpenAI's API; ``carpool demo`` shows what batching
buys on the reference MLP; ``carpool bench``, ``tune`` and ``doctor`` measure, tune and
diagnose (see docs/tuning.md and docs/doctor.md); ``carpool top [URL]`` watches a running
server and ``carpool trace`` records its batches and requests for Perfetto
(docs/observability.md).
"""

from __future__ import annotations

import enum
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from carpool import __version__
from carpool.server.errors import DEFAULT_MAX_REQUEST_BYTES
from carpool.server.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_INFLIGHT_BYTES,
    ServerLimits,
)

if TYPE_CHECKING:
    from carpool.server.repository import ModelRepository

app = typer.Typer(
    name="carpool",
    help="carpool: requests that share the ride.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"carpool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """carpool: requests that share the ride."""


class LogLevel(enum.StrEnum):
    """The HTTP server's log levels (uvicorn's names)."""

    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"
    trace = "trace"


@app.command()
def serve(
    config: Annotated[
        str | None, typer.Argument(metavar="CONFIG", help="YAML file listing the models to serve.")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port.", min=0, max=65535)] = 8000,
    grpc_port: Annotated[
        int, typer.Option(help="gRPC port; 0 or less: no gRPC.", max=65535)
    ] = 8001,
    log_level: Annotated[
        LogLevel, typer.Option(help="HTTP server log level.", case_sensitive=False)
    ] = LogLevel.warning,
    max_request_bytes: Annotated[
        int,
        typer.Option(
            help="Largest request: an HTTP body (413 beyond) or a gRPC message "
            "(RESOURCE_EXHAUSTED beyond), in bytes.",
            min=1,
        ),
    ] = DEFAULT_MAX_REQUEST_BYTES,
    max_connections: Annotated[
        int,
        typer.Option(
            help="Most open HTTP connections; the first request of one past it gets 503 "
            "with Retry-After, and it is closed.",
            min=1,
        ),
    ] = DEFAULT_MAX_CONNECTIONS,
    max_inflight_bytes: Annotated[
        int,
        typer.Option(
            help="Most HTTP request body bytes held in memory across all connections, "
            "from a request's head to its answer; a request past it gets 503 with "
            "Retry-After.",
            min=1,
        ),
    ] = DEFAULT_MAX_INFLIGHT_BYTES,
    body_timeout_s: Annotated[
        float,
        typer.Option(
            help="Longest an HTTP request body may take to arrive after its head (408 "
            "beyond), however steadily it trickles.",
            min=0.001,
        ),
    ] = DEFAULT_BODY_TIMEOUT_S,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Require 'Authorization: Bearer KEY' (gRPC: 'authorization' metadata) on "
            "every route but /v2/health/*, /health, /ping and the gRPC health calls (and "
            "/metrics unless --protect-metrics). Default: the CARPOOL_API_KEY environment "
            "variable, which keeps the key out of the process list; neither: no key.",
            show_default=False,
        ),
    ] = None,
    protect_metrics: Annotated[
        bool,
        typer.Option(
            "--protect-metrics", help="/metrics needs the API key too (default: open to scrapers)."
        ),
    ] = False,
    allow_policy_updates: Annotated[
        bool,
        typer.Option(
            "--allow-policy-updates",
            help="Let POST /v2/models/{m}/policy change a batch policy while serving "
            "(carpool tune against this server needs it); off: a 403.",
        ),
    ] = False,
    drain_timeout_s: Annotated[
        float,
        typer.Option(
            help="Seconds a shutdown (SIGTERM, SIGINT) waits for accepted requests; then "
            "those left get 503 (gRPC: UNAVAILABLE) and the exit status is 1.",
            min=0,
            max=86_400,
        ),
    ] = 30.0,
    no_dashboard: Annotated[
        bool,
        typer.Option(
            "--no-dashboard",
            help="Serve no /dashboard, and sample nothing for it (on: live charts of each "
            "model's last 5 minutes).",
        ),
    ] = False,
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(
            help="Send each request's timeline (arrived, batch closed, compute started and "
            "ended, answered) as OpenTelemetry spans to this OTLP/HTTP collector, e.g. "
            "http://127.0.0.1:4318 (needs the otel extra).",
            show_default=False,
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            help="Front-end worker processes sharing the HTTP and gRPC ports (SO_REUSEPORT); "
            "they decode requests and hand them to this process's batchers through shared "
            "memory. 1: one process serves everything.",
            min=1,
        ),
    ] = 1,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="Run the executor: ray models on the Ray cluster at this address (what "
            "'ray start --head' prints; 'auto': the one on this machine), over the config's "
            "ray.address; neither: RAY_ADDRESS, else a local Ray started for them.",
            show_default=False,
        ),
    ] = None,
    strict_openai: Annotated[
        bool,
        typer.Option(
            "--strict-openai",
            help="Refuse (400) a /v1/completions or /v1/chat/completions field that neither "
            "OpenAI nor vLLM defines; default: ignore it, log it once and count it in "
            "carpool_openai_ignored_fields_total.",
        ),
    ] = False,
) -> None:
    """Serve the models of CONFIG (or the built-in ones) over KServe v2 HTTP and gRPC."""
    from carpool.core.allocator import tune_malloc
    from carpool.errors import ConfigError
    from carpool.server.access import api_key_from
    from carpool.server.errors import DrainTimedOut, PortInUse
    from carpool.server.otlp import traces_url
    from carpool.server.run import check_ports, exit_on_signal_while_building
    from carpool.server.run import serve as run_server

    if port != 0 and port == grpc_port:
        raise typer.BadParameter(
            f"{grpc_port} is the HTTP port (--port) too; give gRPC another port, or 0 for none",
            param_hint="'--grpc-port'",
        )
    try:
        key = api_key_from(api_key)  # the flag, else CARPOOL_API_KEY
        if otlp_endpoint is not None:
            traces_url(otlp_endpoint)  # a bad URL: status 2 before any model loads
        limits = _server_limits(max_connections, max_inflight_bytes, body_timeout_s)
        _check_host(host)
    except ConfigError as error:  # before the ports are taken or a model loads
        print(f"carpool serve: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    tune_malloc()  # before the models load: their arrays come next (the ready lines say it)
    try:
        ports = None
        if workers == 1:
            check_ports(host, port, grpc_port)  # before a config's models load their weights
        else:  # held from now on: the workers bind them too
            from carpool.server.workers import reserve_ports, serve_workers

            ports = reserve_ports(host, port, grpc_port)
        with exit_on_signal_while_building():
            repository = _repository(config, ray_address)
        run: Callable[..., None] = run_server
        if ports is not None:
            run = functools.partial(serve_workers, ports=ports, num_workers=workers)
        run(
            repository,
            host=host,
            port=port,
            grpc_port=grpc_port,
            log_level=log_level.value,
            max_request_bytes=max_request_bytes,
            limits=limits,
            api_key=key,
            protect_metrics=protect_metrics,
            allow_policy_updates=allow_policy_updates,
            drain_timeout_s=drain_timeout_s,
            dashboard=not no_dashboard,
            otlp_endpoint=otlp_endpoint,
            strict_openai=strict_openai,
        )
    except DrainTimedOut:  # already logged, with how many requests were cut off
        raise SystemExit(1) from None
    except PortInUse as error:
        print(f"carpool serve: {error}", file=sys.stderr)
        raise SystemExit(3) from None  # the status uvicorn gave a taken HTTP port
    except ConfigError as error:  # a model file that fails to load as its replicas start
        where = f"{config}: " if config is not None and error.file is None else ""
        print(f"carpool serve: {where}{error}", file=sys.stderr)
        raise SystemExit(2) from None


def _check_host(host: str) -> None:
    """Refuse a ``--host`` that does not resolve (a bad flag: exit 2, where a port that
    cannot be bound is exit 3)."""
    import socket

    from carpool.errors import ConfigError

    try:
        socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as error:
        why = getattr(error, "strerror", None) or str(error)
        raise ConfigError("--host", host, f"an address or a name that resolves ({why})") from None


def _server_limits(
    max_connections: int, max_inflight_bytes: int, body_timeout_s: float
) -> ServerLimits:
    """The flags' :class:`ServerLimits`, a refusal naming the flag."""
    from carpool.errors import ConfigError

    try:
        return ServerLimits(max_connections, max_inflight_bytes, body_timeout_s)
    except ConfigError as error:
        flag = "--" + error.field.replace("_", "-")
        raise ConfigError(flag, error.value, error.expected) from None


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def demo(ctx: typer.Context) -> None:
    """Run the reference MLP one request at a time, then batched (--help for options)."""
    from carpool.tools.demo import main as demo_main

    demo_main(list(ctx.args))


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def bench(ctx: typer.Context) -> None:
    """Load a server, or a model in this process, and report (--help for options)."""
    from carpool.tools.bench import main as bench_main

    _import_from(Path.cwd())  # a module:attr target in the working directory
    bench_main(list(ctx.args))


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def tune(ctx: typer.Context) -> None:
    """Search batching settings for the most throughput under a p99 SLO (--help for options)."""
    from carpool.tools.tune_cli import main as tune_main

    _import_from(Path.cwd())  # a module:attr target in the working directory
    tune_main(list(ctx.args))


@app.command()
def top(
    url: Annotated[
        str, typer.Argument(help="The server's HTTP address.")
    ] = "http://127.0.0.1:8000",
) -> None:
    """A live terminal view of a running server: q quits, arrows pick a model, s sorts, ? help."""
    from carpool.tools.top import run_top

    run_top(url)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def doctor(ctx: typer.Context) -> None:
    """Measure a model offline: throughput knee, memory, batch invariance (--help for options)."""
    from carpool.tools.doctor import main as doctor_main

    _import_from(Path.cwd())  # a module:attr target in the working directory
    doctor_main(list(ctx.args))


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def trace(ctx: typer.Context) -> None:
    """Record a running server's requests and batches as a Perfetto trace (--help)."""
    from carpool.tools.trace import main as trace_main

    trace_main(list(ctx.args))


def _repository(config_path: str | None, ray_address: str | None = None) -> ModelRepository:
    """The models of ``config_path``, or the built-in ones; a bad config exits with status 2."""
    from carpool.server.repository import ModelRepository

    if config_path is None:
        from carpool.server.defaults import default_models

        return ModelRepository(default_models())
    from carpool.config import RayConfig, load_config
    from carpool.errors import ConfigError
    from carpool.server.builder import build_repository

    _import_from(Path(config_path).resolve().parent, Path.cwd())
    try:
        loaded = load_config(config_path)
        if ray_address is not None:
            ray = loaded.ray or RayConfig(address=None, namespace=None, runtime_env=None)
            loaded = loaded.model_copy(
                update={"ray": ray.model_copy(update={"address": ray_address})}
            )
        return build_repository(loaded, file=config_path)
    except ConfigError as error:
        print(f"carpool serve: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _import_from(*folders: Path) -> None:
    """Let ``module:attr`` sources import from ``folders`` first: the config file's folder
    (where its file paths are relative to), then the working directory, which the
    ``carpool`` script, unlike ``python -m carpool.cli``, does not put on ``sys.path``
    (uvicorn puts it there for ``module:app`` the same way)."""
    for folder in reversed(folders):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))


def main(argv: list[str] | None = None) -> None:
    app(args=argv, prog_name="carpool")


if __name__ == "__main__":
    main()
