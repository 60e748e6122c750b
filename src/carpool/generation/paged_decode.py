"""The C++ attention kernels over the paged KV cache, built together as one extension:
decode (``csrc/paged_decode.cpp``: each one-token chunk over its own context) and prefill
(``csrc/paged_prefill.cpp``: a multi-token chunk over its cached prefix and itself,
causally), both reading K/V in place through the sequence's block table.

The gather + SDPA path of :mod:`carpool.generation.attention` copies each decode group's
K/V blocks out of the cache, then attends; the kernel walks each sequence's blocks instead
(as vLLM's CPU attention does), one task per (sequence, KV head), with an online softmax::

    for each block of the sequence:   scores = q . K[block]     (the heads sharing the KV head)
                                      max' = max(max, scores);  sum, acc *= exp(max - max')
                                      sum += sum(exp(scores - max'));  acc += exp(..) V[block]
    out = acc / sum

The prefill kernel does the same for a chunk's query rows, in tiles of 32 rows per KV head:
a span of 128 keys is transposed once per tile, so each query's scores are whole-vector
multiply-adds (16 floats a vector with AVX-512), four query vectors sharing every load, and
the query at position p stops at key p. It replaces the two SDPA calls (the prefix, then the
chunk itself, causally) and their log-sum-exp merge of the torch path (docs/generation.md).

The same extension holds the runner's float32 Linear kernel (``csrc/packed_linear.cpp``:
weights packed once into panels, read in order; :mod:`carpool.generation.runner`) and the
Llama layer's fused elementwise ops (``csrc/fused_ops.cpp``: RMSNorm, the residual add and
RMSNorm, SiLU-and-multiply, rotary positions in place; :mod:`carpool.generation.llama`).

It is compiled on first use with ``torch.utils.cpp_extension.load`` (g++/clang and ninja;
``-O3 -march=native -fopenmp``) into ``carpool/<name>`` under torch's extension directory
(``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``), where the build is reused
by later processes; its name carries a hash of the source, its path (each checkout builds
its own: the build file names the source by its absolute path, so two trees sharing one
build would rebuild each other's), the CPU's flags and the torch version, so a build for
another CPU is never loaded. A build that fails leaves the gather + SDPA path.

One process builds at a time: each holds an exclusive ``flock`` on ``<name>.lock`` beside
the build directory while it builds or loads, which the kernel releases however the
process ends. torch marks a build in progress with a ``lock`` file of its own, which a
process killed mid-build (Ctrl-C on a first start) leaves behind, and every later build
then waits on it for ever; holding the ``flock``, a process knows that no build is in
progress, and removes such a file first.

``decode_attention`` (a generation model's config key) picks the path for both kernels:
``auto`` (the kernels if they build, else torch, with one warning saying why), ``kernel`` (a
:class:`~carpool.errors.ConfigError` naming why when they cannot run) or ``torch``.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import platform
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch

from carpool.errors import ConfigError
from carpool.models import onednn

try:
    import fcntl
except ImportError:  # not POSIX: builds are not serialized (nor a killed build's marker removed)
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

DecodeAttention = Literal["auto", "kernel", "torch"]
DECODE_ATTENTION_MODES: tuple[str, ...] = get_args(DecodeAttention)
CSRC = Path(__file__).with_name("csrc")
SOURCE_PATHS = (
    CSRC / "paged_decode.cpp",
    CSRC / "paged_prefill.cpp",
    CSRC / "packed_linear.cpp",
    CSRC / "fused_ops.cpp",
)
HEADER_PATHS = (CSRC / "attention_common.h",)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp-simd", "-fno-math-errno")
# at::parallel_for is an OpenMP loop compiled into the kernels themselves: without -fopenmp
# each kernel ran on one thread whatever torch's thread count. The build links libgomp by
# its soname, libgomp.so.1, which torch's CPU wheel has loaded already: one OpenMP runtime.
# A compiler without OpenMP (clang without libomp) builds without it: one thread, one line.
OPENMP_FLAGS = ("-fopenmp",)
# The dtypes the kernel computes in; others take the gather + SDPA path.
KERNEL_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """What building (or loading the cached build of) the kernel gave."""

    is_available: bool
    reason: str  # why it is not available; "" when it is
    build_time_s: float
    openmp: bool = True  # whether its loops run on torch's threads (else on one)


_lock = threading.Lock()
_build_result: KernelBuild | None = None


def build_name(openmp: bool = True) -> str:
    """The extension's name: a hash of the source, the compile flags, the torch version,
    the source's path and the CPU's flags (``-march=native`` code runs only where those
    flags are)."""
    digest = hashlib.sha256()
    for path in (*SOURCE_PATHS, *HEADER_PATHS):
        digest.update(path.read_bytes())
    for part in (" ".join(_cflags(openmp)).encode(), torch.__version__.encode()):
        digest.update(part)
    digest.update(str(CSRC.resolve()).encode())
    digest.update(_cpu_flags().encode())
    return f"carpool_paged_decode_{digest.hexdigest()[:16]}"


def _cflags(openmp: bool) -> list[str]:
    return [*CFLAGS, *OPENMP_FLAGS] if openmp else list(CFLAGS)


def _cpu_flags() -> str:
    """The CPU's model and feature flags (Linux: /proc/cpuinfo), else what platform says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = ("flags", "Features", "model name", "CPU part")
    found = {line.split(":")[0].strip(): line for line in lines if line.startswith(wanted)}
    return "\n".join(sorted(found.values())) or f"{platform.machine()} {platform.processor()}"


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from ``PATH``; the PyPI ``ninja`` package (the generation extra)
    installs it beside the interpreter, which is not on ``PATH`` when the virtual
    environment is not activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        bin_dir = str(importlib.import_module("ninja").BIN_DIR)
    except (ImportError, AttributeError):
        return  # torch then says that ninja is missing
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def build_directory(openmp: bool = True) -> Path:
    """Where this kernel's build lives (module docstring); created if missing."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    directory = Path(root) / "carpool" / build_name(openmp)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


# The file torch.utils.cpp_extension keeps in a build directory while it builds there
# (torch 2.13: FileBaton(os.path.join(build_directory, "lock"))).
TORCH_BUILD_MARKER = "lock"


def _build(openmp: bool = True) -> None:
    """Compiles (or reuses the cached build of) the kernel and loads it as
    ``torch.ops.carpool.paged_decode``, one process at a time (module docstring)."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    directory = build_directory(openmp)
    with open(directory.with_name(f"{directory.name}.lock"), "w") as held:
        if fcntl is not None:
            fcntl.flock(held, fcntl.LOCK_EX)  # released when this process ends, however
            # No other build is in progress: a marker left here is a killed build's.
            (directory / TORCH_BUILD_MARKER).unlink(missing_ok=True)
        cpp_extension.load(
            name=build_name(openmp),
            sources=[str(path) for path in SOURCE_PATHS],
            extra_cflags=_cflags(openmp),
            extra_ldflags=list(OPENMP_FLAGS) if openmp else [],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )


