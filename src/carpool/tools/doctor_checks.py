"""The doctor's behavioural checks: batch invariance (part 2) and input-length variance (part 3).

Each check takes the model as ``call(batch) -> {output name: array}`` and returns a verdict
value; nothing here reads a wall clock unless handed one.

Batch invariance: an item's output must not depend on who else is in its batch. Each probe
runs alone (batch of 1), then inside batches of other items at several positions::

    alone      [p]                       reference
    random     [r r p r r r r r]         p among random items
    large      [L L L p L L L L]         p among items x1000
    zeros      [p 0 0 0 0 0 0 0]         p among zeros
    longer     [p+0 l l l l l l l]       p zero-padded to longer neighbours (variable length)
    padding    [p+000]                   p alone, zero-padded to longer lengths

The deviation of an output is ``max|out - ref|`` (abs) and that over the larger of
``max|out|`` and ``max|ref|`` (relative, normwise: elementwise ratios explode near zero).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from carpool.core.layout import padding_waste

Array = npt.NDArray[Any]
Outputs = dict[str, Array]
BatchCall = Callable[[Array], Outputs]
Clock = Callable[[], float]

LARGE_MAGNITUDE = 1e3


def make_items(rng: np.random.Generator, num_items: int, shape: Sequence[int], dtype: str) -> Array:
    """``num_items`` random items of ``shape``: standard normal floats, or ints in [0, 100)."""
    if dtype == "bfloat16" or np.issubdtype(np.dtype(dtype), np.floating):
        data = rng.standard_normal((num_items, *shape))
        return data.astype(np.float32 if dtype == "bfloat16" else dtype)
    return rng.integers(0, 100, size=(num_items, *shape)).astype(dtype)


def default_rtol(dtype: Any) -> float:
    """Relative tolerance for an output dtype: float32 1e-5, 16-bit floats 1e-2, ints exact."""
    kind = np.dtype(dtype)
    if kind == np.float64:
        return 1e-9
    if kind == np.float16:
        return 1e-2
    return 1e-5 if np.issubdtype(kind, np.inexact) else 0.0


def pad_item(item: Array, axis: int, length: int) -> Array:
    """``item`` zero-padded at the end of item axis ``axis`` to ``length``."""
    widths = [(0, 0)] * item.ndim
    widths[axis] = (0, length - item.shape[axis])
    return np.pad(item, widths)


def stack_padded(items: Sequence[Array], axis: int | None) -> Array:
    """``items`` as one batch, zero-padded along item axis ``axis`` to the longest."""
    if axis is None:
        return np.stack(items)
    longest = max(item.shape[axis] for item in items)
    return np.stack([pad_item(item, axis, longest) for item in items])


def _crop(out: Array, shape: tuple[int, ...]) -> Array | None:
    """``out`` cut to ``shape`` (padded positions dropped); None when it cannot be."""
    if out.ndim != len(shape) or any(o < s for o, s in zip(out.shape, shape, strict=True)):
        return None
    return out[tuple(slice(0, s) for s in shape)]


def deviation(out: Array, ref: Array) -> tuple[float, float]:
    """``(max abs, max abs / max(|out|, |ref|))``; inf when ``out`` cannot be cut to ``ref``
    or its NaNs and infinities are not where ``ref`` has the same (NaN matches NaN, as in
    ``numpy.testing.assert_allclose``): a model that answers NaN alone and batched alike is
    batch-invariant; one whose NaN appears or goes away with batching is not."""
    cropped = _crop(out, ref.shape)
    if cropped is None:
        return math.inf, math.inf
    a = cropped.astype(np.float64)
    b = ref.astype(np.float64)
    if a.size == 0:
        return 0.0, 0.0
    a_inf, b_inf = np.isinf(a), np.isinf(b)
    if (
        not np.array_equal(np.isnan(a), np.isnan(b))
        or not np.array_equal(a_inf, b_inf)
        or not np.array_equal(a[a_inf], b[b_inf])
    ):
        return math.inf, math.inf
    finite = np.isfinite(a)
    a, b = a[finite], b[finite]
    if a.size == 0:
        return 0.0, 0.0
    max_abs = float(np.max(np.abs(a - b)))
    if not math.isfinite(max_abs):  # finite values whose difference overflows
        return math.inf, math.inf
    if max_abs == 0.0:
        return 0.0, 0.0
    return max_abs, max_abs / max(float(np.max(np.abs(a))), float(np.max(np.abs(b))))


# -- structure --------------------------------------------------------------------------------


def inspect_modules(modules: Iterable[Any]) -> list[str]:
    """Structural flags for torch modules: batch-statistics norms and active dropout."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return []
    batch_norm = torch.nn.modules.batchnorm._BatchNorm
    dropout = torch.nn.modules.dropout._DropoutNd
    flags: list[str] = []
    for module in modules:
        for name, sub in module.named_modules():
            where = f"{type(sub).__name__} at {name or '<root>'!r}"
            if isinstance(sub, batch_norm) and sub.training:
                flags.append(
                    f"{where} is in training mode: it normalises with the statistics of the "
                    "batch, so each output depends on its neighbours; call model.eval()"
                )
            elif isinstance(sub, batch_norm) and not sub.track_running_stats:
                flags.append(
                    f"{where} has track_running_stats=False: it uses batch statistics even in "
                    "eval mode; outputs depend on the neighbours"
                )
            if isinstance(sub, dropout) and sub.training and sub.p > 0:
                flags.append(f"{where} is in training mode: outputs are random; call model.eval()")
    return flags


