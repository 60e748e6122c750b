"""What machine a measurement ran on: the CPU, its vector instruction sets, and which
kernels torch and carpool chose there. Reports and benchmark result files quote these,
since the same model runs several times faster or slower on another CPU."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

# The /proc/cpuinfo flags that decide which kernels run (oneDNN, ATen, OpenBLAS/MKL).
_KERNEL_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx_ne_convert",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)
# Environment variables that cap the instruction sets kernels use: a run with them set
# measures a lesser CPU than the one it ran on (ONEDNN_MAX_CPU_ISA=AVX2 stands in for a
# CPU without AVX-512), and its results must say so.
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else the architecture (``x86_64``)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The kernel-relevant instruction-set flags this CPU reports (empty where unknown)."""
    flags = set((_cpuinfo_field("flags") or _cpuinfo_field("Features") or "").split())
    return [flag for flag in _KERNEL_FLAGS if flag in flags]


def torch_kernels() -> dict[str, Any]:
    """The kernels torch runs here: ATen's CPU capability, its BLAS, and for each dtype
    whether carpool's Linear layers take oneDNN's prepacked path. Empty when torch has not
    been imported (nothing here imports it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    from carpool.models import onednn

    blas = "mkl" if torch.backends.mkl.is_available() else "openblas/other"
    linear = {
        name: onednn.kernel_name(onednn.can_prepack(getattr(torch, name)))
        for name in ("float32", "bfloat16")
    }
    return {
        "isa_caps": {name: os.environ[name] for name in ISA_CAPS if name in os.environ},
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": blas,
        "onednn": torch.backends.mkldnn.is_available(),
        "linear": linear,
    }


def model_kernels(modules: list[Any]) -> dict[str, str]:
    """How these torch modules' carpool Linear layers run: ``{"model_linear": path}``,
    ``int8-dynamic``, ``carpool-packed`` (a generation model's float32 layers where carpool's
    kernels build), ``onednn-prepacked`` (carpool's text encoder and generation models
    where the CPU supports it) or ``aten-linear``; empty without modules."""
    if not modules:
        return {}
    from carpool.models import onednn

    paths = {onednn.linear_path(module) for module in modules}
    for path in (onednn.INT8_KERNEL, onednn.CARPOOL_PACKED_KERNEL, onednn.kernel_name(True)):
        if path in paths:
            return {"model_linear": path}
    return {"model_linear": onednn.kernel_name(False)}