def load_kernel() -> KernelBuild:
    """Builds the kernel once per process; never raises: a failure is in ``reason``."""
    global _build_result
    with _lock:
        if _build_result is None:
            started = time.perf_counter()
            result = _try_build(True, started)
            if not result.is_available:
                logger.info(
                    "carpool kernels: no OpenMP build (%s); building them to run on one thread",
                    result.reason,
                )
                result = _try_build(False, started)
            _build_result = result
            if result.is_available:
                logger.info(
                    "paged decode kernel ready in %.1f s (%s)",
                    result.build_time_s,
                    "on torch's threads" if result.openmp else "one thread: no OpenMP",
                )
        return _build_result


def _try_build(openmp: bool, started: float) -> KernelBuild:
    try:
        _build(openmp)
        torch.ops.carpool.paged_decode  # noqa: B018 (the ops are registered)
        torch.ops.carpool.paged_prefill  # noqa: B018
        torch.ops.carpool.packed_linear  # noqa: B018
        torch.ops.carpool.rms_norm  # noqa: B018
        return KernelBuild(True, "", time.perf_counter() - started, openmp)
    except Exception as error:  # any failure leaves the torch path; never crash
        last_line = (str(error).strip().splitlines() or [""])[-1][:300]
        reason = f"{type(error).__name__}: {last_line}"
        return KernelBuild(False, reason, time.perf_counter() - started, openmp)


