"""Trimming after bursts (carpool.server.memory): when the server falls quiet."""

from __future__ import annotations

import ctypes
import sys

import pytest

from carpool.server import memory
from carpool.server.memory import MIN_REQUESTS, Trimmer


class Server:
    def __init__(self) -> None:
        self.num_requests = 0
        self.is_idle = True
        self.num_trims = 0

    def trimmer(self) -> Trimmer:
        return Trimmer(lambda: self.num_requests, lambda: self.is_idle, self.trim)

    def trim(self) -> None:
        self.num_trims += 1


def test_quiet_after_a_burst_trims_once() -> None:
    server = Server()
    trimmer = server.trimmer()
    server.num_requests += MIN_REQUESTS
    assert not trimmer.tick()  # requests were answered this second: not quiet yet
    assert trimmer.tick()
    assert not trimmer.tick()  # once per burst


def test_steady_load_never_trims() -> None:
    server = Server()
    trimmer = server.trimmer()
    for _ in range(100):
        server.num_requests += MIN_REQUESTS
        assert not trimmer.tick()


def test_a_few_requests_are_no_burst() -> None:
    server = Server()
    trimmer = server.trimmer()
    server.num_requests += MIN_REQUESTS - 1
    trimmer.tick()
    assert not trimmer.tick()


def test_work_still_queued_is_not_quiet() -> None:
    server = Server()
    trimmer = server.trimmer()
    server.num_requests += MIN_REQUESTS
    trimmer.tick()
    server.is_idle = False
    assert not trimmer.tick()
    server.is_idle = True
    assert trimmer.tick()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_malloc_trim_runs_on_glibc() -> None:
    trim = memory.malloc_trim()
    if trim is None:
        pytest.skip("this Linux has no glibc")
    assert trim() in (0, 1)


def test_without_malloc_trim_it_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class NoTrim:
        def __init__(self, name: object) -> None:
            pass

    monkeypatch.setattr(ctypes, "CDLL", NoTrim)
    with caplog.at_level("INFO", logger="carpool.server"):
        assert memory.malloc_trim() is None
    assert "malloc_trim is not available" in caplog.text
