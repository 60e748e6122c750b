"""How config entries become served python, torch and onnx models, found in review against
Triton and against onnxruntime and torch run directly. Each test failed before its fix."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from carpool.cli import app
from carpool.config import load_config, parse_config
from carpool.errors import ConfigError
from carpool.server.builder import build_repository
from carpool.server.repository import ServedModel


def _save_onnx(path: Path, nodes: list[Any], inputs: list[Any], outputs: list[Any]) -> Path:
    import onnx
    from onnx import helper

    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _onnx_model(path: Path, **entry: Any) -> ServedModel:
    config = parse_config({"models": [{"name": "m", "kind": "onnx", "source": str(path), **entry}]})
    (model,) = build_repository(config)
    return model


def _run(model: ServedModel, payload: dict[str, np.ndarray]) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        await model.batcher.start()
        try:
            result: dict[str, Any] = await model.run(payload, {})
            return result
        finally:
            await model.batcher.stop(drain=True)

    return asyncio.run(go())


def _session_run(path: Path, feed: dict[str, np.ndarray]) -> list[Any]:
    import onnxruntime as ort  # type: ignore[import-untyped]

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return list(session.run(None, feed))


# -- onnx ---------------------------------------------------------------------------------


def test_onnx_string_input_reaches_the_model_as_text(tmp_path: Path) -> None:
    # BYTES requests arrive as bytes elements; onnxruntime str()s anything that is not a
    # str, so the model saw "b'hi'" where onnxruntime run directly on the text sees "hi".
    from onnx import TensorProto, helper

    path = _save_onnx(
        tmp_path / "echo.onnx",
        [helper.make_node("Identity", ["s"], ["o"])],
        [helper.make_tensor_value_info("s", TensorProto.STRING, ["batch"])],
        [helper.make_tensor_value_info("o", TensorProto.STRING, ["batch"])],
    )
    model = _onnx_model(path)
    assert [t.datatype for t in (*model.inputs, *model.outputs)] == ["BYTES", "BYTES"]
    out = _run(model, {"s": np.array([b"hi", "thé".encode()], dtype=object)})
    (expected,) = _session_run(path, {"s": np.array(["hi", "thé"], dtype=object)})
    assert list(out["o"]) == list(expected) == ["hi", "thé"]


def _affine_with_sequence_output(path: Path) -> Path:
    # Like skl2onnx's classifiers (ZipMap: seq(map(...))): an output that is not a tensor.
    from onnx import TensorProto, helper

    return _save_onnx(
        path,
        [
            helper.make_node("Identity", ["x"], ["y"]),
            helper.make_node("SequenceConstruct", ["x"], ["rows"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_sequence_value_info("rows", TensorProto.FLOAT, None),
        ],
    )


def test_onnx_declared_outputs_may_leave_out_an_output_that_is_not_a_tensor(
    tmp_path: Path,
) -> None:
    path = _affine_with_sequence_output(tmp_path / "seq.onnx")
    model = _onnx_model(path, outputs=[{"name": "y", "datatype": "FP32", "shape": [3]}])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(_run(model, {"x": x})["y"], _session_run(path, {"x": x})[0])


def test_onnx_undeclared_output_that_is_not_a_tensor_says_how_to_leave_it_out(
    tmp_path: Path,
) -> None:
    path = _affine_with_sequence_output(tmp_path / "seq.onnx")
    with pytest.raises(ConfigError) as caught:
        _onnx_model(path)
    message = str(caught.value)
    assert "'rows'" in message and "seq(tensor(float))" in message and "outputs" in message


def test_onnx_declared_output_the_file_gives_no_shape_for_is_served(tmp_path: Path) -> None:
    # onnxruntime reports an output of unknown rank as shape []: the declaration says it.
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Size", ["shape"], ["rank"]),
        helper.make_node("Unsqueeze", ["rank", "zero"], ["axes"]),
        helper.make_node("Unsqueeze", ["x", "axes"], ["wide"]),
        helper.make_node("Squeeze", ["wide", "axes"], ["y"]),
    ]
    import onnx

    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[helper.make_tensor("zero", TensorProto.INT64, [1], [0])],
    )
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx_model.ir_version = 8
    path = tmp_path / "unknown_rank.onnx"
    onnx.save(onnx_model, str(path))
    model = _onnx_model(path, outputs=[{"name": "y", "datatype": "FP32", "shape": [3]}])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(_run(model, {"x": x})["y"], _session_run(path, {"x": x})[0])


def _identity_4(path: Path) -> Path:
    from onnx import TensorProto, helper

    return _save_onnx(
        path,
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )


def test_onnx_declared_any_size_where_the_file_fixes_the_dim_is_refused(tmp_path: Path) -> None:
    # Triton refuses such a config at load; accepted, a [k, 3] request passed the checks
    # and failed inside onnxruntime as a 500 instead of a 400.
    path = _identity_4(tmp_path / "four.onnx")
    with pytest.raises(ConfigError) as caught:
        _onnx_model(path, inputs=[{"name": "x", "datatype": "FP32", "shape": [-1]}])
    assert caught.value.field == "models[0].inputs[0].shape"
    assert "[4]" in str(caught.value)


def test_onnx_bfloat16_tensor_is_refused_at_startup_not_on_every_request(tmp_path: Path) -> None:
    # onnxruntime's Python API neither takes nor returns bfloat16 arrays: every request
    # failed with a 500 ("Unexpected input data type" / "No corresponding Numpy type").
    from onnx import TensorProto, helper

    path = _save_onnx(
        tmp_path / "bf16.onnx",
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)],
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["batch", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
    )
    with pytest.raises(ConfigError) as caught:
        _onnx_model(path)
    assert "'x'" in str(caught.value) and "bfloat16" in str(caught.value)


def test_onnx_source_that_is_a_folder_is_not_said_to_be_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"models": [{"name": "m", "kind": "onnx", "source": str(tmp_path)}]})
    assert "does not exist" not in str(caught.value)
    assert "not a file" in str(caught.value)


# -- torch and python: what fails as the replicas start -----------------------------------

IO = (
    "    inputs: [{name: x, datatype: FP32, shape: [4]}]\n"
    "    outputs: [{name: y, datatype: FP32, shape: [4]}]\n"
)


def _serve(config: Path) -> Any:
    return CliRunner().invoke(app, ["serve", str(config), "--port", "0", "--grpc-port", "0"])


def _one_line(result: Any) -> str:
    ours = [line for line in result.output.splitlines() if line.startswith("carpool serve:")]
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert len(ours) == 1 and "Traceback" not in result.output, result.output
    return ours[0]


@pytest.mark.parametrize("kind", ["torch", "python"])
def test_a_model_factory_that_raises_exits_2_naming_the_models_key(
    kind: str, make_module: Callable[[str], str], tmp_path: Path
) -> None:
    # Triton fails the model's load with the reason; carpool printed a traceback, exit 1.
    name = make_module(
        """
        def build():
            raise RuntimeError("weights not found")

        def make(device):
            raise RuntimeError("weights not found")
        """
    )
    attr = "build" if kind == "torch" else "make"
    config = tmp_path / "serve.yaml"
    config.write_text(f"models:\n  - name: m\n    kind: {kind}\n    source: {name}:{attr}\n{IO}")
    line = _one_line(_serve(config))
    assert str(config) in line and "models[0].source" in line and "weights not found" in line


def test_a_torch_device_that_is_not_one_exits_2_naming_the_models_key(
    make_module: Callable[[str], str], tmp_path: Path
) -> None:
    name = make_module(
        """
        import torch

        def build():
            return torch.nn.Linear(4, 4)
        """
    )
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"models:\n  - name: m\n    kind: torch\n    source: {name}:build\n    device: gpu\n{IO}"
    )
    line = _one_line(_serve(config))
    assert "models[0].device='gpu'" in line


def test_a_cuda_device_torch_cannot_use_exits_2_naming_the_models_key(
    make_module: Callable[[str], str], tmp_path: Path
) -> None:
    import torch

    name = make_module(
        """
        import torch

        def build():
            return torch.nn.Linear(4, 4)
        """
    )
    device = f"cuda:{torch.cuda.device_count()}"  # one past the last: none on a CPU host
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"models:\n  - name: m\n    kind: torch\n    source: {name}:build\n"
        f"    device: '{device}'\n{IO}"
    )
    line = _one_line(_serve(config))
    assert f"models[0].device='{device}'" in line


def test_an_onnx_device_error_at_startup_names_the_models_key(tmp_path: Path) -> None:
    # The onnx runner raised ConfigError("device") as the replica started: the line said
    # "invalid device=..." without saying which model.
    _identity_4(tmp_path / "four.onnx")
    config = tmp_path / "serve.yaml"
    config.write_text(
        "models:\n  - name: a\n    kind: onnx\n    source: four.onnx\n"
        "  - name: b\n    kind: onnx\n    source: four.onnx\n    device: gpu\n"
    )
    assert load_config(config).models[1].device == "gpu"  # passes the config's own checks
    line = _one_line(_serve(config))
    assert "models[1].device='gpu'" in line


# -- metadata -------------------------------------------------------------------------------


def test_config_reports_gpu_replicas_as_triton_instance_groups(
    make_module: Callable[[str], str],
) -> None:
    # Every model said KIND_CPU, also one whose replicas the config placed on GPUs.
    name = make_module(
        """
        def same(inputs):
            return {"y": inputs["x"]}
        """
    )
    tensors = [{"name": "x", "datatype": "FP32", "shape": [4]}]
    config = parse_config(
        {
            "models": [
                {
                    "name": "m",
                    "kind": "python",
                    "source": f"{name}:same",
                    "inputs": tensors,
                    "outputs": [{**tensors[0], "name": "y"}],
                    "devices": ["cuda:0", "cuda:1", "cuda:1", "cpu"],
                }
            ]
        }
    )
    (model,) = build_repository(config)
    per_gpu: dict[int, int] = {}
    num_cpu = 0
    for group in model.config()["instance_group"]:
        if group["kind"] == "KIND_GPU":
            for gpu in group["gpus"]:  # Triton: count instances on each listed GPU
                per_gpu[gpu] = per_gpu.get(gpu, 0) + group["count"]
        else:
            assert group["kind"] == "KIND_CPU" and "gpus" not in group
            num_cpu += group["count"]
    assert (per_gpu, num_cpu) == ({0: 1, 1: 2}, 1)
