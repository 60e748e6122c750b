"""Edges of how config model entries become served models (python, torch, onnx), found in
review: declared ONNX tensors the file contradicts, a missing declared output, a torch
model returning a dict. Each failed before its fix."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.config import parse_config
from carpool.errors import ConfigError
from carpool.server.builder import build_repository
from carpool.server.infer import InferCall, InferPlan, error_response, infer_response
from carpool.server.tensors import InferRequest, InputTensor


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


def _python_config(source: str, **extra: Any) -> Any:
    base = {
        "name": "m",
        "kind": "python",
        "source": source,
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1]}],
    }
    return parse_config({"models": [{**base, **extra}]})


def _request(x: np.ndarray) -> InferRequest:
    return InferRequest(None, (InputTensor("X", "FP32", x.shape, x),), None, {}, False)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "review_user_models.py").write_text(
        "import torch\n"
        "def wrong_name(inputs):\n"
        "    return {'Z': inputs['X']}\n"
        "class DictOut(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return {'Y': x * 2}\n"
        "def dict_out():\n"
        "    return DictOut()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "review_user_models"


def test_python_model_missing_a_declared_output_names_it(user_module: str) -> None:
    (model,) = build_repository(_python_config(f"{user_module}:wrong_name"))
    request = _request(np.ones((1, 3), np.float32))
    payload = model.payload(request)
    call = InferCall(None, payload, InferPlan(None, {}, list(model.outputs), set(), None))  # type: ignore[arg-type]
    try:
        status, body, _ = infer_response(model, call, _run(model, payload))
    except Exception as exc:
        status, body, _ = error_response(exc)
    assert status >= 500
    assert b"'Y'" in body and b"output" in body, body


def test_torch_model_returning_a_dict_maps_by_name_or_says_so(user_module: str) -> None:
    config = parse_config(
        {
            "models": [
                {
                    "name": "t",
                    "kind": "torch",
                    "source": f"{user_module}:dict_out",
                    "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1]}],
                    "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1]}],
                }
            ]
        }
    )
    (model,) = build_repository(config)
    try:
        out = _run(model, {"X": np.ones((2, 3), np.float32)})
    except Exception as exc:
        _, body, _ = error_response(exc)
        assert b"dict" in body and b"tensor" in body and b"detach" not in body, body
    else:
        np.testing.assert_array_equal(out["Y"], np.full((2, 3), 2.0, np.float32))


def test_declared_shape_mismatch_is_a_clear_400() -> None:
    (model,) = build_repository(
        _python_config("numpy:copy", inputs=[{"name": "X", "datatype": "FP32", "shape": [-1, 4]}])
    )
    with pytest.raises(Exception) as caught:
        model.payload(_request(np.ones((2, 5), np.float32)))
    status, body, _ = error_response(caught.value)
    assert status == 400
    assert b"'X'" in body and b"[2, 5]" in body and b"[-1, -1, 4]" in body, body
