"""The ``carpool`` command.

``carpool serve`` serves the built-in models over KServe v2 HTTP; ``carpool demo`` shows
what batching buys on the reference MLP.
"""

from __future__ import annotations

import argparse

from carpool import __version__


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="carpool", description="requests that share the ride")
    parser.add_argument("--version", action="version", version=f"carpool {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "demo", help="run the reference MLP unbatched, then batched", add_help=False
    )
    serve = commands.add_parser("serve", help="serve the built-in models over KServe v2 HTTP")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    serve.add_argument("--log-level", default="warning", help="uvicorn log level")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from carpool.tools.demo import main as demo_main

        demo_main(rest)
    elif args.command == "serve":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from carpool.server.defaults import default_models
        from carpool.server.repository import ModelRepository
        from carpool.server.run import serve as run_server

        run_server(
            ModelRepository(default_models()),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
        )


if __name__ == "__main__":
    main()
