"""Served models built from a config: tensors, policy, placement, and errors naming the key;
declared tensors checked against an ONNX file, and a model's outputs against those
declared."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.config import parse_config
from carpool.errors import ConfigError, InvalidInput, ModelError
from carpool.server.builder import build_repository, build_runner
from carpool.server.infer import error_response
from carpool.server.kserve.tensors import InferRequest, InputTensor

BASE_MODEL = {
    "name": "m",
    "kind": "python",
    "source": "numpy:copy",
    "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1]}],
    "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1]}],
}


def _config(**model: Any) -> Any:
    return parse_config({"models": [{**BASE_MODEL, **model}]})


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


def test_buffer_pool_keys_reach_the_batcher() -> None:
    repository = build_repository(_config(buffer_pool=True, buffer_pool_mb=2))
    pool = repository.get("m").batcher.buffer_pool
    assert pool is not None and pool.budget_bytes == 2 * 2**20
    assert build_repository(_config()).get("m").batcher.buffer_pool is not None  # the default
    assert build_repository(_config(buffer_pool=False)).get("m").batcher.buffer_pool is None


def test_torch_gpu_keys_reach_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    torch_model = {
        "kind": "torch",
        "source": "carpool.models.mlp:build_w1",
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [256]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [16]}],
        "cuda_graphs": True,
        "autocast": True,
        "preferred_batch_sizes": [4, 8],
        "max_batch_size": 8,
    }
    captured: dict[str, Any] = {}
    import carpool.models.torch as torch_models

    original = torch_models.torch_factory

    def spy(source: str, **options: Any) -> Any:
        captured.update(options)
        return original(source, **options)

    monkeypatch.setattr(torch_models, "torch_factory", spy)
    build_runner(_config(**torch_model).models[0])
    assert captured["autocast"] is True and captured["cuda_graphs"] == (4, 8)


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


# -- onnx: declared tensors against the file's ---------------------------------------------


def _onnx_int64_add(path: Path) -> None:
    """ids INT64 [batch, n] -> out INT64 [batch, n] = ids + 1; second output s FP32."""
    import onnx
    from onnx import TensorProto, helper

    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    nodes = [
        helper.make_node("Add", ["ids", "one"], ["out"]),
        helper.make_node("Cast", ["ids"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["f"], ["s"], axes=[1], keepdims=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "n"])],
        [
            helper.make_tensor_value_info("out", TensorProto.INT64, ["batch", "n"]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, ["batch", 1]),
        ],
        initializer=[one],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    onnx.save(model, str(path))


def _onnx_config(path: Path, **extra: Any) -> Any:
    return parse_config({"models": [{"name": "m", "kind": "onnx", "source": str(path), **extra}]})


def test_onnx_declared_input_datatype_contradicting_the_file_is_refused_at_build(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.onnx"
    _onnx_int64_add(path)
    config = _onnx_config(path, inputs=[{"name": "ids", "datatype": "INT32", "shape": [-1]}])
    with pytest.raises(ConfigError, match="ids"):
        build_repository(config)


def test_onnx_declared_output_name_missing_from_the_file_is_refused_at_build(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.onnx"
    _onnx_int64_add(path)
    config = _onnx_config(path, outputs=[{"name": "logits", "datatype": "INT64", "shape": [-1]}])
    with pytest.raises(ConfigError, match="logits"):
        build_repository(config)


def _run(model: Any, payload: dict[str, np.ndarray]) -> Any:
    async def go() -> Any:
        await model.batcher.start()
        try:
            return await model.run(payload, {})
        finally:
            await model.batcher.stop(drain=True)

    return asyncio.run(go())


def test_onnx_specs_read_from_file_serve_int64_and_two_outputs(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    _onnx_int64_add(path)
    (model,) = build_repository(_onnx_config(path))
    assert [t.datatype for t in model.inputs] == ["INT64"]
    assert [t.shape for t in model.outputs] == [(-1,), (1,)]
    out = _run(model, {"ids": np.array([[1, 2], [3, 4]], dtype=np.int64)})
    np.testing.assert_array_equal(out["out"], [[2, 3], [4, 5]])
    np.testing.assert_array_equal(out["s"], [[3.0], [7.0]])


# -- a python model's tensors against those declared ---------------------------------------


def _request(x: np.ndarray) -> InferRequest:
    return InferRequest(None, (InputTensor("X", "FP32", x.shape, x),), None, {}, False)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "carpool_builder_user_models.py").write_text(
        "def wrong_name(inputs):\n    return {'Z': inputs['X']}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "carpool_builder_user_models"


def test_python_model_missing_a_declared_output_names_it(user_module: str) -> None:
    (model,) = build_repository(_config(source=f"{user_module}:wrong_name"))
    request = _request(np.ones((1, 3), np.float32))
    payload = model.payload(request)
    with pytest.raises(ModelError) as caught:
        _run(model, payload)
    status, body, _ = error_response(caught.value)
    assert status == 500
    assert b"'Y'" in body and b"output" in body, body


def test_declared_shape_mismatch_is_a_clear_400() -> None:
    (model,) = build_repository(
        _config(inputs=[{"name": "X", "datatype": "FP32", "shape": [-1, 4]}])
    )
    with pytest.raises(InvalidInput) as caught:
        model.payload(_request(np.ones((2, 5), np.float32)))
    status, body, _ = error_response(caught.value)
    assert status == 400
    assert b"'X'" in body and b"[2, 5]" in body and b"[-1, -1, 4]" in body, body


def test_a_ray_section_connects_when_a_model_runs_on_ray(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("ray")
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr("carpool.server.builder.connect", lambda *args: calls.append(args))
    ray_section = {"address": "auto", "namespace": "serving"}
    on_ray = {**BASE_MODEL, "executor": "ray", "num_replicas": 2, "ray_resources": {"num_cpus": 1}}
    repository = build_repository(parse_config({"models": [on_ray], "ray": ray_section}))
    assert calls == [("auto", "serving", None)]
    assert repository.get("m").batcher.num_replicas == 2
    build_repository(parse_config({"models": [BASE_MODEL], "ray": ray_section}))
    assert len(calls) == 1  # no model on Ray: nothing to connect to
