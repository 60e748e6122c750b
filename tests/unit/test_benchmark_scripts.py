"""Every benchmark script imports: a helper moved or renamed breaks them, and nothing else
runs them (they need wrk, a peers' environment or a GPU, and minutes)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py"))


@pytest.fixture
def on_path() -> Iterator[None]:
    sys.path.insert(0, str(BENCHMARKS))  # as running `python benchmarks/bench_x.py` does
    try:
        yield
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_imports(name: str, on_path: None) -> None:
    module = importlib.import_module(name)
    if name.startswith("bench_"):
        assert callable(getattr(module, "main", None)), f"{name} has no main()"
