"""oneDNN's prepacked Linear: the one module that calls torch's private mkldnn ops.

A Linear layer whose weight is reordered once into oneDNN's blocked layout skips that
reorder on every call; on the Xeon and EPYC CPUs measured (docs/benchmarks.md) it ran
carpool's Linear shapes several times faster than ``addmm``. torch exposes it only through
private ops, used here and nowhere else:

    torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)  -> packed weight
    torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, scalars, algorithm)

and, for ``quantization: int8``, the int8 matrix product (on the CPU, oneDNN again):

    torch._int_mm(x_int8 [M, K], w_int8 [K, N])  -> int32 [M, N]

Checked on torch 2.13.0 (CPU build): on a torch upgrade, this module is the one place to
look. Whether a dtype can take this path depends on the CPU, not only on the build: on a
CPU without AVX-512 (or AVX-NE-CONVERT), bfloat16 and float16 reorders raise
``RuntimeError: ... bf16 path needs the cpu support avx_ne_convert or avx512bw, ...``.
:func:`can_prepack` therefore decides once per process and dtype by a probe that cannot
crash: a tiny Linear reordered and run, its output checked against ``F.linear``. Any
error or mismatch means the plain ``nn.Linear`` path, with one log line saying why.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CHECKED_TORCH_VERSION = "2.13.0"
# dtypes the prepacked path is tried for (float16 on a CPU is left to aten).
_CANDIDATE_DTYPES = (torch.float32, torch.bfloat16)
# The probe's shapes: big enough to take oneDNN's blocked path, small enough to cost little
# of a model's load.
_PROBE_ROWS, _PROBE_IN, _PROBE_OUT = 8, 64, 48


INT8_KERNEL = "int8-dynamic"
# The generation runner's float32 Linear layers on carpool's own packed kernel
# (carpool.generation.paged_decode.use_linear_kernel): named here with the others.
CARPOOL_PACKED_KERNEL = "carpool-packed"


def kernel_name(is_prepacked: bool) -> str:
    """How a model's float Linear layers run, as logs and reports name it."""
    return "onednn-prepacked" if is_prepacked else "aten-linear"


def holds_prepacked(module: torch.nn.Module) -> bool:
    """Whether any submodule of ``module`` runs on weights :func:`reorder_weight` packed
    (its ``packed`` is a tensor, or a non-empty dict of them)."""
    for sub in module.modules():
        packed = getattr(sub, "packed", None)
        if isinstance(packed, torch.Tensor) or (isinstance(packed, dict) and packed):
            return True
    return False


def linear_path(module: torch.nn.Module) -> str:
    """How ``module``'s carpool Linear layers run: int8 where any holds int8 weights, the
    kernel a packed layer names for itself (the generation runner's ``FastLinear``:
    ``carpool-packed`` or this module's), prepacked where any holds prepacked ones, else
    plain aten."""
    if any(getattr(sub, "quantized", None) for sub in module.modules()):
        return INT8_KERNEL
    for sub in module.modules():
        named = getattr(sub, "kernel", None)
        if isinstance(named, str) and getattr(sub, "packed", None) is not None:
            return named
    return kernel_name(holds_prepacked(module))


