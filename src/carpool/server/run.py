"""Runs the KServe v2 HTTP app on uvicorn (uvloop + httptools)."""

from __future__ import annotations

from types import FrameType

import uvicorn

from carpool.server.app import KServeApp
from carpool.server.repository import ModelRepository


class _DrainingServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would
    die by the signal. Here the shutdown drains every accepted request first, which makes
    the exit a clean one: status 0."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


def serve(
    repository: ModelRepository,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
) -> None:
    """Serve until SIGINT/SIGTERM; then stop accepting, drain every batcher, exit 0."""
    config = uvicorn.Config(
        KServeApp(repository),
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level=log_level,
        timeout_graceful_shutdown=30,
    )
    _DrainingServer(config).run()
