"""ONNX models on onnxruntime: one ``InferenceSession`` per replica.

Inputs are fed by name, outputs returned by name; BYTES inputs go in as text (UTF-8), as
onnxruntime takes string tensors. When the config leaves out the tensors, :func:`read_specs`
reads them from the model file: ONNX element types become KServe datatypes, symbolic
dimensions become ``-1``, and the first (batch) dimension is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from carpool.errors import ConfigError, InvalidInput

# onnxruntime's type strings -> KServe v2 datatypes. Not bfloat16: onnxruntime's Python API
# neither takes nor returns bfloat16 arrays (NumPy has no such dtype).
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
    elif re.fullmatch(r"cuda(:[0-9]+)?", device, re.ASCII):  # "cuda:x" was a ValueError
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


@dataclass(frozen=True, slots=True)
class FileTensor:
    """A tensor as onnxruntime reports it from a model file.

    ``type`` is onnxruntime's type string (``tensor(float)``, ``seq(tensor(float))``);
    ``shape`` is the full shape with ``-1`` for symbolic dims, and empty when the file
    gives none (onnxruntime reports an unknown rank as ``[]``).
    """

    name: str
    type: str
    shape: tuple[int, ...]

    @property
    def datatype(self) -> str | None:
        """The KServe datatype, or None for what carpool cannot carry (a sequence, a map,
        bfloat16)."""
        return ONNX_DATATYPES.get(self.type)

    def spec(self, path: str, *, is_output: bool = False) -> TensorInfo:
        """This tensor as served (batch dimension dropped); ``is_output`` adds to an
        error that declaring the outputs leaves this one out.

        Raises:
            ConfigError: on field ``source`` for a type carpool cannot carry or a first
                dimension that is not dynamic (the batch must be dynamic to batch).
        """
        hint = " (declare `outputs` to serve only the others)" if is_output else ""
        if self.datatype is None:
            raise ConfigError(
                "source",
                path,
                f"tensors onnxruntime takes and returns as NumPy arrays; {self.name!r} is "
                f"{self.type}{hint}",
            )
        if not self.shape or self.shape[0] != -1:
            raise ConfigError(
                "source",
                path,
                f"a dynamic first (batch) dimension on every tensor; {self.name!r} has shape "
                f"{list(self.shape)} (export with a dynamic batch axis){hint}",
            )
        return TensorInfo(self.name, self.datatype, self.shape[1:])


def _file_tensor(node: Any) -> FileTensor:
    dims = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in node.shape or ())
    return FileTensor(node.name, node.type, dims)


def read_tensors(path: str) -> tuple[list[FileTensor], list[FileTensor]]:
    """The inputs and outputs of the ONNX model at ``path`` as the file gives them.

    Raises:
        ConfigError: on field ``source`` for a file onnxruntime cannot load.
    """
    session = _session(path)
    return (
        [_file_tensor(n) for n in session.get_inputs()],
        [_file_tensor(n) for n in session.get_outputs()],
    )


def read_specs(path: str) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """The inputs and outputs of the ONNX model at ``path``, batch dimension dropped.

    Raises:
        ConfigError: on field ``source`` for an unreadable model, a tensor carpool cannot
            carry or a fixed first dimension (the batch must be dynamic to batch).
    """
    inputs, outputs = read_tensors(path)
    return [t.spec(path) for t in inputs], [t.spec(path, is_output=True) for t in outputs]


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
        self._text_inputs = {
            n.name for n in self._session.get_inputs() if n.type == "tensor(string)"
        }

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {
            name: _text(name, inputs[name]) if name in self._text_inputs else inputs[name]
            for name in self.input_names
        }
        results = self._session.run(self.output_names, feed)
        return dict(zip(self.output_names, results, strict=True))


def _text(name: str, array: np.ndarray) -> np.ndarray:
    """BYTES elements as str: onnxruntime feeds a str as its UTF-8 bytes but str()s
    anything else (``b'hi'`` would reach the model as the text "b'hi'")."""
    try:
        texts = [e.decode("utf-8") if isinstance(e, bytes) else e for e in array.ravel().tolist()]
    except UnicodeDecodeError:
        raise InvalidInput(
            f"input {name!r}: the model takes text; an element is not valid UTF-8"
        ) from None
    out = np.empty(len(texts), dtype=object)
    out[:] = texts
    return out.reshape(array.shape)


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
