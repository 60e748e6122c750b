"""Collation into pooled buffers (see :mod:`carpool.core.buffer_pool`), and outputs that
never alias them.

:class:`PooledCollator` wraps one of carpool's collators and writes the batch into a
leased buffer instead of a new array: ``numpy`` and ``dict`` batches (``np.stack`` /
``np.concatenate`` with ``out=``), ``torch`` ones (``torch.stack``/``torch.cat`` with
``out=``), ``packed`` token buffers (data, offsets, lengths) and ``padded`` ones (dense
and mask). Any other collator (``list``, ``ragged``, a user's) collates as it did.

Outputs: a model's outputs are split as *views* of what it returned, as without the pool:
the model allocated them, nothing reuses them, and a caller may keep its part for as long
as it likes. An output that shares memory with the pooled input (a model that returns its
input, or a view or reshape of it) is *copied* first, once per batch, before the buffer
goes back: a request that keeps its result never sees a later batch's data.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from carpool.core.buffer_pool import BufferPool
from carpool.core.collate import (
    Collator,
    DictCollator,
    NumpyCollator,
    PackedCollator,
    PaddedCollator,
    TorchCollator,
    flatten,
)
from carpool.core.layout import Packed, Padded

_POOLED = (NumpyCollator, DictCollator, TorchCollator, PackedCollator, PaddedCollator)


def pooled(collator: Collator, pool: BufferPool | None) -> Collator:
    """``collator`` writing into ``pool``'s buffers where it is one that can; else itself."""
    if pool is None or isinstance(collator, PooledCollator):
        return collator
    if type(collator) not in _POOLED:  # a subclass may collate otherwise (ragged dict)
        return collator
    return PooledCollator(collator, pool)


class PooledCollator:
    """A collator whose batches live in a :class:`BufferPool` (see the module docstring).

    ``collate_leased`` returns the batch and the buffers it holds; ``split_leased`` splits
    the outputs, copying those that alias the buffers, and gives the buffers back. Other
    attributes (``lengths``, ``pads``, ``multiple_of``) are the wrapped collator's.
    """

    def __init__(self, inner: Collator, pool: BufferPool) -> None:
        self.inner = inner
        self.pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def signature(self, payload: Any, is_many: bool) -> Hashable:
        return self.inner.signature(payload, is_many)

    def num_items(self, payload: Any) -> int:
        return self.inner.num_items(payload)

    def collate(self, payloads: list[Any], is_many: list[bool]) -> Any:
        """The batch, in buffers nobody gives back (for callers without a lease)."""
        return self.collate_leased(payloads, is_many)[0]

    def split(self, outputs: Any, counts: list[int], is_many: list[bool]) -> list[Any]:
        return self.inner.split(outputs, counts, is_many)

    def collate_leased(self, payloads: list[Any], is_many: list[bool]) -> tuple[Any, list[Any]]:
        """The batch and the pooled buffers it was written into (maybe none)."""
        lease: list[Any] = []
        try:
            batch = self._collate_into(payloads, is_many, lease)
        except Exception:
            # What the pool cannot write (items of unequal shapes, values that do not
            # convert): the wrapped collator gives the batch, or the error, as without it.
            for buffer in lease:
                self.pool.release(buffer)
            return self.inner.collate(payloads, is_many), []
        return batch, lease

    def split_leased(
        self, outputs: Any, counts: list[int], is_many: list[bool], lease: list[Any]
    ) -> list[Any]:
        """Split ``outputs``, copying any that alias ``lease``; then give ``lease`` back."""
        try:
            if lease:
                outputs = unalias(outputs, lease)
            return self.inner.split(outputs, counts, is_many)
        finally:
            for buffer in lease:
                self.pool.release(buffer)

    # -- writing the batch -------------------------------------------------------------

    def _collate_into(self, payloads: list[Any], is_many: list[bool], lease: list[Any]) -> Any:
        inner = self.inner
        if isinstance(inner, PackedCollator):
            return self._packed(payloads, is_many, lease)
        if isinstance(inner, DictCollator):
            if len(payloads) == 1 and is_many[0]:
                return inner.collate(payloads, is_many)  # the payload itself: no copy
            return {
                name: self._stack_numpy([p[name] for p in payloads], is_many, lease)
                for name in payloads[0]
            }
        if isinstance(inner, TorchCollator):
            return self._stack_torch(payloads, is_many, lease)
        return self._stack_numpy(payloads, is_many, lease)

    def _stack_numpy(self, parts: list[Any], is_many: list[bool], lease: list[Any]) -> Any:
        arrays = [p if type(p) is np.ndarray else np.asarray(p) for p in parts]
        return self._stack(arrays, is_many, lease, None)

    def _stack_torch(self, parts: list[Any], is_many: list[bool], lease: list[Any]) -> Any:
        import torch

        return self._stack(parts, is_many, lease, torch)

    def _stack(self, parts: list[Any], is_many: list[bool], lease: list[Any], torch: Any) -> Any:
        """Arrays (``torch`` None) or tensors stacked, or for ``many`` joined, into a buffer."""
        first = parts[0]
        many = any(is_many)
        if many:
            parts = [p if m else p[None] for p, m in zip(parts, is_many, strict=True)]
            rows = sum(int(p.shape[0]) for p in parts)
            trailing = tuple(first.shape[1:] if is_many[0] else first.shape)
        else:
            rows, trailing = len(parts), tuple(first.shape)
        shape = (self.pool.bucket(rows), *trailing)
        if torch is None:
            buffer: Any = self.pool.acquire_numpy(shape, first.dtype)
            join, stack = np.concatenate, np.stack
        else:
            buffer = self.pool.acquire_torch(shape, first.dtype, first.device)
            join, stack = torch.cat, torch.stack
        lease.append(buffer)
        out = buffer[:rows]
        (join if many else stack)(parts, out=out)
        return out

    def _packed(self, payloads: list[Any], is_many: list[bool], lease: list[Any]) -> Any:
        inner = self.inner
        items = flatten(payloads, is_many)
        if type(items[0]).__module__.startswith("torch"):
            return inner.collate(payloads, is_many)  # torch items: as without the pool
        arrays = [a if type(a) is np.ndarray else np.asarray(a) for a in items]
        first = arrays[0]
        trailing = first.shape[1:]
        if first.ndim == 0 or any(
            a.shape[1:] != trailing or a.dtype != first.dtype for a in arrays
        ):
            return inner.collate(payloads, is_many)  # the wrapped collator's error or dtype
        n = len(arrays)
        lengths = self.pool.acquire_numpy((self.pool.bucket(n),), np.int64)
        offsets = self.pool.acquire_numpy((self.pool.bucket(n),), np.int64)
        lease += (lengths, offsets)
        lengths, offsets = lengths[:n], offsets[:n]
        for i, a in enumerate(arrays):
            lengths[i] = a.shape[0]
        np.cumsum(lengths, out=offsets)
        np.subtract(offsets, lengths, out=offsets)
        total = int(offsets[-1] + lengths[-1])
        data = self.pool.acquire_numpy((self.pool.bucket(total), *trailing), first.dtype)
        lease.append(data)
        data = data[:total]
        np.concatenate(arrays, out=data)
        packed = Packed(data, offsets, lengths)
        if not isinstance(inner, PaddedCollator):
            return packed
        length = packed.padded_length(inner.multiple_of)
        dense = self.pool.acquire_numpy((self.pool.bucket(n), length, *trailing), first.dtype)
        mask = self.pool.acquire_numpy((self.pool.bucket(n), length), np.bool_)
        lease += (dense, mask)
        dense, mask = dense[:n], mask[:n]
        dense.fill(inner.pad_value)
        mask.fill(False)
        for i, a in enumerate(arrays):
            rows = a.shape[0]
            dense[i, :rows] = a
            mask[i, :rows] = True
        return Padded(dense, mask, packed.lengths)


