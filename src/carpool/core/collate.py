"""How payloads become one batch and how the model's outputs go back to each request.

A request carries one item (``submit``) or k items along axis 0 (``submit_many``).
``collate`` joins the payloads of a batch along axis 0; ``split`` cuts the outputs back::

    requests   r0 (1 item)   r1 (3 items)      r2 (1 item)
    batch      [ x0 | y0 y1 y2 | z0 ]          5 rows along axis 0
    outputs    [ o0 | o1 o2 o3 | o4 ]          must also have 5 rows
    results    o0    [o1 o2 o3]    o4          one item → its row; k items → k rows

Outputs may be one array-like (NumPy array, torch tensor, list), a tuple of them
(several outputs, each split the same way), or a dict of them (split per key).
torch is imported only when a torch payload is actually seen.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from carpool.core.layout import Packed, Padded
from carpool.errors import ConfigError, InvalidInput


class MalformedOutput(Exception):
    """The model's result for a whole call is malformed (a count, a shape, a type that
    contradicts what it must return): every request of the call fails with it, rather
    than the call being bisected to run the model again on each half."""


class OutputCountMismatch(MalformedOutput):
    """The model returned a number of outputs different from the number of items."""

    def __init__(self, expected: int, got: int, where: str = "", kind: str = "") -> None:
        self.expected = expected
        self.got = got
        at = f" in output {where!r}" if where else ""
        came = f"{got} outputs" if got >= 0 else f"a {kind} with no length along axis 0"
        super().__init__(
            f"the model returned {came}{at} for a batch of {expected} items; a batched "
            "model must return one output per input item, aligned along axis 0"
        )


class Collator(Protocol):
    """Joins payloads into a batch and splits outputs back (see the module docstring)."""

    def signature(self, payload: Any, is_many: bool) -> Hashable:
        """What must match for two payloads to share a batch (dtype, trailing shape)."""
        ...

    def num_items(self, payload: Any) -> int:
        """How many items a ``submit_many`` payload carries along axis 0."""
        ...

    def collate(self, payloads: list[Any], is_many: list[bool]) -> Any: ...

    def split(self, outputs: Any, counts: list[int], is_many: list[bool]) -> list[Any]: ...


class ListCollator:
    """A batch is a plain list of items; outputs are any sequence aligned with it."""

    def signature(self, payload: Any, is_many: bool) -> Hashable:
        return None

    def num_items(self, payload: Any) -> int:
        return len(payload)

    def collate(self, payloads: list[Any], is_many: list[bool]) -> Any:
        return list(flatten(payloads, is_many))

    def split(self, outputs: Any, counts: list[int], is_many: list[bool]) -> list[Any]:
        return split_outputs(outputs, counts, is_many)


class NumpyCollator:
    """Stacks items into one ``numpy.ndarray`` along a new (or, for many, the first) axis."""

    def signature(self, payload: Any, is_many: bool) -> Hashable:
        array = payload if type(payload) is np.ndarray else np.asarray(payload)
        return (array.dtype, array.shape[1:] if is_many else array.shape)

    def num_items(self, payload: Any) -> int:
        return int(np.shape(payload)[0])

    def collate(self, payloads: list[Any], is_many: list[bool]) -> Any:
        if not any(is_many):
            return np.stack(payloads)
        parts = [
            np.asarray(p) if m else np.asarray(p)[None]
            for p, m in zip(payloads, is_many, strict=True)
        ]
        return np.concatenate(parts)

    def split(self, outputs: Any, counts: list[int], is_many: list[bool]) -> list[Any]:
        return split_outputs(outputs, counts, is_many)


class TorchCollator:
    """Stacks ``torch.Tensor`` items; torch is imported on first use only."""

    def signature(self, payload: Any, is_many: bool) -> Hashable:
        torch = sys.modules.get("torch")  # a tensor was made with torch: it is imported
        if torch is None or not isinstance(payload, torch.Tensor):
            # Refused here, at submit: a NumPy array has a shape and a dtype too, and
            # failed only in torch.stack, reported as the model's error.
            raise TypeError(f"collate='torch' takes torch.Tensor items, got {type(payload)}")
        shape = tuple(payload.shape[1:] if is_many else payload.shape)
        return (str(payload.dtype), shape, str(payload.device))

    def num_items(self, payload: Any) -> int:
        return int(payload.shape[0])

    def collate(self, payloads: list[Any], is_many: list[bool]) -> Any:
        import torch

        if not any(is_many):
            return torch.stack(payloads)
        return torch.cat(
            [p if m else p.unsqueeze(0) for p, m in zip(payloads, is_many, strict=True)]
        )

    def split(self, outputs: Any, counts: list[int], is_many: list[bool]) -> list[Any]:
        return split_outputs(outputs, counts, is_many)


class DictCollator:
    """Named NumPy inputs (``{name: array}``), each concatenated along axis 0.

    A request's payload carries k rows in every input (k from the first input); the model
    receives ``{name: concatenated array}`` and may return a dict, tuple or array.
    """

    def signature(self, payload: Any, is_many: bool) -> Hashable:
        if len(payload) == 1:  # the common case, without a sort or a generator
            ((name, array),) = payload.items()
            return ((name, array.dtype, array.shape[1:] if is_many else array.shape),)
        return tuple(
            (name, array.dtype, array.shape[1:] if is_many else array.shape)
            for name, array in sorted(payload.items())
        )

    def num_items(self, payload: Any) -> int:
        if len(payload) == 1:
            (array,) = payload.values()
            shape = getattr(array, "shape", None)  # np.shape() is a Python-level call
            return int((shape if shape is not None else np.shape(array))[0])
        return shared_rows(payload)

    def collate(self, payloads: list[Any], is_many: list[bool]) -> Any:
        names = payloads[0].keys()
        if len(payloads) == 1 and is_many[0]:
            return dict(payloads[0])
        return {
            name: np.concatenate(
                [
                    p[name] if m else np.asarray(p[name])[None]
                    for p, m in zip(payloads, is_many, strict=True)
                ]
            )
            for name in names
        }

    def split(self, outputs: Any, counts: list[int], is_many: list[bool]) -> list[Any]:
        return split_outputs(outputs, counts, is_many)


class PackedCollator:
    """Variable-length items (first axis = length) reach the model as one :class:`Packed`.

    A ``submit_many`` payload is a sequence of such items. The model returns per-item rows
    (an array with one row per item) or, for per-token outputs, a :class:`Packed` with the
    batch's lengths; either is cut back per request.
    """

    pads = False
    multiple_of: int | None = None

    def signature(self, payload: Any, is_many: bool) -> Hashable:
        first = _first_item(payload, is_many)
        return (str(first.dtype), tuple(first.shape[1:]), type(first).__module__)

    def num_items(self, payload: Any) -> int:
        return len(payload)

    def lengths(self, payload: Any, is_many: bool) -> list[int]:
        """Each item's length along axis 0."""
        items = payload if is_many else (payload,)
        return [int(item.shape[0]) for item in items]

    def collate(self, payloads: list[Any], is_many: list[bool]) -> Any:
        return Packed.from_items(flatten(payloads, is_many))

    def split(self, outputs: Any, counts: list[int], is_many: list[bool]) -> list[Any]:
        return split_outputs(_unpack(outputs), counts, is_many)


