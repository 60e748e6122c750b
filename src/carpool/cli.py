"""The ``carpool`` command.

``carpool serve [CONFIG.yaml]`` serves the models a config lists (the built-in ones without
one) over KServe v2; ``carpool demo`` shows what batching buys on the reference MLP.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from carpool import __version__

if TYPE_CHECKING:
    from carpool.server.repository import ModelRepository


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="carpool", description="requests that share the ride")
    parser.add_argument("--version", action="version", version=f"carpool {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "demo", help="run the reference MLP unbatched, then batched", add_help=False
    )
    serve = commands.add_parser(
        "serve",
        help="serve the models of CONFIG (or the built-in ones) over KServe v2 HTTP and gRPC",
    )
    serve.add_argument(
        "config", nargs="?", metavar="CONFIG", help="YAML file listing the models to serve"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    serve.add_argument(
        "--grpc-port", type=int, default=8001, help="gRPC port (default 8001; 0 or less: no gRPC)"
    )
    serve.add_argument("--log-level", default="warning", help="uvicorn log level")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from carpool.tools.demo import main as demo_main

        demo_main(rest)
    elif args.command == "serve":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from carpool.server.run import serve as run_server

        run_server(
            _repository(args.config),
            host=args.host,
            port=args.port,
            grpc_port=args.grpc_port,
            log_level=args.log_level,
        )


def _repository(config_path: str | None) -> ModelRepository:
    """The models of ``config_path``, or the built-in ones; a bad config exits with status 2."""
    from carpool.server.repository import ModelRepository

    if config_path is None:
        from carpool.server.defaults import default_models

        return ModelRepository(default_models())
    from carpool.config import load_config
    from carpool.errors import ConfigError
    from carpool.server.builder import build_repository

    try:
        return build_repository(load_config(config_path), file=config_path)
    except ConfigError as error:
        print(f"carpool serve: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
