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
import inspect
import logging
import threading
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from carpool.core.dtypes import integers_fit
from carpool.core.layout import Packed
from carpool.core.replicas import BUILD_LOCK
from carpool.core.telemetry import MemoryProbe
from carpool.errors import ConfigError, ModelError
from carpool.models._source import build_with, import_ref, is_import_ref
from carpool.models.torch_cuda import CudaCopies, CudaGraphs, autocast_dtype

log = logging.getLogger("carpool.models.torch")


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
        ragged_inputs: Sequence[str] = (),
        autocast: bool = False,
        cuda_graphs: Sequence[int] | None = None,
    ) -> None:
        import torch

        self._torch = torch
        self.device = torch_device(device)
        self.dtype = getattr(torch, dtype) if dtype is not None else None
        self.input_names = list(input_names)
        _check_arity(module, self.input_names, set(ragged_inputs))
        self.output_names = list(output_names)
        self._output_dtypes = list(output_dtypes or [None] * len(self.output_names))
        with contextlib.suppress(NotImplementedError):  # torch.export modules refuse eval()
            module.eval()
        module = module.to(self.device)
        if self.dtype is not None:
            module = module.to(self.dtype)
        self.module = module
        # The GPU path (carpool.models.torch_cuda); on a CPU each option logs and stays off.
        self.autocast = autocast_dtype(autocast, self.device, self.dtype)
        self.precision = str(self.autocast or self.dtype or torch.float32).removeprefix("torch.")
        on_cuda = self.device.type == "cuda"
        self._copies = CudaCopies(self.device) if on_cuda else None
        self.graphs = None
        if cuda_graphs and (not on_cuda or ragged_inputs):
            log.warning("cuda_graphs: true needs a CUDA device and no ragged input; runs eagerly")
        elif cuda_graphs:
            self.graphs = CudaGraphs(module, cuda_graphs, self.device)

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
            if self.graphs is not None:
                result = self.graphs(args, self.autocast)
            elif self.autocast is not None:
                with torch.autocast(self.device.type, dtype=self.autocast):
                    result = self.module(*args)
            else:
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
        tensor = self._torch.from_numpy(np.ascontiguousarray(array))
        tensor = tensor.to(self.device) if self._copies is None else self._copies.to_device(tensor)
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return tensor

    def _array(self, tensor: Any, dtype: np.dtype[Any] | None) -> np.ndarray:
        tensor = tensor.detach().cpu()
        if tensor.dtype == self._torch.bfloat16:  # NumPy has no bfloat16
            tensor = tensor.float()
        array: np.ndarray = tensor.numpy()
        if dtype is None or not _casts_losslessly(array, dtype):
            return array  # the output check refuses it, naming both (500, not truncated)
        return array.astype(dtype, copy=False)


def _casts_losslessly(array: np.ndarray, declared: np.dtype[Any]) -> bool:
    """Whether the values of ``array`` keep their kind and value as ``declared``: floats
    never go to a declared integer or BOOL (1.5 became 1 on the wire, 0.3 became true),
    nor integers to one too narrow for them (3e9 became -1294967296 as INT32)."""
    have = array.dtype
    if declared.kind == "b":
        return have.kind == "b"
    if declared.kind in "iu":
        return have.kind in "iub" and integers_fit(array, declared)
    return True


def _check_arity(module: Any, input_names: list[str], ragged: set[str]) -> None:
    """The declared inputs against the positional parameters of ``module``'s forward, as
    Triton's PyTorch backend checks them at load: a mismatch would pass every request's
    checks and then fail each one inside the model with a 500. A forward whose parameters
    cannot be read (or that takes ``*args``) is taken as it comes.

    Raises:
        ConfigError: on field ``inputs``, naming the forward's parameters.
    """
    params = _forward_params(module)
    if params is None:
        return
    required, names = params
    given = len(input_names) + len(ragged & set(input_names))  # a ragged input: two args
    if required <= given <= len(names):
        return
    ragged_note = " (a ragged input counts as two: its data, then cu_seqlens)" if ragged else ""
    count = str(len(names)) if required == len(names) else f"{required} to {len(names)}"
    raise ConfigError(
        "inputs",
        input_names,
        f"{count} input(s), as the model's forward takes ({', '.join(names)}); the config "
        f"gives {given} argument(s){ragged_note}",
    )


