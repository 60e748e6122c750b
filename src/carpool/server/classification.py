"""Triton's classification extension: an output answered as its top classes.

A requested output whose parameters carry ``classification: k`` (REST; over gRPC an
``int64_param``; ``tritonclient``'s ``class_count``) comes back not as the model's tensor
but as a BYTES tensor of shape [batch, min(k, classes)]: per row its ``k`` largest values,
largest first, each as ``"<value>:<index>"``, or ``"<value>:<index>:<label>"`` when the
output has a label for that index (``label_filename`` in the model config)::

    OUTPUT0 row (FP32, shape [4]): [1.1, 3.3, 0.5, 2.4]      labels: cat, dog, emu, fox
    classification: 2          ->  ["3.300000:1:dog", "2.400000:3:fox"]

As Triton's server does it (``src/classification.cc``): every element of a row is a class,
indexed in row-major order, so an output of shape [N], [N, 1, 1] or [1, N] has N classes;
values are compared in the output's datatype; integers are written in decimal and floats
as C's ``%f`` (``std::to_string``); a ``k`` above the number of classes returns them all;
only the integer types, FP32 and FP64 can be classified; an empty label adds nothing.
Triton's sort leaves equal values in no set order: here the lower index comes first, and
NaN ranks below every number.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from carpool.errors import InvalidInput
from carpool.server.kserve.tensors import DATATYPES, OutputTensor, RequestedOutput

if TYPE_CHECKING:
    from carpool.server.repository import TensorSpec

__all__ = [
    "CLASSIFIABLE_DATATYPES",
    "class_count_of",
    "class_counts",
    "classified_outputs",
    "classify",
    "read_labels",
]

# The datatypes Triton's TopkClassifications takes; the others it refuses.
CLASSIFIABLE_DATATYPES = (
    "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"
)  # fmt: skip


def class_count_of(where: str, value: object, *, minimum: int = 1) -> int:
    """The number of classes a ``classification`` parameter asks for. Triton's REST
    endpoint reads 0 as the tensor itself (its default count; ``minimum=0``), its gRPC
    endpoint refuses it.

    Raises:
        InvalidInput: ``value`` is not an integer >= ``minimum``; ``where`` starts the
            message.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        tensor = " (0: the tensor itself)" if minimum == 0 else ""
        raise InvalidInput(
            f"{where}: parameters.classification={value!r} (tritonclient's class_count): "
            f"expected an integer >= {minimum}, the number of top classes to return{tensor}"
        )
    return value


def class_counts(
    requested: tuple[RequestedOutput, ...] | None, wanted: list[TensorSpec]
) -> dict[str, int] | None:
    """``{output name: classes asked for}`` of the outputs asked as classifications, None
    when there is none. ``wanted`` are the specs of ``requested``, in its order.

    Raises:
        InvalidInput: such an output's datatype cannot be classified.
    """
    if requested is None:
        return None
    counts: dict[str, int] | None = None
    for output, spec in zip(requested, wanted, strict=True):
        if not output.class_count:
            continue
        if spec.datatype not in CLASSIFIABLE_DATATYPES:
            raise InvalidInput(
                f"output {spec.name!r}: parameters.classification={output.class_count} asks "
                f"for its top classes, but its datatype {spec.datatype} cannot be classified; "
                f"expected an output of {', '.join(CLASSIFIABLE_DATATYPES)}, or ask for "
                "this output without class_count"
            )
        counts = counts or {}
        counts[spec.name] = output.class_count
    return counts


def classified_outputs(
    wanted: list[TensorSpec], result: dict[str, Any], counts: dict[str, int]
) -> list[OutputTensor]:
    """The outputs to encode: those named in ``counts`` as their top classes (BYTES), the
    others as the model returned them."""
    outputs = []
    for spec in wanted:
        count = counts.get(spec.name)
        if count is None:
            outputs.append(OutputTensor(spec.name, result[spec.name], spec.datatype))
        else:
            array = classify(result[spec.name], spec.datatype, count, spec.labels)
            outputs.append(OutputTensor(spec.name, array, "BYTES"))
    return outputs


def classify(
    array: npt.ArrayLike, datatype: str, count: int, labels: tuple[str, ...] = ()
) -> npt.NDArray[np.object_]:
    """The top ``count`` classes of each row (axis 0) of ``array``, read as ``datatype``:
    an object array of UTF-8 bytes ``b"<value>:<index>[:<label>]"`` of shape
    [rows, min(count, classes per row)]."""
    values = np.asarray(array, dtype=DATATYPES[datatype])
    num_rows = values.shape[0] if values.ndim else 1
    rows = values.reshape(num_rows, math.prod(values.shape[1:]))
    # Largest first, equal values by index: a stable ascending sort of keys that reverse
    # the order. Negating keeps NaN a NaN (sorted last); ~x reverses integers without
    # the overflow of -x at their minimum.
    keys = -rows if rows.dtype.kind == "f" else np.invert(rows)
    order = np.argsort(keys, axis=1, kind="stable")[:, :count]
    top = np.take_along_axis(rows, order, axis=1)
    is_float = rows.dtype.kind == "f"
    num_labels = len(labels)
    texts = []
    for value, index in zip(top.ravel().tolist(), order.ravel().tolist(), strict=True):
        # C's "%f" for floats (std::to_string), as Triton writes them; ints in decimal
        text = f"{value:f}:{index}" if is_float else f"{value}:{index}"
        label = labels[index] if index < num_labels else ""
        texts.append((f"{text}:{label}" if label else text).encode("utf-8"))
    classes = np.empty(order.shape, dtype=object)
    classes.reshape(-1)[:] = texts
    return classes


def read_labels(path: Path) -> tuple[str, ...]:
    """The labels of a label file: one per line, as Triton reads them (a final newline
    ends the last line; a line's trailing carriage return is dropped).

    Raises:
        OSError: the file cannot be read.
        UnicodeDecodeError: the file is not UTF-8.
    """
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    return tuple(line.removesuffix("\r") for line in lines)
