"""The Python API as a program embedding carpool uses it: typed for mypy, and its
constructors refusing arguments of the wrong kind at once, naming them (not at the
first request, nor as an AttributeError from deep inside)."""

from __future__ import annotations

import importlib.resources
import textwrap
from pathlib import Path
from typing import Any

import pytest
from mypy import api as mypy_api

import carpool
from carpool import Batcher, BatchPolicy, ConfigError, FakeClock


def _double(batch: Any) -> Any:
    return batch * 2


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


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"fn": 42}, "fn"),
        ({"fn": None, "fn_factory": "cpu"}, "fn_factory"),
        ({"policy": {"max_batch_size": 8}}, "policy"),
        ({"policy": 8}, "policy"),
        ({"devices": "cuda:0"}, "devices"),
        ({"devices": [0, 1]}, "devices[]"),
        ({"collate": 42}, "collate"),
        ({"name": 5}, "name"),
        ({"clock": 5}, "clock"),
        ({"on_trace": "print"}, "on_trace"),
        ({"memory_probe": 5}, "memory_probe"),
        ({"policy_check": 5}, "policy_check"),
        ({"slow_request_s": -1.0}, "slow_request_s"),
        ({"slow_request_s": "0.2"}, "slow_request_s"),
        ({"switch_interval_s": True}, "switch_interval_s"),
    ],
)
def test_batcher_refuses_an_argument_of_the_wrong_kind_naming_it(
    kwargs: dict[str, Any], field: str
) -> None:
    options = {"fn": _double, **kwargs}
    fn = options.pop("fn")
    with pytest.raises(ConfigError) as caught:
        Batcher(fn, **options)
    assert caught.value.field == field
    assert "expected" in str(caught.value)


def test_batched_decorator_refuses_what_is_not_callable() -> None:
    with pytest.raises(ConfigError) as caught:
        carpool.batched(42)
    assert caught.value.field == "fn"


def test_batched_decorator_refuses_a_device_string_that_is_not_a_list() -> None:
    with pytest.raises(ConfigError) as caught:
        carpool.batched(devices="cuda:0")(_double)  # type: ignore[arg-type]
    assert caught.value.field == "devices"


def test_policy_refuses_length_buckets_that_are_not_a_list() -> None:
    with pytest.raises(ConfigError) as caught:
        BatchPolicy(length_buckets=5)  # type: ignore[arg-type]
    assert caught.value.field == "length_buckets"


def test_set_policy_refuses_what_is_not_a_batch_policy() -> None:
    batcher = Batcher(_double, clock=FakeClock())
    with pytest.raises(ConfigError) as caught:
        batcher.set_policy({"max_batch_size": 8})  # type: ignore[arg-type]
    assert caught.value.field == "policy"
    assert batcher.policy.max_batch_size == 32  # unchanged
