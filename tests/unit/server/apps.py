"""A started app over served models, for tests that drive the ASGI app in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from carpool.server.app import KServeApp
from carpool.server.repository import ModelRepository, ServedModel


@asynccontextmanager
async def started_app(*models: ServedModel) -> AsyncIterator[KServeApp]:
    """The app serving ``models``, their batchers started; stopped on the way out."""
    app = KServeApp(ModelRepository(list(models)))
    await app.repository.start()
    try:
        yield app
    finally:
        await app.repository.stop()
