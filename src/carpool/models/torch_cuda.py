"""The torch runner's GPU path: CUDA graphs at fixed batch sizes, autocast, and host-device
copies on a copy stream ordered by events.

``cuda_graphs: true`` captures the module once per *graph size* (the preferred batch sizes,
else powers of two up to ``max_batch_size``); a batch runs the graph of the smallest size
that holds it, its rows copied into the graph's static input and the rest zero-filled
(padding). :class:`GraphStats` counts the rows run and the rows padded, so the cost of
padding is known::

    sizes (1, 2, 4, 8)   batch of 3 rows  ->  graph 4: 3 rows + 1 padded

A batch larger than the largest size runs eagerly. Without CUDA (or for inputs a graph
cannot take: a ragged one) every option here falls back to the eager path and says so in
the log once; nothing here raises for want of a GPU.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.errors import ConfigError

log = logging.getLogger("carpool.models.torch")


def graph_sizes(preferred: Sequence[int], max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes to capture: ``preferred`` (sorted), else the powers of two up to
    ``max_batch_size`` and ``max_batch_size`` itself.

    Raises:
        ConfigError: a size below 1.
    """
    if max_batch_size < 1 or any(s < 1 for s in preferred):
        raise ConfigError("cuda_graphs sizes", list(preferred), "batch sizes >= 1")
    if preferred:
        return tuple(sorted(set(preferred)))
    sizes = {1 << k for k in range(max_batch_size.bit_length()) if 1 << k <= max_batch_size}
    return tuple(sorted(sizes | {max_batch_size}))


def graph_size_for(rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``rows`` rows; None when none does."""
    at = bisect.bisect_left(sizes, rows)
    return sizes[at] if at < len(sizes) else None


@dataclass(slots=True)
class GraphStats:
    """What the graphs ran: batches and rows by graph, rows of padding, eager batches."""

    graph_batches: int = 0
    rows: int = 0
    padded_rows: int = 0
    eager_batches: int = 0

    def count(self, rows: int, size: int | None) -> None:
        if size is None:
            self.eager_batches += 1
            return
        self.graph_batches += 1
        self.rows += rows
        self.padded_rows += size - rows

    @property
    def padding_share(self) -> float:
        """Padded rows over all rows the graphs computed (0 when none ran)."""
        total = self.rows + self.padded_rows
        return self.padded_rows / total if total else 0.0


def autocast_dtype(enabled: bool, device: Any, weights_dtype: Any) -> Any:
    """The dtype ``autocast: true`` runs in on ``device``, or None for the plain path:
    float16 on CUDA for float32 weights; None (logged) on a CPU, or when the weights are
    already in a reduced precision (``dtype:`` given)."""
    import torch

    if not enabled:
        return None
    if device.type != "cuda":
        log.warning("autocast: true needs a CUDA device; %s runs in its own precision", device)
        return None
    if weights_dtype is not None and weights_dtype != torch.float32:
        log.info("autocast: true ignored: the weights already are %s", weights_dtype)
        return None
    return torch.float16


class CudaCopies:
    """Host-to-device copies on a side stream, ordered before the compute by an event (no
    ``synchronize()``): ``non_blocking`` from pinned host memory (the buffer pool's on a
    CUDA replica), so the copy does not hold the host thread."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def to_device(self, tensor: Any) -> Any:
        torch = self._torch
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            moved = tensor.to(self.device, non_blocking=tensor.is_pinned())
            copied = torch.cuda.Event()
            copied.record(self.stream)
        compute.wait_event(copied)
        moved.record_stream(compute)  # the allocator must not reuse it before compute ends
        return moved


class CudaGraphs:
    """The module captured at each graph size, lazily, on its first batch of that size
    (after a warm-up run on a side stream, as torch's capture requires)."""

    def __init__(self, module: Any, sizes: Sequence[int], device: Any) -> None:
        import torch

        self._torch = torch
        self.module = module
        self.sizes = tuple(sizes)
        self.device = device
        self.stats = GraphStats()
        self._graphs: dict[int, tuple[Any, list[Any], Any]] = {}

    def __call__(self, args: list[Any], autocast: Any = None) -> Any:
        rows = int(args[0].shape[0])
        size = graph_size_for(rows, self.sizes)
        self.stats.count(rows, size)
        if size is None:
            return self._run(args, autocast)
        graph, inputs, outputs = self._graphs.get(size) or self._capture(size, args, autocast)
        for static, arg in zip(inputs, args, strict=True):
            static[:rows].copy_(arg)
            if rows < size:
                static[rows:].zero_()
        graph.replay()
        if isinstance(outputs, tuple | list):
            return type(outputs)(o[:rows].clone() for o in outputs)
        if isinstance(outputs, dict):
            return {k: o[:rows].clone() for k, o in outputs.items()}
        return outputs[:rows].clone()

    def _run(self, args: list[Any], autocast: Any) -> Any:
        torch = self._torch
        if autocast is None:
            return self.module(*args)
        with torch.autocast("cuda", dtype=autocast):
            return self.module(*args)

    def _capture(self, size: int, args: list[Any], autocast: Any) -> tuple[Any, list[Any], Any]:
        torch = self._torch
        inputs = [
            torch.zeros((size, *a.shape[1:]), dtype=a.dtype, device=self.device) for a in args
        ]
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(inputs, autocast)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self._run(inputs, autocast)
        self._graphs[size] = (graph, inputs, outputs)
        log.info("cuda_graphs: captured batch size %d on %s", size, self.device)
        return graph, inputs, outputs
