"""``ray_placement``: its checks and the bundle each replica reserves, without a cluster
(tests/integration/test_ray.py places replicas on a real one)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from carpool import Batcher, ConfigError
from carpool.core.ray_placement import STRATEGIES, RayPlacement, bundle_of, check_ray_placement


def double(batch: Any) -> Any:
    return np.asarray(batch) * 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_ray_strategy_is_accepted(strategy: str) -> None:
    assert check_ray_placement({"strategy": strategy}) == RayPlacement(strategy)


def test_no_placement_places_replicas_one_by_one() -> None:
    assert check_ray_placement(None) is None


@pytest.mark.parametrize(
    ("placement", "field", "expected"),
    [
        ("SPREAD", "ray_placement", "a mapping {strategy: S}"),
        ({}, "ray_placement", "a mapping {strategy: S}"),
        ({"strategy": "SPREAD", "name": "g"}, "ray_placement", "a mapping {strategy: S}"),
        ({"strategy": "spread"}, "ray_placement.strategy", "one of PACK, SPREAD"),
        ({"strategy": None}, "ray_placement.strategy", "STRICT_SPREAD"),
    ],
)
def test_bad_placements_say_which_and_what_is_expected(
    placement: object, field: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        check_ray_placement(placement)
    assert caught.value.field == field
    assert expected in str(caught.value)


def test_a_bundle_spells_resources_as_ray_does_and_leaves_out_zeros() -> None:
    resources = {"num_cpus": 1.0, "num_gpus": 0.5, "memory": 2e9, "accel": 2.0, "other": 0.0}
    assert bundle_of(resources) == {"CPU": 1.0, "GPU": 0.5, "memory": 2e9, "accel": 2.0}


def test_a_bundle_of_nothing_is_refused_naming_ray_resources() -> None:
    with pytest.raises(ConfigError, match="Ray reserves no empty one") as caught:
        bundle_of({"num_cpus": 0.0})
    assert caught.value.field == "ray_resources"


def test_a_batcher_checks_the_placement_when_built() -> None:
    pytest.importorskip("ray")
    with pytest.raises(ConfigError, match="None unless executor='ray'"):
        Batcher(double, executor="thread", ray_placement={"strategy": "PACK"})
    with pytest.raises(ConfigError, match="one of PACK"):
        Batcher(double, executor="ray", ray_placement={"strategy": "GANG"})
    with pytest.raises(ConfigError, match="no empty one"):
        Batcher(
            double,
            executor="ray",
            ray_resources={"num_cpus": 0},
            ray_placement={"strategy": "PACK"},
        )
    Batcher(double, executor="ray", num_replicas=2, ray_placement={"strategy": "SPREAD"})
