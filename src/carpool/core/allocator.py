"""glibc's malloc set for batch after batch of large temporary arrays.

A model's activations are fresh arrays of a few hundred KiB to tens of MiB each batch or
step. glibc's defaults serve those from ``mmap`` (above a threshold that starts at
128 KiB) and give the top of the heap back to the kernel when more than a trim threshold
is free there, so each batch page-faults its arrays in again: a prefill step of 1024
tokens on the small Llama of the generation benchmarks spent about a sixth of its time
there (docs/benchmarks.md, "The process's allocator"). :func:`tune_malloc` raises both
thresholds (:data:`MMAP_THRESHOLD_BYTES`, :data:`TRIM_THRESHOLD_BYTES`) so that freed
memory is kept and reused; allocations larger than the mmap threshold still go to
``mmap``. The cost: the process keeps up to :data:`TRIM_THRESHOLD_BYTES` of freed memory
instead of returning it at once.

``carpool serve`` calls it before its models load (and says what was done among its
ready lines, :func:`setting`: an error before then stays the only line it prints), and
each replica process as it starts; nothing else does (importing carpool changes no
process setting).
``CARPOOL_MALLOC=default`` leaves glibc's settings alone; where another allocator is
preloaded (tcmalloc, jemalloc, as vLLM's CPU build does) or the C library is not glibc,
nothing is changed either. Each case says so in the line returned.
"""

from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
ENV = "CARPOOL_MALLOC"  # "default": leave the C library's allocator as it is
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_PRELOADED = ("tcmalloc", "jemalloc", "mimalloc")
_last: list[str] = []  # what the last call of tune_malloc did


def setting() -> str | None:
    """The line :func:`tune_malloc` returned in this process, or None if it never ran."""
    return _last[-1] if _last else None


def tune_malloc() -> str:
    """Raise glibc's mmap and trim thresholds for this process, where that applies;
    returns one line saying what was done or why nothing was (also kept for
    :func:`setting`). Never raises."""
    line = _tune()
    _last[:] = [line]
    return line


def _tune() -> str:
    if os.environ.get(ENV, "") == "default":
        return f"malloc: glibc's defaults kept ({ENV}=default)"
    preloaded = [name for name in _PRELOADED if name in os.environ.get("LD_PRELOAD", "")]
    if preloaded:
        return f"malloc: {preloaded[0]} is preloaded; left as it is"
    libc_name, _ = platform.libc_ver()
    if platform.system() != "Linux" or libc_name != "glibc":
        return f"malloc: not glibc ({platform.system()} {libc_name or 'unknown libc'}); unchanged"
    try:
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        done = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and done
    except (OSError, AttributeError) as error:
        return f"malloc: glibc's mallopt is not reachable ({error}); unchanged"
    if not done:
        return "malloc: glibc refused the thresholds; its defaults are in force"
    return (
        f"malloc: glibc keeps freed memory for reuse (mmap threshold "
        f"{MMAP_THRESHOLD_BYTES >> 20} MiB, trim threshold {TRIM_THRESHOLD_BYTES >> 20} MiB; "
        f"{ENV}=default keeps its defaults)"
    )
