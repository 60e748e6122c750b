"""``carpool.core.allocator``: glibc's thresholds raised where that applies, and a line
saying what happened everywhere else; it never raises."""

from __future__ import annotations

import ctypes
import platform
from typing import Any

import pytest

from carpool.core import allocator
from carpool.core.allocator import ENV, setting, tune_malloc


class FakeMallopt:
    """A C function as ctypes gives it: callable, and takes ``argtypes``."""

    def __init__(self, returns: int) -> None:
        self.returns = returns
        self.calls: list[tuple[int, int]] = []
        self.argtypes: tuple[Any, ...] = ()

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.returns


class FakeLibc:
    def __init__(self, returns: int) -> None:
        self.mallopt = FakeMallopt(returns)

    @property
    def calls(self) -> list[tuple[int, int]]:
        return self.mallopt.calls


def _glibc(monkeypatch: pytest.MonkeyPatch, libc: Any) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)


def test_on_glibc_both_thresholds_are_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeLibc(returns=1)
    _glibc(monkeypatch, libc)
    line = tune_malloc()
    assert libc.calls == [
        (-3, allocator.MMAP_THRESHOLD_BYTES),  # M_MMAP_THRESHOLD
        (-1, allocator.TRIM_THRESHOLD_BYTES),  # M_TRIM_THRESHOLD
    ]
    assert "keeps freed memory" in line and "64 MiB" in line and ENV in line
    assert setting() == line  # for the server's ready lines


def test_a_refusal_is_said_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    _glibc(monkeypatch, FakeLibc(returns=0))
    assert "refused" in tune_malloc()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({ENV: "default"}, "defaults kept"),
        ({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, "tcmalloc is preloaded"),
    ],
)
def test_it_leaves_the_allocator_alone_when_asked_or_replaced(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    libc = FakeLibc(returns=1)
    _glibc(monkeypatch, libc)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert expected in tune_malloc()
    assert libc.calls == []


def test_another_c_library_is_left_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeLibc(returns=1)
    _glibc(monkeypatch, libc)
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert "not glibc" in tune_malloc()
    assert libc.calls == []


def test_a_libc_without_mallopt_is_said_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    _glibc(monkeypatch, object())
    assert "not reachable" in tune_malloc()