class PaddedCollator(PackedCollator):
    """Like :class:`PackedCollator`, but the model gets a :class:`Padded` batch: items padded
    with ``pad_value`` to the longest (rounded up to ``multiple_of``) plus a mask."""

    pads = True

    def __init__(self, pad_value: Any = 0, multiple_of: int | None = None) -> None:
        if multiple_of is not None and (
            isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1
        ):
            raise ConfigError("multiple_of", multiple_of, "an integer >= 1 or None")
        self.pad_value = pad_value
        self.multiple_of = multiple_of

    def collate(self, payloads: list[Any], is_many: list[bool]) -> Any:
        packed = Packed.from_items(flatten(payloads, is_many))
        data, mask = packed.to_padded(self.pad_value, self.multiple_of)
        return Padded(data, mask, packed.lengths)


class RaggedDictCollator(DictCollator):
    """Named NumPy inputs where the ``ragged`` ones vary in length from request to request
    (Triton's ``allow_ragged_batch``). A request carries k rows of each input; a ragged
    input's rows all have one length L (shape [k, L, ...]). The model receives the other
    inputs concatenated and each ragged input as a :class:`Packed` of n items (one per
    row) with their lengths, so no request is padded to another's length.
    """

    def __init__(self, ragged: Sequence[str]) -> None:
        if not ragged:
            raise ConfigError("ragged", list(ragged), "the name of at least one ragged input")
        self.ragged = frozenset(ragged)
        self._first = sorted(self.ragged)[0]

    def signature(self, payload: Any, is_many: bool) -> Hashable:
        parts = []
        for name, array in sorted(payload.items()):
            trailing = array.shape[2:] if name in self.ragged else array.shape[1:]
            parts.append((name, array.dtype, trailing if is_many else array.shape))
        return tuple(parts)

    def lengths(self, payload: Any, is_many: bool) -> list[int]:
        """Each row's length in the (alphabetically) first ragged input."""
        array = payload[self._first]
        if not is_many:
            return [int(array.shape[0])]
        if array.ndim < 2:
            raise ValueError(f"ragged input {self._first!r} needs shape [rows, length, ...]")
        return [int(array.shape[1])] * int(array.shape[0])

    def collate(self, payloads: list[Any], is_many: list[bool]) -> Any:
        batch: dict[str, Any] = {}
        for name in payloads[0]:
            parts = [
                p[name] if m else np.asarray(p[name])[None]
                for p, m in zip(payloads, is_many, strict=True)
            ]
            if name in self.ragged:
                batch[name] = Packed.from_items([row for part in parts for row in part])
            else:
                batch[name] = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return batch

    def split(self, outputs: Any, counts: list[int], is_many: list[bool]) -> list[Any]:
        return split_outputs(_unpack(outputs), counts, is_many)


