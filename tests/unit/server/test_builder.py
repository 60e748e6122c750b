"""Served models built from a config: tensors, policy, placement, and errors naming the key."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from carpool.config import parse_config
from carpool.errors import ConfigError
from carpool.server.builder import build_repository, build_runner


def _config(**model: Any) -> Any:
    base = {
        "name": "m",
        "kind": "python",
        "source": "numpy:copy",
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1]}],
    }
    return parse_config({"models": [{**base, **model}]})


def test_builds_a_served_model_per_config_entry() -> None:
    repository = build_repository(
        _config(max_batch_size=8, max_delay_s=0.01, devices=["cpu", "cpu"], version=3)
    )
    model = repository.get("m", "3")
    assert model.platform == "python"
    assert model.metadata()["inputs"] == [{"name": "X", "datatype": "FP32", "shape": [-1, -1]}]
    assert model.batcher.policy.max_batch_size == 8
    assert model.batcher.policy.max_delay_s == 0.01
    assert model.batcher.num_replicas == 2


def test_source_that_does_not_import_names_the_model_key() -> None:
    with pytest.raises(ConfigError) as caught:
        build_repository(_config(source="carpool_no_such_module:f"), file="serve.yaml")
    assert str(caught.value).startswith("serve.yaml: invalid models[0].source=")
    assert "ModuleNotFoundError" in str(caught.value)


def test_only_a_torch_model_with_a_replica_on_cuda_gets_a_gpu_memory_probe() -> None:
    pytest.importorskip("torch")
    from carpool.models.torch import CudaMemoryProbe, cuda_memory_probe

    assert cuda_memory_probe(["cpu", "cpu"]) is None
    probe = cuda_memory_probe(["cpu", "cuda:1", "cuda", "cuda:1"])
    assert isinstance(probe, CudaMemoryProbe) and probe.indices == [0, 1]
    repository = build_repository(_config(devices=["cuda:0"]))  # python: its own memory
    assert repository.get("m").batcher.memory_probe is None
    torch_model = {"kind": "torch", "source": "carpool.models.mlp:build_w1", "device": "cuda:0"}
    repository = build_repository(_config(**torch_model))  # its device is checked at start
    assert isinstance(repository.get("m").batcher.memory_probe, CudaMemoryProbe)


def test_build_runner_gives_the_model_serve_runs_without_a_batcher() -> None:
    model = _config(source="numpy:negative").models[0]
    runner = build_runner(model, key="models[0]", file="serve.yaml")
    assert [spec.name for spec in runner.inputs] == ["X"]
    assert [spec.name for spec in runner.outputs] == ["Y"]
    fn = runner.fn_factory("cpu")
    np.testing.assert_array_equal(fn(np.ones(2)), -np.ones(2))


def test_build_runner_refuses_a_model_its_engine_schedules() -> None:
    model = _config().models[0].model_copy(update={"kind": "generation"})
    with pytest.raises(ConfigError) as caught:
        build_runner(model)
    assert caught.value.field == "kind" and "python" in caught.value.expected
