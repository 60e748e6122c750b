"""The Python, torch and ONNX runners, each against a reference computed another way
(ONNX also against onnxruntime run directly, and served from a config entry), what a
model that fails as its replicas start prints, and what a served model reports."""

from __future__ import annotations

import asyncio
import importlib
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from carpool.cli import app
from carpool.config import load_config, parse_config
from carpool.errors import ConfigError, ModelError
from carpool.models.onnx import OnnxRunner, TensorInfo, onnx_factory, read_specs
from carpool.models.python import is_factory, load_python
from carpool.models.torch import TorchRunner, load_module, torch_factory
from carpool.server.builder import build_repository
from carpool.server.repository import ServedModel

X = np.arange(12, dtype=np.float32).reshape(3, 4)

# -- python -------------------------------------------------------------------------------


def test_python_callable_is_shared_by_every_replica(make_module: Callable[[str], str]) -> None:
    name = make_module(
        """
        def double(inputs):
            return {"OUTPUT0": inputs["INPUT0"] * 2}
        """
    )
    factory = load_python(f"{name}:double")
    fn = factory("cpu")
    assert fn is factory("cuda:1")
    np.testing.assert_array_equal(fn({"INPUT0": X})["OUTPUT0"], X * 2)


def test_python_factory_taking_device_is_called_per_replica(
    make_module: Callable[[str], str],
) -> None:
    name = make_module(
        """
        class Scaler:
            def __init__(self, device):
                self.device = device

            def __call__(self, inputs):
                return {"OUTPUT0": inputs["INPUT0"] + 1}
        """
    )
    factory = load_python(f"{name}:Scaler")
    first, second = factory("cpu"), factory("cuda:0")
    assert (first.device, second.device) == ("cpu", "cuda:0")  # type: ignore[attr-defined]
    np.testing.assert_array_equal(first({"INPUT0": X})["OUTPUT0"], X + 1)


def test_factory_rule_is_one_parameter_named_device() -> None:
    def factory(device: str) -> None: ...
    def fn(inputs: object) -> None: ...
    def two(device: str, other: int) -> None: ...

    assert is_factory(factory)
    assert not is_factory(fn)
    assert not is_factory(two)
    assert not is_factory(len)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("carpool_no_such_module:f", "ModuleNotFoundError"),
        ("numpy:no_such_name", "'no_such_name' defined in module 'numpy'"),
        ("numpy:pi", "a callable"),
    ],
)
def test_python_source_errors_name_the_reason(source: str, reason: str) -> None:
    with pytest.raises(ConfigError, match="source") as caught:
        load_python(source)
    assert reason in str(caught.value)


# -- torch --------------------------------------------------------------------------------

TORCH_MODULE = """
    import torch
    from torch import nn


    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = nn.Linear(4, 3)
            self.dropout = nn.Dropout(0.5)  # a no-op only in eval mode

        def forward(self, x, y):
            h = self.dropout(self.linear(x))
            return h + y, h.sum(dim=1)


    def build():
        return TwoHeads()
    """


# carpool loads a TorchScript file when a config names one; torch warns that it is deprecated.
JIT_LOAD_IS_DEPRECATED = pytest.mark.filterwarnings(
    "ignore:`torch.jit.load` is deprecated:DeprecationWarning"
)


def _reference(name: str, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    import torch

    module = importlib.import_module(name).build().eval()
    with torch.inference_mode():
        first, second = module(torch.from_numpy(X), torch.from_numpy(y))
    return first.numpy(), second.numpy()


def _check_two_heads(runner: TorchRunner, name: str) -> None:
    y = np.ones((3, 3), dtype=np.float32)
    out = runner({"x": X, "y": y})
    first, second = _reference(name, y)
    assert set(out) == {"sum", "total"}
    np.testing.assert_allclose(out["sum"], first, rtol=1e-6)
    np.testing.assert_allclose(out["total"], second, rtol=1e-6)


def test_torch_runner_from_module_factory(make_module: Callable[[str], str]) -> None:
    name = make_module(TORCH_MODULE)
    factory = torch_factory(f"{name}:build", input_names=["x", "y"], output_names=["sum", "total"])
    _check_two_heads(factory("cpu"), name)


@JIT_LOAD_IS_DEPRECATED
def test_torch_runner_from_torchscript_file(
    make_module: Callable[[str], str], tmp_path: Path
) -> None:
    import torch

    name = make_module(TORCH_MODULE)
    path = tmp_path / "two_heads.pt"
    with warnings.catch_warnings():  # TorchScript is deprecated; writing one is test setup
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(importlib.import_module(name).build().eval()), str(path))
    factory = torch_factory(str(path), input_names=["x", "y"], output_names=["sum", "total"])
    _check_two_heads(factory("cpu"), name)