def _forward_params(module: Any) -> tuple[int, list[str]] | None:
    """(how many are required, the names) of ``module.forward``'s positional parameters,
    or None when they cannot be told (``*args``, no readable signature). A decorated
    forward is read as the decorator's wrapper, which is what the call reaches: a wrapper
    made with ``functools.wraps`` may take other arguments than the function it wraps
    (one that supplies an argument itself, or ``*args``), so its ``__wrapped__`` is not
    followed."""
    schema = getattr(getattr(module, "forward", None), "schema", None)
    if schema is not None:  # TorchScript: a schema, no Python signature; [0] is self
        arguments = [a for a in schema.arguments[1:] if not a.kwarg_only]
        required = sum(1 for a in arguments if not a.has_default_value())
        return required, [a.name for a in arguments]
    try:
        signature = inspect.signature(module.forward, follow_wrapped=False)
    except (TypeError, ValueError, AttributeError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    parameters = list(signature.parameters.values())
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return None
    parameters = [p for p in parameters if p.kind in positional]
    required = sum(1 for p in parameters if p.default is inspect.Parameter.empty)
    return required, [p.name for p in parameters]


class _KeepRecords(logging.Filter):
    """Holds back the records of a logger (see :func:`load_module`)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


def _load_export(path: Path) -> Any:
    """``torch.export.load(path).module()``. On a file it cannot read, torch.export logs
    the first error with its traceback, then tries an older format and raises that
    attempt's error (``BadZipFile``); held back here, the first error becomes the reason,
    so that ``carpool serve`` says it in one line."""
    import torch

    logger = logging.getLogger("torch.export")
    kept = _KeepRecords()
    logger.addFilter(kept)
    try:
        program = torch.export.load(str(path))
    except Exception as error:
        first = next((r.exc_info[1] for r in kept.records if r.exc_info), None)
        if first is None:
            raise
        raise first from error
    finally:
        logger.removeFilter(kept)
        for record in kept.records:
            if not record.exc_info:  # a deprecation note on a file that loaded: let it out
                logger.handle(record)
    _check_batch_dim(program, path)
    return program.module()


def _check_batch_dim(program: Any, path: Path) -> None:
    """Refuse a program exported for one batch size: it would fail every batch of another
    size (a guard's AssertionError, a 500) depending on what a request was batched with.

    Raises:
        ConfigError: on field ``source``, naming the input and its size.
    """
    inputs = set(program.graph_signature.user_inputs)
    for node in program.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        shape = getattr(value, "shape", None)
        if node.name in inputs and shape is not None and len(shape) and isinstance(shape[0], int):
            raise ConfigError(
                "source",
                str(path),
                f"a program exported with a dynamic batch dimension (input {node.name!r} "
                f"takes batches of exactly {shape[0]}): export with dynamic_shapes="
                f"{{{node.name!r}: {{0: torch.export.Dim('batch')}}}}",
            )


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
    elif parsed.type != "cpu":  # mps, xpu, ...: a traceback at load, when not built in
        backend = getattr(torch, parsed.type, None)
        is_available = getattr(backend, "is_available", None)
        if not (callable(is_available) and is_available()):
            raise ConfigError(
                "device", device, f"cpu or cuda[:N]: this torch has no {parsed.type} device"
            )
    return parsed


def cuda_memory_probe(devices: Sequence[str]) -> MemoryProbe | None:
    """A ``Batcher`` memory probe for replicas on ``devices``; None unless one is CUDA."""
    indices = sorted({_cuda_index(device) for device in devices if device.startswith("cuda")})
    return CudaMemoryProbe(indices) if indices else None


def _cuda_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


class CudaMemoryProbe:
    """(bytes torch allocated on the GPUs ``indices`` at the most, their total memory).

    torch's allocator counts per GPU, not per model: this is the memory of every model of
    the process on those GPUs. Each GPU has one :class:`GpuMemorySampler`, shared by all
    the probes on it, so models on one GPU report the same figures and never cut each
    other's windows short."""

    def __init__(self, indices: Sequence[int]) -> None:
        self.indices = list(indices)
        self._samplers = [GpuMemorySampler.of(index) for index in self.indices]

    def __call__(self) -> tuple[int, int]:
        used = total = 0
        for sampler in self._samplers:
            peak_bytes, total_bytes = sampler.sample()
            used += peak_bytes
            total += total_bytes
        return used, total


class GpuMemorySampler:
    """One GPU's peak allocation, sampled at most every ``interval_s``.

    A batcher calls its probe after each batch; a sample is the most torch allocated on
    the GPU since the sample before (``max_memory_allocated``, then the peak is reset), so
    across samples the peak and the trough are the heaviest and the lightest stretch of
    batches. Reading the allocator's statistics builds a dict of some hundred entries, so
    between samples the last one is repeated. The first sample is what is allocated then:
    the peak before it counts model loading, not batches."""

    _by_index: ClassVar[dict[int, GpuMemorySampler]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, index: int, interval_s: float = 0.05) -> None:
        self.index = index
        self.interval_s = interval_s
        self._sampled_at_s: float | None = None
        self._sample = (0, 0)

    @classmethod
    def of(cls, index: int) -> GpuMemorySampler:
        """The process's sampler of GPU ``index``."""
        with cls._lock:
            sampler = cls._by_index.get(index)
            if sampler is None:
                sampler = cls._by_index[index] = cls(index)
            return sampler

    def sample(self) -> tuple[int, int]:
        """(peak bytes since the previous sample, the GPU's total bytes)."""
        import torch

        now = time.monotonic()
        with self._lock:
            if self._sampled_at_s is not None and now - self._sampled_at_s < self.interval_s:
                return self._sample
            cuda = torch.cuda
            if self._sampled_at_s is None:
                used = int(cuda.memory_allocated(self.index))
            else:
                used = int(cuda.max_memory_allocated(self.index))
            cuda.reset_peak_memory_stats(self.index)
            total = int(cuda.get_device_properties(self.index).total_memory)
            self._sampled_at_s, self._sample = now, (used, total)
            return self._sample


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
        with BUILD_LOCK:  # torch.export.load: one at a time, also outside a replica
            if path.suffix == ".pt2":
                return _load_export(path)
            return torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
    except ConfigError:
        raise
    except Exception as error:  # a corrupt or foreign file: say which and why
        what = "a torch.export .pt2" if path.suffix == ".pt2" else "a TorchScript"
        reason = _misnamed(path) or f"{type(error).__name__}: {str(error).split(_MINIZ_NOTE)[0]}"
        raise ConfigError("source", source, f"{what} file ({reason})") from error


# torch's advice after any zip reading error, that the file is likely corrupt: not so for a
# torch.save checkpoint, and long on one line.
_MINIZ_NOTE = " This is an internal miniz error."


def _misnamed(path: Path) -> str | None:
    """Why ``path`` is a torch zip of another kind than its suffix says (the suffix picks
    the loader), or None: a ``torch.save`` checkpoint (``data.pkl`` only), TorchScript
    (``constants.pkl``) in a .pt2, torch.export's archive (``archive_format``) in another."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = {name.rpartition("/")[2] for name in archive.namelist()}
    except (OSError, zipfile.BadZipFile):
        return None
    if "archive_format" in names:
        return None if path.suffix == ".pt2" else "it is a torch.export program: name it .pt2"
    if "constants.pkl" in names:  # in a .pt it is what its suffix says: not misnamed
        if path.suffix != ".pt2":
            return None
        return "it is a TorchScript file: name it .pt, only .pt2 is read as torch.export"
    if "data.pkl" in names:
        return (
            "it is a torch.save checkpoint (weights or a pickled module), which holds no "
            "model code: save torch.jit.script(model) with torch.jit.save, or a "
            "torch.export program with torch.export.save, or serve module:factory"
        )
    return None


def torch_factory(
    source: str,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dtype: str | None = None,
    output_dtypes: Sequence[np.dtype[Any] | None] | None = None,
    ragged_inputs: Sequence[str] = (),
    autocast: bool = False,
    cuda_graphs: Sequence[int] | None = None,
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
            ragged_inputs=ragged_inputs,
            autocast=autocast,
            cuda_graphs=cuda_graphs,
        )

    return make
