"""Variable-length items without padding: the packed layout, padding where a model needs it,
and length buckets.

Three items of lengths 3, 0 and 2 (rows along axis 0, any trailing shape)::

    data        [ a0 a1 a2 | c0 c1 ]        5 rows: the items concatenated along axis 0
    lengths     [ 3, 0, 2 ]
    offsets     [ 0, 3, 3 ]                 where each item starts in ``data``
    cu_seqlens  [ 0, 3, 3, 5 ]              int32, leading 0 (FlashAttention's varlen form)
    segment_ids [ 0 0 0 2 2 ]               which item each row belongs to

    to_padded(pad_value=0) ->  dense [[a0 a1 a2]      mask [[1 1 1]
                                      [ 0  0  0]            [0 0 0]
                                      [c0 c1  0]]           [1 1 0]]

Every array of one ``Packed`` is NumPy, or every one is a torch tensor on one device
(torch is imported only when torch data is given). ``items()`` and ``split_rows`` return
views, not copies.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from carpool.errors import ConfigError, InvalidInput


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


@dataclass(frozen=True, slots=True)
class Packed:
    """Items concatenated along axis 0 with their ``offsets`` and ``lengths`` (int64).

    Build it with :meth:`from_items`, :meth:`from_lengths` or :meth:`from_padded`; the
    constructor trusts its arguments.
    """

    data: Any
    offsets: Any
    lengths: Any

    # -- building -------------------------------------------------------------------

    @classmethod
    def from_items(cls, items: Sequence[Any]) -> Packed:
        """Concatenate ``items`` (NumPy arrays or torch tensors, equal trailing shapes)."""
        if not items:
            raise InvalidInput("cannot pack 0 items; expected at least one")
        first = items[0]
        if _is_torch(first):
            import torch

            lengths = torch.tensor([int(t.shape[0]) for t in items], dtype=torch.int64)
            data = torch.cat(list(items)) if len(items) > 1 else first
            return cls.from_lengths(data, lengths.to(first.device))
        arrays = [np.asarray(item) for item in items]
        trailing = {a.shape[1:] for a in arrays}
        if len(trailing) > 1 or any(a.ndim == 0 for a in arrays):
            raise InvalidInput(
                "items to pack must have at least one axis and equal trailing shapes; got "
                f"shapes {sorted({a.shape for a in arrays})}"
            )
        data = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
        return cls.from_lengths(data, np.array([a.shape[0] for a in arrays], dtype=np.int64))

    @classmethod
    def from_lengths(cls, data: Any, lengths: Any) -> Packed:
        """Wrap ``data`` already concatenated along axis 0, cut by ``lengths``."""
        if _is_torch(data):
            import torch

            lengths = torch.as_tensor(lengths, dtype=torch.int64, device=data.device)
            offsets = torch.cumsum(lengths, 0) - lengths
            total = int(lengths.sum())
            negative = bool((lengths < 0).any()) if lengths.numel() else False
        else:
            data = np.asarray(data)
            lengths = np.asarray(lengths, dtype=np.int64)
            offsets = np.cumsum(lengths) - lengths
            total = int(lengths.sum())
            negative = bool((lengths < 0).any())
        if lengths.ndim != 1 or negative:
            raise InvalidInput(f"lengths must be a 1-D array of counts >= 0; got {lengths!r}")
        if data.ndim == 0 or total != data.shape[0]:
            rows = "no axis" if data.ndim == 0 else f"{data.shape[0]} rows"
            raise InvalidInput(f"lengths add up to {total}, but data has {rows} along axis 0")
        return cls(data, offsets, lengths)

    @classmethod
    def from_padded(cls, dense: Any, lengths: Any) -> Packed:
        """Pack the first ``lengths[i]`` rows of each ``dense[i]`` (shape [n, L, ...])."""
        if _is_torch(dense):
            import torch

            lengths = torch.as_tensor(lengths, dtype=torch.int64, device=dense.device)
            steps = torch.arange(dense.shape[1], device=dense.device)
            return cls.from_lengths(dense[steps[None, :] < lengths[:, None]], lengths)
        dense = np.asarray(dense)
        lengths = np.asarray(lengths, dtype=np.int64)
        if dense.ndim < 2 or lengths.shape != (dense.shape[0],) or (lengths > dense.shape[1]).any():
            raise InvalidInput(
                f"from_padded needs dense [n, L, ...] and n lengths <= L; got dense "
                f"{dense.shape} and lengths {lengths.tolist()}"
            )
        mask = np.arange(dense.shape[1])[None, :] < lengths[:, None]
        return cls.from_lengths(dense[mask], lengths)

    # -- what a kernel wants ----------------------------------------------------------

    @property
    def num_items(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        """Rows of ``data``: the sum of ``lengths``."""
        return int(self.data.shape[0])

    @property
    def max_length(self) -> int:
        return int(self.lengths.max()) if self.num_items else 0

    @property
    def cu_seqlens(self) -> Any:
        """int32 [n + 1]: 0 then the running total of ``lengths``."""
        if _is_torch(self.data):
            import torch

            out = torch.zeros(self.num_items + 1, dtype=torch.int32, device=self.data.device)
            out[1:] = torch.cumsum(self.lengths, 0)
            return out
        out_np = np.zeros(self.num_items + 1, dtype=np.int32)
        np.cumsum(self.lengths, out=out_np[1:])
        return out_np

    @property
    def segment_ids(self) -> Any:
        """int64 [num_tokens]: the item each row of ``data`` belongs to."""
        if _is_torch(self.data):
            import torch

            ids = torch.arange(self.num_items, device=self.data.device)
            return torch.repeat_interleave(ids, self.lengths)
        return np.repeat(np.arange(self.num_items, dtype=np.int64), self.lengths)

    def padded_length(self, multiple_of: int | None = None) -> int:
        """``max_length`` rounded up to ``multiple_of``."""
        length = self.max_length
        if multiple_of is not None and multiple_of > 1:
            length = -(-length // multiple_of) * multiple_of
        return length

    def to_padded(self, pad_value: Any = 0, multiple_of: int | None = None) -> tuple[Any, Any]:
        """``(dense [n, L, ...], mask [n, L] bool)`` with L = ``padded_length(multiple_of)``."""
        if multiple_of is not None and (isinstance(multiple_of, bool) or multiple_of < 1):
            raise ConfigError("multiple_of", multiple_of, "an integer >= 1 or None")
        n, length = self.num_items, self.padded_length(multiple_of)
        trailing = tuple(self.data.shape[1:])
        if _is_torch(self.data):
            import torch

            device = self.data.device
            dense = torch.full(
                (n, length, *trailing), pad_value, dtype=self.data.dtype, device=device
            )
            mask = torch.arange(length, device=device)[None, :] < self.lengths[:, None]
            dense[mask] = self.data
            return dense, mask
        dense_np = np.full((n, length, *trailing), pad_value, dtype=self.data.dtype)
        mask_np = np.arange(length)[None, :] < self.lengths[:, None]
        dense_np[mask_np] = self.data
        return dense_np, mask_np

    # -- back per item ----------------------------------------------------------------

    def items(self) -> list[Any]:
        """Each item's rows of ``data`` (views)."""
        return self.split_tokens(self.data)

    def split_tokens(self, outputs: Any) -> list[Any]:
        """Cut per-row outputs (``num_tokens`` rows) back into one part per item (views)."""
        rows = int(outputs.shape[0])
        if rows != self.num_tokens:
            raise InvalidInput(
                f"per-token outputs have {rows} rows; the packed batch has {self.num_tokens} tokens"
            )
        bounds = [int(b) for b in self.cu_seqlens.tolist()]
        return [outputs[bounds[i] : bounds[i + 1]] for i in range(self.num_items)]

    def split_rows(self, outputs: Any) -> list[Any]:
        """Cut per-item outputs (``num_items`` rows) into one row per item (views)."""
        rows = int(outputs.shape[0])
        if rows != self.num_items:
            raise InvalidInput(
                f"per-item outputs have {rows} rows; the packed batch has {self.num_items} items"
            )
        return [outputs[i] for i in range(rows)]