def can_prepack(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether Linear layers of ``dtype`` on ``device`` can use oneDNN's prepacked kernel on
    this CPU and torch build (``CARPOOL_LINEAR_KERNEL=aten`` says no everywhere). Decided
    once per process and dtype; never raises."""
    if torch.device(device).type != "cpu" or dtype not in _CANDIDATE_DTYPES:
        return False
    return _probe(dtype)


# Set to "aten" to keep every model on nn.Linear: held to AVX2, oneDNN's prepacked float32
# and plain nn.Linear ran within noise of each other (docs/benchmarks.md), too close to
# decide by timing at load; this lets an operator choose by measuring their own machine.
# "onednn" keeps the generation runner's layers on oneDNN's prepacked kernel rather than
# carpool's own (carpool.generation.paged_decode.use_linear_kernel).
LINEAR_KERNEL_ENV = "CARPOOL_LINEAR_KERNEL"


_LINEAR_KERNEL_CHOICES = ("auto", "onednn", "aten")


def linear_kernel_choice() -> str:
    """``CARPOOL_LINEAR_KERNEL``: auto (the default), onednn or aten; anything else is
    taken as auto, with a warning."""
    choice = os.environ.get(LINEAR_KERNEL_ENV, "auto")
    if choice in _LINEAR_KERNEL_CHOICES:
        return choice
    logger.warning("%s=%r is not auto, onednn or aten: taken as auto", LINEAR_KERNEL_ENV, choice)
    return "auto"


@functools.cache
def _probe(dtype: torch.dtype) -> bool:
    choice = linear_kernel_choice()
    reason = _probe_failure(dtype) if choice != "aten" else f"{LINEAR_KERNEL_ENV}=aten"
    if reason is not None:
        logger.info(
            "oneDNN prepacked Linear unavailable for %s, using aten linear: %s", dtype, reason
        )
        return False
    logger.debug("oneDNN prepacked Linear: available for %s", dtype)
    return True


def _probe_failure(dtype: torch.dtype) -> str | None:
    """None when the prepacked path works for ``dtype`` here, else why not."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return "this torch build has no oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return f"torch {torch.__version__} lacks mkldnn._linear_pointwise (checked on 2.13.0)"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(_PROBE_OUT, _PROBE_IN, generator=generator).to(dtype)
    bias = torch.randn(_PROBE_OUT, generator=generator).to(dtype)
    x = torch.randn(_PROBE_ROWS, _PROBE_IN, generator=generator).to(dtype)
    try:
        with torch.inference_mode():
            got = linear(x, reorder_weight(weight), bias)
            want = F.linear(x, weight, bias)
    except Exception as error:  # the private op's own refusal (CPU ISA, build): fall back
        return f"{type(error).__name__}: {error}"
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    scale = float(want.abs().max()) or 1.0
    error_rel = float((got.float() - want.float()).abs().max()) / scale
    if not error_rel <= tolerance:
        return f"its output differs from F.linear by {error_rel:.2g} (relative; limit {tolerance})"
    return None


def reorder_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered into oneDNN's layout; call only where
    :func:`can_prepack` said yes for its dtype."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    return packed


def linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, *, gelu: bool = False
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (then exact-erf GELU when ``gelu``) on a weight
    reordered by :func:`reorder_weight`; ``x`` may have any number of leading dimensions."""
    flat = x.reshape(-1, x.shape[-1])
    attr, algorithm = ("gelu", "none") if gelu else ("none", "")  # "none": exact erf GELU
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, attr, [], algorithm)
    return y.view(*x.shape[:-1], y.shape[-1])


# -- int8: weights per output channel, activations per row (token) -----------------------
#
#     y[t, n] = sum_k x[t, k] w[n, k] + b[n]
#            ~= (sum_k xq[t, k] wq[n, k]) * sx[t] * sw[n] + b[n]
#     sx[t] = max_k |x[t, k]| / 127   (computed for each row of each batch)
#     sw[n] = max_k |w[n, k]| / W     (once, at load; W = 127, or 63, see below)
#
# A row's scale depends on that row alone, so a text's embedding does not depend on the
# texts batched with it (per-tensor activation scales, as torch.ao's dynamic quantization
# uses, make it depend on the largest value anywhere in the batch).
#
# On a CPU without VNNI (AVX2 alone, or AVX-512 before Cascade Lake) oneDNN multiplies
# int8 pairs with vpmaddubsw, whose 16-bit pair sums saturate: full-range weights then give
# wrong products (off by up to 1.5e5 on a [4096, 384] x [384, 1536] product, with
# ONEDNN_MAX_CPU_ISA=AVX2). With weights held to 7 bits (|w| <= 63) the sums fit and the
# products are exact. The probe finds which range is exact here.

_INT8_WEIGHT_RANGES = (127, 63)


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A Linear weight quantized per output channel: ``values`` [K, N] int8 (a transposed
    view of the [N, K] rows) and ``scales`` [N] float32."""

    values: torch.Tensor
    scales: torch.Tensor


def quantize_weight(weight: torch.Tensor, max_value: int | None = None) -> Int8Weight:
    """``weight`` [N, K] (float) as symmetric int8 per output channel, within
    ``[-max_value, max_value]`` (default: the widest range exact on this CPU)."""
    limit = max_value or int8_weight_range() or _INT8_WEIGHT_RANGES[-1]
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp_(min=1e-12).div_(float(limit))
    values = torch.round(w / scales[:, None]).to(torch.int8)
    return Int8Weight(values.t(), scales)


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for float32 ``x`` (any leading dimensions) through int8:
    each row of ``x`` quantized with its own scale, one int8 product, one rescale."""
    flat = x.reshape(-1, x.shape[-1])
    row_scales = flat.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127.0)
    quantized = torch.round(flat / row_scales).to(torch.int8)  # |x / scale| <= 127
    y = torch._int_mm(quantized, weight.values) * row_scales  # int32 -> float32, one pass
    y.mul_(weight.scales)
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], y.shape[-1])


def can_int8() -> bool:
    """Whether this torch build and CPU run :func:`int8_linear` exactly (``torch._int_mm``
    on the CPU); decided once per process, never raises."""
    return int8_weight_range() is not None


@functools.cache
def int8_weight_range() -> int | None:
    """The widest weight range (127 or 63) whose int8 products are exact on this CPU;
    None when the int8 product fails or is wrong at both."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (16, 256), dtype=torch.int8, generator=generator)
    for limit in _INT8_WEIGHT_RANGES:
        w = torch.randint(-limit, limit + 1, (64, 256), dtype=torch.int8, generator=generator)
        try:
            got = torch._int_mm(x, w.t())
        except Exception as error:  # a build without the CPU int8 product
            logger.info("int8 Linear unavailable: %s: %s", type(error).__name__, error)
            return None
        if torch.equal(got.long(), x.long() @ w.long().t()):
            if limit != _INT8_WEIGHT_RANGES[0]:
                logger.info(
                    "int8 products saturate at full range on this CPU (no VNNI): "
                    "weights quantized to 7 bits (|w| <= %d)",
                    limit,
                )
            return limit
    logger.info("int8 Linear unavailable: torch._int_mm is wrong here at every weight range")
    return None