def _two_heads_pt2(make_module: Callable[[str], str], tmp_path: Path) -> tuple[str, Any]:
    """(module name, factory) of TORCH_MODULE saved as a torch.export .pt2 file."""
    import torch

    name = make_module(TORCH_MODULE)
    batch = torch.export.Dim("batch")
    exported = torch.export.export(
        importlib.import_module(name).build().eval(),
        (torch.from_numpy(X), torch.ones(3, 3)),
        dynamic_shapes=({0: batch}, {0: batch}),
    )
    path = tmp_path / "two_heads.pt2"
    torch.export.save(exported, str(path))
    return name, torch_factory(str(path), input_names=["x", "y"], output_names=["sum", "total"])


def test_torch_runner_from_torch_export_file(
    make_module: Callable[[str], str], tmp_path: Path
) -> None:
    name, factory = _two_heads_pt2(make_module, tmp_path)
    _check_two_heads(factory("cpu"), name)


def test_a_torch_export_file_of_one_batch_size_is_refused_naming_the_input(
    make_module: Callable[[str], str], tmp_path: Path
) -> None:
    """Was: loaded, then a batch of any other size failed (a guard's AssertionError, 500),
    so a request succeeded or failed by what it was batched with."""
    import torch

    name = make_module(TORCH_MODULE)
    exported = torch.export.export(
        importlib.import_module(name).build().eval(), (torch.from_numpy(X), torch.ones(3, 3))
    )
    path = tmp_path / "fixed_batch.pt2"
    torch.export.save(exported, str(path))
    factory = torch_factory(str(path), input_names=["x", "y"], output_names=["sum", "total"])
    with pytest.raises(ConfigError, match=r"input 'x' takes batches of exactly 3"):
        factory("cpu")


