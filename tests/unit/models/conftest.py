"""Fixtures shared by the runner tests."""

from __future__ import annotations

import itertools
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_names = itertools.count()


@pytest.fixture
def make_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """Writes a module to tmp_path and returns its (unique) importable name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def make(source: str) -> str:
        name = f"carpool_runner_test_{next(_names)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        written.append(name)
        return name

    yield make
    for name in written:
        sys.modules.pop(name, None)
