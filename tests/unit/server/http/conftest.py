"""Fixtures of the HTTP protocol's tests: servers of connections on fake transports."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .fakes import Server, Setup, gated, serving


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    """Model "m" (doubling) on the fast path and "custom" (its own infer)."""
    async with serving() as served:
        yield served


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    """Model "m", held while ``setup.model.open`` is clear."""
    s, repository = await gated()
    try:
        yield s
    finally:
        s.model.open.set()
        await repository.stop()


@pytest.fixture
async def short_keep_alive() -> AsyncIterator[Setup]:
    """As ``setup``, with a keep-alive time of 50 ms."""
    s, repository = await gated(timeout_keep_alive_s=0.05)
    try:
        yield s
    finally:
        s.model.open.set()
        await repository.stop()
