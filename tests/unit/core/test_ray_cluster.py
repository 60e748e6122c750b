"""Ray options and the connection (``executor="ray"``), without a cluster."""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest

from carpool import Batcher, ConfigError
from carpool.core.ray_cluster import (
    DEFAULT_MAX_RESTARTS,
    RayOptions,
    check_max_restarts,
    check_ray_resources,
    connect,
    ensure_connected,
    import_ray,
)
from carpool.core.replicas import usable_cpus


def double(batch: Any) -> Any:
    return np.asarray(batch) * 2


def test_ray_resources_default_to_one_cpu_and_keep_custom_names() -> None:
    assert check_ray_resources(None) == {"num_cpus": 1.0}
    checked = check_ray_resources({"num_cpus": 2, "num_gpus": 0.5, "accelerator_x": 1})
    assert checked == {"num_cpus": 2.0, "num_gpus": 0.5, "accelerator_x": 1.0}


@pytest.mark.parametrize(
    ("resources", "field", "expected"),
    [
        ([1], "ray_resources", "a mapping of Ray resource names to numbers >= 0"),
        ({"num_gpus": -1}, "ray_resources.num_gpus", "a number >= 0"),
        ({"num_cpus": True}, "ray_resources.num_cpus", "a number >= 0"),
        ({"num_cpus": "1"}, "ray_resources.num_cpus", "a number >= 0"),
        ({"num_cpus": float("nan")}, "ray_resources.num_cpus", "a number >= 0"),
        ({1: 1}, "ray_resources", "1 is no name"),
    ],
)
def test_bad_ray_resources_say_which_and_what_is_expected(
    resources: object, field: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        check_ray_resources(resources)
    assert caught.value.field == field
    assert expected in str(caught.value)


def test_max_restarts_is_an_integer_from_minus_one() -> None:
    assert check_max_restarts(-1) == -1
    assert check_max_restarts(0) == 0
    for bad in (-2, 1.5, True, "3"):
        with pytest.raises(ConfigError, match="an integer >= -1"):
            check_max_restarts(bad)


def test_actor_options_split_ray_arguments_from_custom_resources() -> None:
    options = RayOptions({"num_cpus": 1.0, "num_gpus": 1.0, "memory": 2e9, "accel": 2.0}, 5)
    assert options.actor_options() == {
        "max_restarts": 5,
        "num_cpus": 1.0,
        "num_gpus": 1.0,
        "memory": 2_000_000_000,
        "resources": {"accel": 2.0},
    }
    assert RayOptions().actor_options() == {
        "max_restarts": DEFAULT_MAX_RESTARTS,
        "num_cpus": 1.0,
    }


def test_ray_not_installed_is_a_config_error_saying_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ConfigError) as caught:
        import_ray()
    assert (caught.value.field, caught.value.value) == ("executor", "ray")
    assert "pip install 'carpool[ray]'" in str(caught.value)
    with pytest.raises(ConfigError, match=r"carpool\[ray\]"):
        Batcher(double, executor="ray")


@pytest.mark.parametrize(
    ("kwargs", "field", "expected"),
    [
        ({"ray_resources": {"num_cpus": 1}}, "ray_resources", "None unless executor='ray'"),
        ({"max_restarts": 2}, "max_restarts", "None unless executor='ray'"),
        ({"executor": "ray", "ray_resources": {"num_cpus": -1}}, "ray_resources.num_cpus", ">= 0"),
        ({"executor": "ray", "max_restarts": -5}, "max_restarts", "an integer >= -1"),
    ],
)
def test_batcher_checks_ray_options(kwargs: dict[str, Any], field: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Batcher(double, **kwargs)
    assert caught.value.field == field
    assert expected in str(caught.value)


def test_a_lambda_cannot_reach_an_actor_and_the_error_names_executor_ray() -> None:
    with pytest.raises(ConfigError, match="for executor='ray', a picklable function"):
        Batcher(lambda batch: batch, executor="ray")


class FakeRay(types.ModuleType):
    """Stands for the ``ray`` module: records ``init``, raises what it is told to."""

    def __init__(self, raises: Exception | None = None) -> None:
        super().__init__("ray")
        self.inits: list[dict[str, Any]] = []
        self.raises = raises

    def is_initialized(self) -> bool:
        return bool(self.inits)

    def init(self, **kwargs: Any) -> None:
        if self.raises is not None:
            raise self.raises
        self.inits.append(kwargs)


def test_without_an_address_a_local_ray_starts_sized_to_this_machine(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ensure_connected()
    ensure_connected()  # connected already: nothing more
    assert fake.inits == [{"num_cpus": usable_cpus(), "include_dashboard": False}]
    assert "started a local one" in caplog.text


def test_ray_address_in_the_environment_is_connected_to(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    ensure_connected()
    assert fake.inits == [{"address": "10.0.0.1:6379", "namespace": None}]


def test_an_address_with_no_cluster_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay(ConnectionError("Could not find any running Ray instance"))
    monkeypatch.setitem(sys.modules, "ray", fake)
    with pytest.raises(ConfigError) as caught:
        connect("10.0.0.1:6379", runtime_env={"pip": ["x"]})
    assert (caught.value.field, caught.value.value) == ("ray.address", "10.0.0.1:6379")
    assert "the address of a running Ray cluster" in str(caught.value)
    assert "Could not find any running Ray instance" in str(caught.value)