def shared_rows(payload: Mapping[str, Any]) -> int:
    """The number of rows (the length along axis 0, the batch dimension) that every input
    of a named payload has: the one check that named inputs agree on the batch dimension,
    for the server's requests as for the Python API's.

    Raises:
        InvalidInput: the inputs disagree, naming the lengths.
    """
    if not payload:
        raise InvalidInput("the payload is an empty dict: expected at least one named input")
    counts = {int(np.shape(array)[0]) for array in payload.values()}
    if len(counts) != 1:
        raise InvalidInput(f"inputs disagree on the batch dimension: {sorted(counts)}")
    return counts.pop()


def _first_item(payload: Any, is_many: bool) -> Any:
    first = payload[0] if is_many else payload
    if not hasattr(first, "shape"):
        first = np.asarray(first)
    if len(first.shape) == 0:
        raise ValueError("a variable-length item needs at least one axis (its length)")
    return first


def flatten(payloads: list[Any], is_many: list[bool]) -> list[Any]:
    """Every item of a batch's payloads, a ``submit_many`` payload's items in turn."""
    if not any(is_many):
        return payloads
    items: list[Any] = []
    for payload, many in zip(payloads, is_many, strict=True):
        if many:
            items.extend(payload)
        else:
            items.append(payload)
    return items


def _unpack(outputs: Any) -> Any:
    """Per-token outputs (a Packed) become one part per item; the rest is left as is."""
    if isinstance(outputs, Packed):
        return outputs.items()
    if isinstance(outputs, dict):
        return {k: _unpack(v) for k, v in outputs.items()}
    if isinstance(outputs, tuple):
        return tuple(_unpack(v) for v in outputs)
    return outputs


def split_outputs(
    outputs: Any, counts: list[int], is_many: list[bool], where: str = ""
) -> list[Any]:
    """Cut ``outputs`` into one result per request (see the module docstring)."""
    if isinstance(outputs, dict | tuple) and not outputs:
        # No output at all: every caller would get an empty {} or () as its result.
        raise OutputCountMismatch(sum(counts), 0, where)
    if isinstance(outputs, dict):
        per_key = {k: split_outputs(v, counts, is_many, str(k)) for k, v in outputs.items()}
        return [{k: parts[i] for k, parts in per_key.items()} for i in range(len(counts))]
    if isinstance(outputs, tuple):
        per_output = [
            split_outputs(v, counts, is_many, f"{where}[{j}]") for j, v in enumerate(outputs)
        ]
        return [tuple(parts[i] for parts in per_output) for i in range(len(counts))]
    total = sum(counts)
    got = _length(outputs)
    if got != total:
        raise OutputCountMismatch(total, got, where, type(outputs).__name__)
    if not any(is_many):
        return list(outputs) if isinstance(outputs, list) else [outputs[i] for i in range(total)]
    results: list[Any] = []
    offset = 0
    for count, many in zip(counts, is_many, strict=True):
        results.append(outputs[offset : offset + count] if many else outputs[offset])
        offset += count
    return results


def _length(outputs: Any) -> int:
    shape = getattr(outputs, "shape", None)
    if shape is not None:
        if len(shape) == 0:
            return -1  # a scalar has no items; reported as a mismatch
        return int(shape[0])
    if isinstance(outputs, Sequence):
        return len(outputs)
    return -1


_BY_NAME: dict[str, type] = {
    "list": ListCollator,
    "numpy": NumpyCollator,
    "torch": TorchCollator,
    "dict": DictCollator,
    "packed": PackedCollator,
    "padded": PaddedCollator,
}


def collator_for(kind: str | Collator, sample: Any) -> Collator:
    """Resolve ``kind`` ("auto", "list", "numpy", "torch" or a Collator) for ``sample``."""
    if not isinstance(kind, str):
        return kind
    if kind == "auto":
        if isinstance(sample, np.ndarray):
            return NumpyCollator()
        if isinstance(sample, dict) and all(isinstance(v, np.ndarray) for v in sample.values()):
            return DictCollator()
        if type(sample).__module__.startswith("torch") and hasattr(sample, "shape"):
            return TorchCollator()
        return ListCollator()
    try:
        collator: Collator = _BY_NAME[kind]()
    except KeyError:
        raise ConfigError("collate", kind, f"one of {['auto', *_BY_NAME]} or a Collator") from None
    return collator
