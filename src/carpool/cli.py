"""The ``carpool`` command. ``carpool demo`` shows what batching buys on the reference MLP."""

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
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from carpool.tools.demo import main as demo_main

        demo_main(rest)


if __name__ == "__main__":
    main()
