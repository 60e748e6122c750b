"""A served model's outputs checked against the ones it declares, once per batch.

The server answers with the declared outputs: their names, datatypes and shapes are what
``GET /v2/models/{m}`` tells clients, and each output is cast to its declared datatype on
the wire. A model that returns something else (an output missing, another shape, floats
where integers are declared) would be answered wrongly without a word: values truncated
by the cast, a shape that contradicts the metadata. As Triton's backends do ("unexpected
shape for output ..."), such a batch fails instead, with a message naming the output,
what was declared and what came; its requests get a 500 and the server goes on serving.

Checked per batch, not per request: one look at each output of the batch's result. This
is the one check of a model's outputs: the batcher's split only counts rows, and
``ServedModel.outputs_of`` and the KServe encoders trust what it let through. A served
batched model gets it from its builder (:func:`checking_outputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from typing import Any

import numpy as np

from carpool.core.collate import MalformedOutput
from carpool.core.dtypes import integers_fit
from carpool.core.layout import Packed
from carpool.core.replicas import is_async_callable
from carpool.core.stepwise import is_steps
from carpool.server.kserve.tensors import DATATYPES
from carpool.server.repository import TensorSpec

BatchFn = Callable[[Any], Any]

# Array kinds (numpy's dtype.kind) each declared datatype takes without losing values
# in the cast to the wire: integers into floats, bools into integers, not the reverse.
_FLOAT_KINDS = frozenset("fiub")
_KINDS: dict[str, frozenset[str]] = {
    "BOOL": frozenset("b"),
    "BYTES": frozenset("OSU"),
    **{f"UINT{bits}": frozenset("iub") for bits in (8, 16, 32, 64)},
    **{f"INT{bits}": frozenset("iub") for bits in (8, 16, 32, 64)},
    **{name: _FLOAT_KINDS for name in ("FP16", "FP32", "FP64", "BF16")},
}


class OutputMismatch(MalformedOutput):
    """The model's result does not match the outputs it declares: the whole batch fails
    (not bisected: the model would only run again on each half)."""


def checking_outputs(
    fn_factory: Callable[[str], BatchFn], outputs: tuple[TensorSpec, ...]
) -> Callable[[str], BatchFn]:
    """``fn_factory`` whose batch functions check their result against ``outputs``."""

    def make(device: str) -> BatchFn:
        fn = fn_factory(device)
        if is_async_callable(fn):

            async def checked_async(inputs: Any) -> Any:
                return check_outputs(await fn(inputs), outputs)

            return checked_async

        def checked(inputs: Any) -> Any:
            result = fn(inputs)
            if is_steps(result):  # a model in steps: checked when its last one returns
                return _checked_steps(result, outputs)
            return check_outputs(result, outputs)

        return checked

    return make


def _checked_steps(steps: Generator[Any, None, Any], outputs: tuple[TensorSpec, ...]) -> Any:
    result = yield from steps
    return check_outputs(result, outputs)


def check_outputs(result: Any, outputs: tuple[TensorSpec, ...]) -> Any:
    """``result`` unchanged when it carries every declared output in its declared shape
    (batch dimension first) and a datatype that casts to the declared one losslessly in
    kind.

    Raises:
        OutputMismatch: naming the output, what was declared and what the model returned.
    """
    if not isinstance(result, Mapping):
        raise OutputMismatch(
            f"the model returned {type(result).__name__}; expected a dict of its outputs "
            f"{[spec.name for spec in outputs]}, each an array with the batch along axis 0"
        )
    for spec in outputs:
        try:
            value = result[spec.name]
        except KeyError:
            raise OutputMismatch(
                f"the model returned no output {spec.name!r} (it returned "
                f"{sorted(map(str, result))}); it declares {[s.name for s in outputs]}"
            ) from None
        if isinstance(value, list | tuple):  # one output per row, stacked per request
            for row in value:
                if getattr(row, "shape", None) is not None:  # str and bytes rows: BYTES
                    _check_array(spec, spec, row, (1, *row.shape), " (one row of a list)")
            continue
        if isinstance(value, Packed):  # ragged rows: the data is (tokens, *trailing)
            value, declared, note = value.data, _packed_spec(spec), _PACKED
        else:
            declared, note = spec, ""
        shape = getattr(value, "shape", None)
        if shape is None:
            raise OutputMismatch(
                f"output {spec.name!r}: the model returned {type(value).__name__}; expected "
                f"an array of shape {[-1, *spec.shape]}, or a list of one row per item"
            )
        _check_array(spec, declared, value, tuple(shape), note)
    return result


_PACKED = " (packed: all rows' items along axis 0)"


def _check_array(
    spec: TensorSpec, declared: TensorSpec, value: Any, shape: tuple[int, ...], note: str
) -> None:
    if not declared.accepts(shape):
        raise OutputMismatch(
            f"output {spec.name!r}: the model returned shape {list(shape)}{note}, "
            f"declared {[-1, *spec.shape]} (-1: any size; the first dimension is the batch)"
        )
    _check_kind(spec, value)


def _packed_spec(spec: TensorSpec) -> TensorSpec:
    """What a packed output's data must fit: the declared dims after the ragged one."""
    return TensorSpec(spec.name, spec.datatype, spec.shape[1:])


def _check_kind(spec: TensorSpec, value: Any) -> None:
    dtype: Any = getattr(value, "dtype", None)
    kind = getattr(dtype, "kind", None)  # a NumPy dtype; a torch tensor's has none
    if not isinstance(kind, str):
        return
    if getattr(dtype, "name", None) == "bfloat16":  # ml_dtypes' kind is "V": a float
        kind = "f"
    if kind not in _KINDS.get(spec.datatype, frozenset(kind)):
        raise OutputMismatch(
            f"output {spec.name!r}: the model returned {dtype}, which the declared "
            f"{spec.datatype} cannot carry without losing values; return "
            f"{_RETURN[spec.datatype]} or declare the output's datatype as it is"
        )
    declared = DATATYPES.get(spec.datatype)
    if (
        declared is not None
        and declared.kind in "iu"
        and kind in "iu"
        and isinstance(value, np.ndarray)
        and not integers_fit(value, declared)
    ):
        raise OutputMismatch(
            f"output {spec.name!r}: the model returned {dtype} values from {value.min()} "
            f"to {value.max()}, which the declared {spec.datatype} cannot hold (they would "
            "wrap on the wire); return values in its range or declare a wider datatype"
        )


_RETURN = {
    "BOOL": "booleans",
    "BYTES": "bytes or str objects",
    **{name: "integers" for name in _KINDS if "INT" in name},
    **{name: "numbers" for name in ("FP16", "FP32", "FP64", "BF16")},
}