@dataclass(frozen=True, slots=True)
class Padded:
    """A batch padded for a model that needs it: ``data`` [n, L, ...], ``mask`` [n, L]
    (True on real rows) and each item's ``lengths``."""

    data: Any
    mask: Any
    lengths: Any


def padding_waste(lengths: Sequence[int], multiple_of: int | None = None) -> float:
    """Padded slots / total slots if ``lengths`` were padded to the longest (0 when empty)."""
    if not lengths:
        return 0.0
    longest = max(lengths)
    if multiple_of is not None and multiple_of > 1:
        longest = -(-longest // multiple_of) * multiple_of
    slots = longest * len(lengths)
    return 0.0 if slots == 0 else 1.0 - sum(lengths) / slots


class LengthBuckets:
    """Groups lengths into buckets so a batch holds items of similar length.

    ``edges`` are inclusive upper bounds, ascending: edges (32, 128) make the buckets
    [0, 32], [33, 128] and [129, ∞). With ``edges="auto"`` the edges are the quantiles of
    the last ``window`` observed lengths, recomputed every ``window // 4`` observations,
    into ``num_buckets`` buckets (one bucket until ``window // 4`` lengths were seen).
    """

    __slots__ = ("_edges", "_num_buckets", "_recent", "_seen", "_window", "is_auto")

    def __init__(
        self, edges: Sequence[int] | str, *, num_buckets: int = 4, window: int = 1024
    ) -> None:
        self.is_auto = edges == "auto"
        if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 1:
            raise ConfigError("num_buckets", num_buckets, "an integer >= 1")
        if isinstance(window, bool) or not isinstance(window, int) or window < 4:
            raise ConfigError("window", window, "an integer >= 4")
        self._num_buckets = num_buckets
        self._window = window
        self._recent: deque[int] = deque(maxlen=window)
        self._seen = 0
        if self.is_auto:
            self._edges: list[int] = []
        elif isinstance(edges, str):
            raise ConfigError("length_buckets", edges, '"auto" or ascending integer edges')
        else:
            values = list(edges)
            ok = all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in values)
            if not values or not ok or any(a >= b for a, b in itertools.pairwise(values)):
                raise ConfigError(
                    "length_buckets", edges, '"auto" or strictly ascending integer edges >= 0'
                )
            self._edges = values

    @property
    def edges(self) -> tuple[int, ...]:
        return tuple(self._edges)

    def bucket_of(self, length: int) -> int:
        """The bucket of an item of ``length`` (and, for auto edges, observe it)."""
        if self.is_auto:
            self._observe(length)
        return bisect.bisect_left(self._edges, length)

    def _observe(self, length: int) -> None:
        self._recent.append(length)
        self._seen += 1
        if self._seen % max(1, self._window // 4) == 0:
            ordered = sorted(self._recent)
            cuts = {
                ordered[max(0, math.ceil(q * len(ordered) / self._num_buckets) - 1)]
                for q in range(1, self._num_buckets)
            }
            self._edges = sorted(cuts)
