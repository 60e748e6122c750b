"""The Python, torch and ONNX runners, each against a reference computed another way."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.errors import ConfigError
from carpool.models.onnx import OnnxRunner, TensorInfo, onnx_factory, read_specs
from carpool.models.python import is_factory, load_python
from carpool.models.torch import TorchRunner, load_module, torch_factory

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


def test_torch_runner_rejects_a_wrong_number_of_outputs(
    make_module: Callable[[str], str],
) -> None:
    from carpool.errors import ModelError

    name = make_module(TORCH_MODULE)
    runner = torch_factory(f"{name}:build", input_names=["x", "y"], output_names=["only"])("cpu")
    with pytest.raises(ModelError, match="returned 2 outputs"):
        runner({"x": X, "y": np.ones((3, 3), dtype=np.float32)})


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
