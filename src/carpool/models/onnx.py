"""ONNX models on onnxruntime: one ``InferenceSession`` per replica.

Inputs are fed by name, outputs returned by name. When the config leaves out the tensors,
:func:`read_specs` reads them from the model file: ONNX element types become KServe
datatypes, symbolic dimensions become ``-1``, and the first (batch) dimension is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from carpool.errors import ConfigError

# onnxruntime's type strings -> KServe v2 datatypes.
ONNX_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
    "tensor(bfloat16)": "BF16",
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor read from a model file: ``shape`` without the batch dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]


def _session(path: str, device: str = "cpu") -> Any:
    import onnxruntime as ort  # type: ignore[import-untyped]

    if device == "cpu":
        providers: list[Any] = ["CPUExecutionProvider"]
    elif device.startswith("cuda"):
        _, _, index = device.partition(":")
        providers = [("CUDAExecutionProvider", {"device_id": int(index or 0)})]
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ConfigError(
                "device", device, "cpu: this onnxruntime has no CUDAExecutionProvider"
            )
    else:
        raise ConfigError("device", device, "cpu or cuda[:N]")
    try:
        return ort.InferenceSession(path, providers=providers)
    except Exception as error:  # onnxruntime raises its own types for bad files
        raise ConfigError(
            "source", path, f"an ONNX model file ({type(error).__name__}: {error})"
        ) from error


def _info(node: Any, path: str) -> TensorInfo:
    datatype = ONNX_DATATYPES.get(node.type)
    if datatype is None:
        raise ConfigError("source", path, f"tensors of known types; {node.name!r} is {node.type}")
    dims = [d if isinstance(d, int) and d >= 0 else -1 for d in node.shape]
    if not dims or dims[0] != -1:
        raise ConfigError(
            "source",
            path,
            f"a dynamic first (batch) dimension on every tensor; {node.name!r} has shape "
            f"{list(node.shape)} (export with a dynamic batch axis)",
        )
    return TensorInfo(node.name, datatype, tuple(dims[1:]))


def read_specs(path: str) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """The inputs and outputs of the ONNX model at ``path``, batch dimension dropped.

    Raises:
        ConfigError: on field ``source`` for an unreadable model, an unknown element type
            or a fixed first dimension (the batch must be dynamic to batch).
    """
    session = _session(path)
    return (
        [_info(n, path) for n in session.get_inputs()],
        [_info(n, path) for n in session.get_outputs()],
    )


class OnnxRunner:
    """A batched callable: ``{input: array}`` in, ``{output: array}`` out."""

    def __init__(
        self,
        path: str,
        *,
        input_names: Sequence[str] | None = None,
        output_names: Sequence[str] | None = None,
        device: str = "cpu",
    ) -> None:
        self._session = _session(path, device)
        self.input_names = list(input_names or [n.name for n in self._session.get_inputs()])
        self.output_names = list(output_names or [n.name for n in self._session.get_outputs()])

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {name: inputs[name] for name in self.input_names}
        results = self._session.run(self.output_names, feed)
        return dict(zip(self.output_names, results, strict=True))


def onnx_factory(
    path: str,
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> Callable[[str], OnnxRunner]:
    """A per-replica factory for ``Batcher(fn_factory=...)``: one session per replica."""

    def make(device: str) -> OnnxRunner:
        return OnnxRunner(path, input_names=input_names, output_names=output_names, device=device)

    return make