def test_torch_export_file_loads_on_several_replica_threads_at_once(
    make_module: Callable[[str], str], tmp_path: Path
) -> None:
    # docs/server.md: a .pt2 source with `devices: [cuda:0, cuda:1]` loads one copy per
    # replica, each on its own thread at the same time.
    import threading

    name, factory = _two_heads_pt2(make_module, tmp_path)
    num_replicas = 4
    start = threading.Barrier(num_replicas)
    runners: list[TorchRunner] = []
    errors: list[BaseException] = []

    def load() -> None:
        start.wait()
        try:
            runners.append(factory("cpu"))
        except BaseException as error:  # collected: a thread's exception is otherwise lost
            errors.append(error)

    for _ in range(3):
        threads = [threading.Thread(target=load) for _ in range(num_replicas)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []
    for runner in runners:
        _check_two_heads(runner, name)


@pytest.mark.parametrize("kind", ["torch", "python", "library"])
async def test_a_seeded_factory_builds_the_same_weights_in_every_replica(kind: str) -> None:
    # carpool.models.mlp's factories seed torch's global RNG, then draw W1's weights from
    # it. A model's replicas build their copies on their own threads: built at once, they
    # interleaved their draws and got other weights than the seed's. The three ways in:
    # a config's torch module:factory, a config's python factory, and a factory given to
    # Batcher directly (the library, carpool tune).
    import torch

    from carpool import Batcher
    from carpool.models.mlp import build_w1, make_w1

    want = build_w1().state_dict()
    inner: Callable[[str], Any]
    if kind == "torch":
        inner = torch_factory(
            "carpool.models.mlp:build_w1", input_names=["INPUT0"], output_names=["OUTPUT0"]
        )
    elif kind == "python":
        inner = load_python("carpool.models.mlp:make_w1")
    else:
        inner = make_w1
    built: list[Any] = []

    def factory(device: str) -> Any:
        model = inner(device)
        built.append(model.module if kind == "torch" else model.model)
        return model

    batcher = Batcher(fn_factory=factory, num_replicas=4, executor="thread")
    async with batcher:
        assert len(built) == 4
    for module in built:
        got = module.state_dict()
        assert all(torch.equal(got[key], want[key]) for key in want)


def test_torch_runner_casts_to_dtype_and_back_to_declared_outputs(
    make_module: Callable[[str], str],
) -> None:
    name = make_module(TORCH_MODULE)
    runner = TorchRunner(
        load_module(f"{name}:build"),
        input_names=["x", "y"],
        output_names=["sum", "total"],
        dtype="float64",
        output_dtypes=[np.dtype(np.float32), None],
    )
    out = runner({"x": X, "y": np.ones((3, 3), dtype=np.float32)})
    assert (out["sum"].dtype, out["total"].dtype) == (np.float32, np.float64)


def test_torch_runner_leaves_floats_for_a_declared_integer_or_bool_to_the_output_check(
    make_module: Callable[[str], str],
) -> None:
    """Was: cast to the declared dtype first (1.5 became 1, 0.3 became true), so the output
    check that refuses it for every other kind (500, docs/server.md) never saw the floats.
    Integers for a declared float, or a narrower integer, are still cast."""
    from carpool.server.outputs import OutputMismatch, check_outputs
    from carpool.server.repository import TensorSpec

    name = make_module(TORCH_MODULE)
    out = TorchRunner(
        load_module(f"{name}:build"),
        input_names=["x", "y"],
        output_names=["sum", "total"],
        output_dtypes=[np.dtype(np.int64), np.dtype(np.bool_)],
    )({"x": X, "y": np.full((3, 3), 0.5, dtype=np.float32)})
    assert out["sum"].dtype.kind == "f" and out["total"].dtype.kind == "f"
    specs = (TensorSpec("sum", "INT64", (3,)), TensorSpec("total", "BOOL", ()))
    with pytest.raises(OutputMismatch, match="cannot carry without losing values"):
        check_outputs(out, specs)


def test_torch_runner_leaves_integers_too_wide_for_the_declared_type_to_the_output_check(
    make_module: Callable[[str], str],
) -> None:
    """Was: cast to the declared INT32 first, so 3e9 went out as -1294967296."""
    from carpool.server.outputs import OutputMismatch, check_outputs
    from carpool.server.repository import TensorSpec

    name = make_module(
        """
        import torch


        class Billions(torch.nn.Module):
            def forward(self, x):
                return x.to(torch.int64) * 1_000_000_000


        def build():
            return Billions().eval()
        """
    )
    runner = TorchRunner(
        load_module(f"{name}:build"),
        input_names=["x"],
        output_names=["y"],
        output_dtypes=[np.dtype(np.int32)],
    )
    out = runner({"x": np.array([[1, 3]], dtype=np.int64)})
    assert out["y"].tolist() == [[1_000_000_000, 3_000_000_000]]  # not wrapped
    with pytest.raises(OutputMismatch, match="cannot hold"):
        check_outputs(out, (TensorSpec("y", "INT32", (2,)),))
    small = runner({"x": np.array([[1, 2]], dtype=np.int64)})
    assert small["y"].dtype == np.int32  # values that fit are still cast


def test_torch_runner_rejects_a_wrong_number_of_outputs(
    make_module: Callable[[str], str],
) -> None:
    from carpool.errors import ModelError

    name = make_module(TORCH_MODULE)
    runner = torch_factory(f"{name}:build", input_names=["x", "y"], output_names=["only"])("cpu")
    with pytest.raises(ModelError, match="returned 2 outputs"):
        runner({"x": X, "y": np.ones((3, 3), dtype=np.float32)})


DICT_OUT = """
import torch


class DictOut(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.name = name

    def forward(self, x):
        return {self.name: x * 2}


def dict_out():
    return DictOut("Y")


def other_names():
    return DictOut("Z")
"""


@pytest.fixture
def user_module(make_module: Callable[[str], str]) -> str:
    """A module of torch models that return a dict: ``dict_out`` by the declared name."""
    return make_module(DICT_OUT)


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
    out = _run(model, {"X": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(out["Y"], np.full((2, 3), 2.0, np.float32))
    factory = torch_factory(f"{user_module}:other_names", input_names=["X"], output_names=["Y"])
    runner = factory("cpu")
    with pytest.raises(ModelError, match=r"a dict of \['Z'\]; the config declares \['Y'\]"):
        runner({"X": np.ones((2, 3), np.float32)})


@JIT_LOAD_IS_DEPRECATED
def test_torch_source_errors_name_the_reason(
    make_module: Callable[[str], str], tmp_path: Path
) -> None:
    name = make_module("def build():\n    return 42\n")
    with pytest.raises(ConfigError, match=r"returning nn\.Module, not int"):
        load_module(f"{name}:build")
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="TorchScript"):
        load_module(str(broken))


# -- onnx ---------------------------------------------------------------------------------

W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
B = np.array([0.5, -1.0, 2.0], dtype=np.float32)


def write_affine_onnx(path: Path, *, batch_dim: str | int = "batch") -> Path:
    """``Y = X @ W + B`` with X ``[batch, 4]`` float32 and Y ``[batch, 3]``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("Add", ["XW", "B"], ["Y"]),
        ],
        "affine",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [batch_dim, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [batch_dim, 3])],
        initializer=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_onnx_runner_matches_numpy(tmp_path: Path) -> None:
    path = write_affine_onnx(tmp_path / "affine.onnx")
    runner = onnx_factory(str(path), input_names=["X"], output_names=["Y"])("cpu")
    np.testing.assert_allclose(runner({"X": X})["Y"], X @ W + B, rtol=1e-6)


def test_onnx_runner_reads_names_from_the_file(tmp_path: Path) -> None:
    runner = OnnxRunner(str(write_affine_onnx(tmp_path / "affine.onnx")))
    assert (runner.input_names, runner.output_names) == (["X"], ["Y"])


def test_onnx_specs_are_read_from_the_file_without_the_batch_dim(tmp_path: Path) -> None:
    inputs, outputs = read_specs(str(write_affine_onnx(tmp_path / "affine.onnx")))
    assert inputs == [TensorInfo("X", "FP32", (4,))]
    assert outputs == [TensorInfo("Y", "FP32", (3,))]


def test_onnx_fixed_batch_dim_is_refused(tmp_path: Path) -> None:
    path = write_affine_onnx(tmp_path / "fixed.onnx", batch_dim=1)
    with pytest.raises(ConfigError, match="dynamic first"):
        read_specs(str(path))


def test_onnx_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="an ONNX model file"):
        read_specs(str(path))


# -- onnx, served from a config entry ---------------------------------------------------


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


# -- what fails as the replicas start: one line naming the model's key, exit 2 -------------


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


@pytest.mark.parametrize(
    ("kind", "executor"), [("torch", None), ("python", None), ("python", "process")]
)
def test_a_model_factory_that_raises_exits_2_naming_the_models_key(
    kind: str, executor: str | None, make_module: Callable[[str], str], tmp_path: Path
) -> None:
    # Triton fails the model's load with the reason; carpool printed a traceback, exit 1
    # (in a process replica still so, until the child sent the ConfigError itself).
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
    extra = f"    executor: {executor}\n" if executor else ""
    config.write_text(
        f"models:\n  - name: m\n    kind: {kind}\n    source: {name}:{attr}\n{IO}{extra}"
    )
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


@JIT_LOAD_IS_DEPRECATED
@pytest.mark.parametrize("device", ["mps", "xpu"])
def test_an_accelerator_this_torch_lacks_exits_2_naming_the_models_key(
    make_module: Callable[[str], str], tmp_path: Path, device: str
) -> None:
    """Was: a traceback (torch's RuntimeError or AssertionError when the module moved)
    and exit 1; with a TorchScript .pt, a message blaming the file's name."""
    import torch

    if getattr(getattr(torch, device, None), "is_available", lambda: False)():
        pytest.skip(f"this torch has a {device} device: the config is valid here")
    name = make_module(
        """
        import torch

        def build():
            return torch.nn.Linear(4, 4)
        """
    )
    scripted = tmp_path / "linear.pt"
    with warnings.catch_warnings():  # TorchScript is deprecated; writing one is test setup
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(torch.nn.Linear(4, 4)), str(scripted))
    for source in (f"{name}:build", str(scripted)):
        config = tmp_path / "serve.yaml"
        config.write_text(
            f"models:\n  - name: m\n    kind: torch\n    source: {source}\n"
            f"    device: {device}\n{IO}"
        )
        line = _one_line(_serve(config))
        assert f"models[0].device='{device}'" in line and f"no {device} device" in line


def test_an_onnx_cuda_device_with_a_bad_index_exits_2_naming_the_models_key(
    tmp_path: Path,
) -> None:
    """Was: int("x") raised ValueError, a traceback and exit 1."""
    from carpool.models.onnx import _session

    with pytest.raises(ConfigError, match=r"invalid device='cuda:x': expected cpu or cuda\[:N\]"):
        _session(str(tmp_path / "unused.onnx"), "cuda:x")


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
    # Model a had started: it is stopped again, its replica thread gone.
    assert [t.name for t in threading.enumerate() if t.name.startswith("carpool-a-")] == []


# -- what a served model reports -------------------------------------------------------------


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


@pytest.mark.parametrize(("rows", "num_steps"), [(1, 3), (5, 12)])
def test_w1_in_steps_equals_w1_in_one_call(rows: int, num_steps: int) -> None:
    """The built-in ``mlp`` model runs W1 in steps (the loop reads requests between
    them): a step per large layer, each in quarters from W1_SLICED_ROWS rows on; the
    steps compute exactly what the module does."""
    import torch

    from carpool.core.stepwise import is_steps, run_to_end
    from carpool.models.mlp import W1Runner
    from carpool.server.defaults import w1_factory

    x = np.random.default_rng(0).standard_normal((rows, 256), dtype=np.float32)
    runner = W1Runner()
    with torch.inference_mode():
        want = runner.model(torch.from_numpy(x)).numpy()
    steps = w1_factory("cpu")({"INPUT0": x})
    assert is_steps(steps)
    np.testing.assert_array_equal(run_to_end(steps)["OUTPUT0"], want)
    np.testing.assert_array_equal(runner(x), want)
    assert sum(1 for _ in runner.steps(x)) == num_steps  # the yields