def use_decode_kernel(
    mode: str, device: torch.device, dtype: torch.dtype, *, field: str = "decode_attention"
) -> bool:
    """Whether decode attention runs the kernel under ``mode`` for a cache on ``device`` in
    ``dtype``. ``auto`` falls back to torch (one warning when the build fails); ``kernel``
    raises what ``auto`` would warn of.

    Raises:
        ConfigError: on ``field``: an unknown mode, or ``kernel`` where it cannot run.
    """
    if mode not in DECODE_ATTENTION_MODES:
        raise ConfigError(field, mode, f"one of {list(DECODE_ATTENTION_MODES)}")
    if mode == "torch":
        return False
    if device.type != "cpu" or dtype not in KERNEL_DTYPES:
        why = f"the kernel runs float32/float64 on the CPU, the cache is {dtype} on {device}"
        if mode == "kernel":
            raise ConfigError(field, mode, f"auto or torch: {why}")
        logger.debug("decode attention: gather + SDPA (%s)", why)
        return False
    build = load_kernel()
    if build.is_available:
        return True
    if mode == "kernel":
        raise ConfigError(field, mode, f"auto or torch: the kernel did not build ({build.reason})")
    _warn_once(build.reason)
    return False


PACKED_LINEAR = onednn.CARPOOL_PACKED_KERNEL  # the runner's Linears on csrc/packed_linear.cpp


def use_linear_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the runner's Linear layers run the extension's packed kernel: float32 on the
    CPU, the extension built, and ``CARPOOL_LINEAR_KERNEL`` not ``onednn`` or ``aten``.
    Never raises: where it cannot, one log line says why and the caller keeps oneDNN's
    prepacked kernel (or aten's)."""
    choice = onednn.linear_kernel_choice()
    if choice != "auto":
        logger.info(
            "Linear layers: %s=%s, not carpool's packed kernel", onednn.LINEAR_KERNEL_ENV, choice
        )
        return False
    return _float32_cpu_built("Linear layers: carpool's packed kernel", device, dtype)


FUSED_OPS = "carpool-fused"  # the Llama layer's elementwise steps on csrc/fused_ops.cpp
UNFUSED_OPS = "torch"


def use_fused_ops(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model's elementwise steps (norms, rotary, SiLU-and-multiply) run the
    extension's fused ops: float32 on the CPU and the extension built. Never raises: where
    they cannot, one log line says why and the model keeps its torch ops."""
    return _float32_cpu_built("fused ops", device, dtype)


def _float32_cpu_built(what: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``what`` (float32 on the CPU, from the extension) runs for ``dtype`` on
    ``device``: one log line says why not."""
    if device.type != "cpu" or dtype != torch.float32:
        logger.debug("%s: float32 on the CPU only, not %s on %s", what, dtype, device)
        return False
    build = load_kernel()
    if not build.is_available:
        logger.info("%s: the extension did not build (%s)", what, build.reason)
        return False
    return True


_warned = False


def _warn_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("decode attention: gather + SDPA, the C++ kernel did not build (%s)", reason)


def paged_prefill(
    query: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_ids: torch.Tensor,
    num_cached: int,
    scale: float,
) -> torch.Tensor:
    """One chunk of one sequence: ``query`` [n, heads, D] at positions ``num_cached`` ..
    ``num_cached + n - 1``, whose K/V are already in the cache, each over the keys up to
    its own position (causal), read in place through ``block_ids`` (the sequence's
    blocks) from ``k_blocks``/``v_blocks`` [num_blocks, block_size, kv_heads, D] ->
    [n, heads, D]. Needs :func:`load_kernel` to have succeeded."""
    out: torch.Tensor = torch.ops.carpool.paged_prefill(
        query, k_blocks, v_blocks, block_ids, num_cached, scale
    )
    return out


def paged_decode(
    query: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``query`` [n, heads, D] (one token per sequence) over the first ``lengths[i]`` keys
    of its sequence, whose blocks are row i of ``block_table`` [n, max_blocks], in the
    cache ``k_blocks``/``v_blocks`` [num_blocks, block_size, kv_heads, D] -> [n, heads, D].
    Needs :func:`load_kernel` to have succeeded."""
    out: torch.Tensor = torch.ops.carpool.paged_decode(
        query, k_blocks, v_blocks, block_table, lengths, scale
    )
    return out
