"""PyTorch models: an ``nn.Module`` factory, a TorchScript file or a ``torch.export`` .pt2.

``source`` is one of:

- ``module:factory``: ``factory()`` returns an ``nn.Module`` (built on CPU, then moved);
- a ``.pt2`` file written by ``torch.export.save``, loaded with ``torch.export.load``;
- any other file: TorchScript (``torch.jit.save``), loaded with ``torch.jit.load``.

The model runs in eval mode under ``torch.inference_mode()`` on the replica's device, in
``dtype`` when given (floating inputs are cast to it). Inputs go in as positional arguments in
their declared order (a ragged input as two: its packed data, then ``cu_seqlens`` int32
[n + 1], both on the replica's device); the output (a tensor, or a tuple/list of them) maps
onto the declared output names in order, back on the CPU as NumPy arrays in the declared
dtypes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from carpool.core.layout import Packed
from carpool.errors import ConfigError, ModelError
from carpool.models._source import build_with, import_ref, is_import_ref

# Replicas load their copies on their own threads at once; torch.export.load keeps its
# deserializer in a module global and refuses a second concurrent load ("_CURRENT_DESERIALIZER
# is already set"), so file loads take turns.
_FILE_LOAD_LOCK = threading.Lock()


class TorchRunner:
    """A batched callable: ``{input: array}`` in, ``{output: array}`` out."""

    def __init__(
        self,
        module: Any,
        *,
        input_names: Sequence[str],
        output_names: Sequence[str],
        device: str = "cpu",
        dtype: str | None = None,
        output_dtypes: Sequence[np.dtype[Any] | None] | None = None,
    ) -> None:
        import torch

        self._torch = torch
        self.device = torch_device(device)
        self.dtype = getattr(torch, dtype) if dtype is not None else None
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self._output_dtypes = list(output_dtypes or [None] * len(self.output_names))
        with contextlib.suppress(NotImplementedError):  # torch.export modules refuse eval()
            module.eval()
        module = module.to(self.device)
        if self.dtype is not None:
            module = module.to(self.dtype)
        self.module = module

    def __call__(self, inputs: dict[str, Any]) -> dict[str, np.ndarray]:
        torch = self._torch
        with torch.inference_mode():
            args = []
            for name in self.input_names:
                value = inputs[name]
                if isinstance(value, Packed):  # a ragged input: data, then cu_seqlens
                    cu_seqlens = self._torch.from_numpy(value.cu_seqlens).to(self.device)
                    args += [self._tensor(value.data), cu_seqlens]
                else:
                    args.append(self._tensor(value))
            result = self.module(*args)
            if isinstance(result, dict):  # by the declared names
                missing = [name for name in self.output_names if name not in result]
                if missing:
                    raise ModelError(
                        f"the model returned a dict of {sorted(result)}; the config declares "
                        f"{self.output_names}"
                    )
                result = [result[name] for name in self.output_names]
            tensors = list(result) if isinstance(result, tuple | list) else [result]
            for tensor in tensors:
                if not isinstance(tensor, self._torch.Tensor):
                    raise ModelError(
                        f"the model returned a {type(tensor).__name__}; expected a tensor, a "
                        f"tuple of {len(self.output_names)} tensors or a dict by output name"
                    )
            if len(tensors) != len(self.output_names):
                raise ModelError(
                    f"the model returned {len(tensors)} outputs; the config declares "
                    f"{len(self.output_names)}: {self.output_names}"
                )
            return {
                name: self._array(t, dtype)
                for name, t, dtype in zip(
                    self.output_names, tensors, self._output_dtypes, strict=True
                )
            }

    def _tensor(self, array: np.ndarray) -> Any:
        tensor = self._torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return tensor

    def _array(self, tensor: Any, dtype: np.dtype[Any] | None) -> np.ndarray:
        tensor = tensor.detach().cpu()
        if tensor.dtype == self._torch.bfloat16:  # NumPy has no bfloat16
            tensor = tensor.float()
        array: np.ndarray = tensor.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)


def torch_device(device: str) -> Any:
    """``device`` as a ``torch.device`` this process can place a model on.

    Raises:
        ConfigError: on field ``device`` for a string torch does not read as a device, or
            a CUDA device this torch cannot reach (no CUDA, or past the last GPU).
    """
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise ConfigError(
            "device", device, f"a torch device such as cpu or cuda:0 ({error})"
        ) from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (parsed.index or 0) >= count:
            raise ConfigError(
                "device",
                device,
                f"cpu or cuda:0..cuda:{count - 1}" if count else "cpu: torch sees no CUDA device",
            )
    return parsed


def load_module(source: str, device: str = "cpu") -> Any:
    """The ``nn.Module`` that ``source`` names (see the module doc), on ``device``.

    Raises:
        ConfigError: on field ``source`` when it cannot be imported or loaded.
    """
    import torch

    if is_import_ref(source):
        factory = import_ref(source)
        if not callable(factory):
            raise ConfigError("source", source, "module:factory, a function returning nn.Module")
        module = build_with(source, factory)
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(
                "source", source, f"a factory returning nn.Module, not {type(module).__name__}"
            )
        return module
    path = Path(source)
    try:
        with _FILE_LOAD_LOCK:
            if path.suffix == ".pt2":
                return torch.export.load(str(path)).module()
            return torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
    except Exception as error:  # a corrupt or foreign file: say which and why
        what = "a torch.export .pt2" if path.suffix == ".pt2" else "a TorchScript"
        raise ConfigError(
            "source", source, f"{what} file ({type(error).__name__}: {error})"
        ) from error


def torch_factory(
    source: str,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dtype: str | None = None,
    output_dtypes: Sequence[np.dtype[Any] | None] | None = None,
) -> Callable[[str], TorchRunner]:
    """A per-replica factory for ``Batcher(fn_factory=...)``: each replica loads its own copy.

    A ``module:factory`` source is imported now, so a typo fails before serving starts.
    """
    if is_import_ref(source):
        import_ref(source)

    def make(device: str) -> TorchRunner:
        torch_device(device)  # before loading: a bad device is not a bad file
        return TorchRunner(
            load_module(source, device),
            input_names=input_names,
            output_names=output_names,
            device=device,
            dtype=dtype,
            output_dtypes=output_dtypes,
        )

    return make
