"""The public API is short and curated: pinned here so a change is a decision."""

from __future__ import annotations

import importlib

import pytest

import carpool

PUBLIC_API = [
    "BatchPolicy",
    "BatchTimeout",
    "BatchedFunction",
    "Batcher",
    "CapacityError",
    "CarpoolError",
    "ClassPolicy",
    "Closed",
    "ConfigError",
    "DeadlineExceeded",
    "FakeClock",
    "InvalidInput",
    "ModelError",
    "QueueFull",
    "RequestTrace",
    "TelemetrySnapshot",
    "__version__",
    "batched",
]


def test_all_is_exactly_the_pinned_public_api() -> None:
    assert carpool.__all__ == PUBLIC_API


def test_all_is_sorted() -> None:
    assert carpool.__all__ == sorted(carpool.__all__)


def test_all_has_no_duplicates() -> None:
    assert len(set(carpool.__all__)) == len(carpool.__all__)


@pytest.mark.parametrize("name", PUBLIC_API)
def test_each_public_name_is_importable(name: str) -> None:
    module = importlib.import_module("carpool")
    assert getattr(module, name) is not None


def test_star_import_gives_exactly_the_public_api() -> None:
    namespace: dict[str, object] = {}
    exec("from carpool import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(PUBLIC_API)


def test_core_all_is_sorted_and_importable() -> None:
    core = importlib.import_module("carpool.core")
    assert core.__all__ == sorted(core.__all__)
    for name in core.__all__:
        assert getattr(core, name) is not None


def test_version_is_a_string() -> None:
    assert isinstance(carpool.__version__, str)
    assert carpool.__version__.count(".") >= 1