# -- invariance -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Deviation:
    """The worst deviation of one output under one kind of context."""

    kind: str
    output: str
    max_abs: float
    max_rel: float
    rtol: float
    batch_size: int
    position: int

    @property
    def is_flagged(self) -> bool:
        return self.max_rel > self.rtol


@dataclass(frozen=True, slots=True)
class InvarianceVerdict:
    """``is_passed`` when no structural flag and no deviation over its tolerance."""

    is_passed: bool
    reasons: list[str]
    structural: list[str]
    deviations: list[Deviation]  # worst per (kind, output)
    num_calls: int


_WHY = {
    "random": "random neighbours",
    "large": f"neighbours x{LARGE_MAGNITUDE:g} in magnitude",
    "zeros": "all-zero neighbours",
    "longer": "longer neighbours (the item zero-padded to their length)",
    "padding": "the item alone zero-padded to longer lengths",
    "repeat": "the same input run twice",
}


def _reason(d: Deviation) -> str:
    facts = (
        f"output {d.output!r} moves by {d.max_rel:.2e} relative (max abs {d.max_abs:.2e}, "
        f"tolerance {d.rtol:.0e}) with {_WHY.get(d.kind, d.kind)}"
    )
    if d.kind == "repeat":
        return f"{facts}: the model is not deterministic (dropout in training mode?)"
    if d.kind in ("padding", "longer"):
        return f"{facts}: outputs depend on padding length; mask padded positions"
    return (
        f"{facts} (batch {d.batch_size}, position {d.position}): a cross-sample dependency "
        "(batch statistics, a reduction over the batch axis)"
    )


@dataclass(slots=True)
class _Worst:
    found: dict[tuple[str, str], Deviation]

    def add(
        self,
        kind: str,
        out: Outputs,
        ref: Outputs,
        rtol: float | None,
        bsz: int,
        pos: int,
        row: int,
    ) -> None:
        for name, ref_value in ref.items():
            tol = rtol if rtol is not None else default_rtol(ref_value.dtype)
            got = out.get(name)
            max_abs, max_rel = (
                (math.inf, math.inf) if got is None else deviation(got[row], ref_value)
            )
            key = (kind, name)
            if key not in self.found or max_rel > self.found[key].max_rel:
                self.found[key] = Deviation(kind, name, max_abs, max_rel, tol, bsz, pos)