def unalias(outputs: Any, buffers: list[Any]) -> Any:
    """``outputs`` with every array or tensor that shares memory with ``buffers`` copied
    (through dicts, tuples, lists and :class:`Packed`). A container none of whose values
    was copied is returned as it is (its own type, whatever its constructor takes); a copy
    keeps the array's subclass (a masked array keeps its mask)."""
    if isinstance(outputs, dict):
        items = {k: unalias(v, buffers) for k, v in outputs.items()}
        if all(items[k] is v for k, v in outputs.items()):
            return outputs
        if type(outputs) is dict:
            return items
        rebuilt = outputs.copy()  # its own type where it keeps one (a defaultdict's factory)
        rebuilt.update(items)
        return rebuilt
    if isinstance(outputs, tuple | list):
        values = [unalias(v, buffers) for v in outputs]
        if all(new is old for new, old in zip(values, outputs, strict=True)):
            return outputs
        if hasattr(outputs, "_make"):  # a namedtuple takes its fields one by one
            return outputs._make(values)
        return type(outputs)(values)
    if isinstance(outputs, Packed):
        return Packed(
            *(unalias(v, buffers) for v in (outputs.data, outputs.offsets, outputs.lengths))
        )
    span = _span(outputs)
    if span is None:
        return outputs
    start, end = span
    for buffer in buffers:
        other = _span(buffer)
        if other is not None and start < other[1] and other[0] < end:
            return outputs.clone() if hasattr(outputs, "clone") else outputs.copy(order="K")
    return outputs


def _span(value: Any) -> tuple[int, int] | None:
    """The byte range of ``value``'s memory (its whole storage for a tensor), or None."""
    if isinstance(value, np.ndarray):
        base = value
        while isinstance(base.base, np.ndarray):
            base = base.base
        start, end = np.lib.array_utils.byte_bounds(base)
        return (start, end) if end > start else None
    if type(value).__module__.startswith("torch") and hasattr(value, "untyped_storage"):
        storage = value.untyped_storage()
        start = int(storage.data_ptr())
        return (start, start + int(storage.nbytes())) if storage.nbytes() else None
    return None
