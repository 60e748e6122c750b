"""The public API is short and curated: pinned here so a change is a decision."""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import pytest
from mypy import api as mypy_api

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
    "QueueTooLong",
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


# -- typed for the user's mypy --------------------------------------------------------------


def test_package_ships_the_pep_561_marker() -> None:
    assert importlib.resources.files("carpool").joinpath("py.typed").is_file()


def test_user_script_with_a_batched_method_passes_mypy_strict(tmp_path: Path) -> None:
    # docs/core.md decorates a method; a user who runs mypy --strict on that code gets
    # carpool's annotations (py.typed) and no complaint about the method's signature.
    script = tmp_path / "user.py"
    script.write_text(
        textwrap.dedent(
            """
            import numpy as np
            import carpool


            class Model:
                @carpool.batched(max_batch_size=32)
                async def predict(self, batch: np.ndarray) -> np.ndarray:
                    return batch


            @carpool.batched(max_batch_size=64, max_delay_s=0.002)
            def embed(batch: np.ndarray) -> np.ndarray:
                return batch


            async def main() -> carpool.TelemetrySnapshot:
                model = Model()
                await model.predict(np.zeros(3))
                await model.predict.stop()
                async with embed:
                    await embed(np.zeros(3), priority="interactive", timeout_s=0.1)
                return embed.snapshot()
            """
        )
    )
    config = tmp_path / "mypy.ini"  # not the repository's, whose mypy_path finds src/
    config.write_text("[mypy]\n")
    stdout, stderr, status = mypy_api.run(
        [
            "--strict",
            "--config-file",
            str(config),
            "--cache-dir",
            str(tmp_path / "cache"),
            str(script),
        ]
    )
    assert status == 0, stdout + stderr