def check_invariance(
    call: BatchCall,
    probes: Sequence[Array],
    neighbours: Mapping[str, Callable[[int], Array]],
    batch_sizes: Sequence[int],
    *,
    rtol: float | None = None,
    modules: Iterable[Any] = (),
    pad_axis: int | None = None,
    pad_lengths: Sequence[int] = (),
) -> InvarianceVerdict:
    """Whether each probe's output stays the same alone and among ``neighbours``.

    ``neighbours[kind](n)`` makes ``n`` neighbour items; a probe shorter than its neighbours
    along ``pad_axis`` is zero-padded to them. ``pad_lengths`` also runs each probe alone
    padded to those lengths. ``rtol`` overrides the per-dtype tolerance (:func:`default_rtol`).
    """
    reasons: list[str] = []
    worst = _Worst({})
    num_calls = 0
    for probe in probes:
        ref: Outputs | None = None
        try:
            ref = {k: v[0] for k, v in call(probe[None]).items()}
            worst.add("repeat", call(probe[None]), ref, rtol, 1, 0, 0)
            num_calls += 2
        except Exception as error:
            reason = f"a batch of 1 fails ({type(error).__name__}: {error}): a lone request fails"
            if reason not in reasons:
                reasons.append(reason)
        for kind, make in neighbours.items():
            for bsz in batch_sizes:
                for pos in sorted({0, bsz // 2, bsz - 1}):
                    items = list(make(bsz))
                    items[pos] = probe
                    out = call(stack_padded(items, pad_axis))
                    num_calls += 1
                    if ref is None:  # no batch-of-1 reference: the first context is one
                        ref = {k: v[pos] for k, v in out.items()}
                    worst.add(kind, out, ref, rtol, bsz, pos, pos)
        if ref is not None and pad_axis is not None:
            for length in pad_lengths:
                if length > probe.shape[pad_axis]:
                    padded = pad_item(probe, pad_axis, length)
                    worst.add("padding", call(padded[None]), ref, rtol, 1, 0, 0)
                    num_calls += 1
    structural = inspect_modules(modules)
    deviations = list(worst.found.values())
    reasons += structural + [_reason(d) for d in deviations if d.is_flagged]
    return InvarianceVerdict(not reasons, reasons, structural, deviations, num_calls)


# -- input-length variance --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LengthTiming:
    length: int
    median_s: float
    cv: float


@dataclass(frozen=True, slots=True)
class LengthReport:
    """Batch time vs input length, the jitter of mixed-length batches, suggested buckets."""

    batch_size: int
    timings: list[LengthTiming]
    cv_uniform: float
    cv_mixed: float
    jitter_ratio: float
    jitter_risk: str  # low | moderate | high
    padding_waste: float
    superlinear: list[tuple[int, int, float]]  # (length, next length, growth exponent)
    bucket_edges: list[int]
    reason: str


def _cv(values: Sequence[float]) -> float:
    array = np.asarray(values, dtype=np.float64)
    mean = float(array.mean())
    return float(array.std()) / mean if mean > 0 else 0.0


def superlinear_steps(
    points: Sequence[tuple[int, float]], min_exponent: float = 1.2
) -> list[tuple[int, int, float]]:
    """Steps ``L1 -> L2`` where time grows like ``L ** e`` with ``e >= min_exponent``."""
    steps: list[tuple[int, int, float]] = []
    ordered = sorted(points)
    for (l1, t1), (l2, t2) in itertools.pairwise(ordered):
        if t1 > 0 and t2 > 0 and l2 > l1:
            exponent = math.log(t2 / t1) / math.log(l2 / l1)
            if exponent >= min_exponent:
                steps.append((l1, l2, exponent))
    return steps


def suggest_buckets(points: Sequence[tuple[int, float]], max_slowdown: float = 1.25) -> list[int]:
    """Bucket edges (inclusive upper lengths) from ``(length, batch time)`` points.

    Lengths join the current bucket while padding its cheapest member to them costs at most
    ``max_slowdown`` x its own time; the next length opens a new bucket. Where time is flat
    (overhead-bound) lengths merge; where it grows fast (superlinear) each step is an edge.
    """
    ordered = sorted(points)
    edges: list[int] = []
    start_time: float | None = None
    previous: int | None = None
    for length, t in ordered:
        if start_time is not None and previous is not None and t > max_slowdown * start_time:
            edges.append(previous)
            start_time = None
        if start_time is None:
            start_time = t
        previous = length
    if previous is not None:
        edges.append(previous)
    return edges


def jitter_risk(cv_uniform: float, cv_mixed: float) -> tuple[str, float]:
    """``(low | moderate | high, cv_mixed / cv_uniform)`` for batch-time variation."""
    ratio = cv_mixed / cv_uniform if cv_uniform > 0 else (math.inf if cv_mixed > 0 else 1.0)
    if cv_mixed > 0.25 and ratio > 2.0:
        return "high", ratio
    if cv_mixed > 0.10 and ratio > 1.5:
        return "moderate", ratio
    return "low", ratio


def measure_lengths(
    call: BatchCall,
    make_item: Callable[[int], Array],
    lengths: Sequence[int],
    batch_size: int,
    *,
    axis: int,
    repeats: int,
    warmup: int,
    rng: np.random.Generator,
    clock: Clock = time.perf_counter,
) -> LengthReport:
    """Time uniform batches of each length and mixed-length (zero-padded) batches.

    ``make_item(length)`` makes one item of that length along item axis ``axis``.
    """

    def timed(batch: Array) -> float:
        start = clock()
        call(batch)
        return clock() - start

    timings: list[LengthTiming] = []
    for length in sorted(set(lengths)):
        batch = np.stack([make_item(length) for _ in range(batch_size)])
        for _ in range(warmup):
            call(batch)
        times = [timed(batch) for _ in range(repeats)]
        timings.append(LengthTiming(length, float(np.median(times)), _cv(times)))
    mixed_times: list[float] = []
    wastes: list[float] = []
    for _ in range(max(repeats, 2 * len(timings))):
        drawn = [int(n) for n in rng.choice(list(lengths), size=batch_size)]
        wastes.append(padding_waste(drawn))
        mixed_times.append(timed(stack_padded([make_item(n) for n in drawn], axis)))
    return length_report(batch_size, timings, mixed_times, float(np.mean(wastes)))


def length_report(
    batch_size: int, timings: list[LengthTiming], mixed_times: Sequence[float], waste: float
) -> LengthReport:
    """The :class:`LengthReport` of measured uniform timings and mixed-batch times."""
    points = [(t.length, t.median_s) for t in timings]
    cv_uniform = float(np.mean([t.cv for t in timings])) if timings else 0.0
    cv_mixed = _cv(mixed_times) if mixed_times else 0.0
    risk, ratio = jitter_risk(cv_uniform, cv_mixed)
    steps = superlinear_steps(points)
    edges = suggest_buckets(points)
    reason = (
        f"mixed-length batches vary {cv_mixed:.0%} (CV) vs {cv_uniform:.0%} for uniform ones "
        f"({risk} jitter risk); {waste:.0%} of a mixed batch is padding"
    )
    if steps:
        reason += "; time grows superlinearly " + ", ".join(
            f"{a}->{b} (~L^{e:.1f})" for a, b, e in steps
        )
    return LengthReport(
        batch_size, timings, cv_uniform, cv_mixed, ratio, risk, waste, steps, edges, reason
    )
