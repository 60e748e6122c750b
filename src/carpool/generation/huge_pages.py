"""The tensors a decode step streams through, on transparent huge pages where Linux has them.

A decode step reads every packed weight once and every running sequence's K/V once per
layer: hundreds of MB a step, in 4 KiB pages a translation each. On 2 MiB pages the same
reads need 512 times fewer, and the processor's table walks stop stalling the stream
(docs/benchmarks.md, "Huge pages"). Linux gives an anonymous mapping 2 MiB pages when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always``, or ``madvise`` and the
mapping asks (``MADV_HUGEPAGE``), which is what :func:`zeros` does: the tensor's memory is
an anonymous ``mmap`` of its own, started on a 2 MiB boundary and asked for huge pages
before any page of it is touched, then written once (the kernel faults it in 2 MiB at a
time), and freed with the tensor.

Where that cannot be (not Linux, transparent huge pages ``never`` or absent, a mapping
refused, ``CARPOOL_HUGE_PAGES=off``) :func:`zeros` returns ``torch.zeros`` and
:func:`setting` says why, once, in the log. Nothing else changes: the tensor is read and
written as any other.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV = "CARPOOL_HUGE_PAGES"  # "off": plain allocations
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE_BYTES = 2 << 20
MIN_BYTES = HUGE_PAGE_BYTES  # smaller tensors would not fill one huge page
PAGE_BYTES = mmap.PAGESIZE
_ANONYMOUS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)


@functools.cache
def setting() -> str:
    """``"madvise"`` or ``"always"`` where :func:`zeros` gets huge pages, else
    ``"off: <why>"``: :func:`read_setting`, once per process (``setting.cache_clear()``
    reads it again), and logged when off."""
    found = read_setting()
    if found.startswith("off"):
        logger.info("huge pages %s; tensors use 4 KiB pages", found)
    return found


def read_setting() -> str:
    """What ``CARPOOL_HUGE_PAGES`` and the kernel's transparent huge pages allow now."""
    if os.environ.get(ENV, "").strip().lower() == "off":
        return f"off: {ENV}=off"
    if platform.system() != "Linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"off: not Linux ({platform.system()})"
    try:
        text = THP_ENABLED.read_text()
    except OSError as error:
        return f"off: no transparent huge pages ({error.strerror}: {THP_ENABLED})"
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()
    if chosen in ("always", "madvise"):
        return chosen
    return f"off: transparent huge pages are '{chosen}' ({THP_ENABLED})"


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """:func:`placed_zeros` without saying where."""
    return placed_zeros(shape, dtype)[0]


def placed_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """A CPU tensor of zeros of ``shape`` and ``dtype``, and where it is: on huge pages
    (:func:`setting`'s ``madvise`` or ``always``) where they apply and the tensor fills at
    least one (:data:`MIN_BYTES`), else ``torch.zeros`` and ``"off: <why>"`` (a refused
    mapping also logs one line)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    data, where = _mapped(nbytes)
    if data is None:
        return torch.zeros(shape, dtype=dtype), where
    return data.view(dtype).view(shape), where


def copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in a contiguous tensor on huge pages (the tensor itself where
    they do not apply: another device, a tensor smaller than one, a refused mapping)."""
    if tensor.device.type != "cpu":
        return tensor
    data, _ = _mapped(tensor.numel() * tensor.element_size())
    if data is None:
        return tensor
    out = data.view(tensor.dtype).view(tuple(tensor.shape))
    out.copy_(tensor)
    return out


def _mapped(nbytes: int) -> tuple[torch.Tensor | None, str]:
    """``nbytes`` of zeroed uint8 on huge pages and :func:`setting`, or None and why not.

    The mapping starts on a 2 MiB boundary (a mapping that does not gets huge pages only
    where a whole aligned 2 MiB of it lies) and every page of it is written once here, as
    ``torch.zeros`` writes its memory: the memory is taken now, so running short of it
    fails at start-up, and no later read lands on the kernel's shared zero page."""
    found = setting()
    if found.startswith("off"):
        return None, found
    if nbytes < MIN_BYTES:
        return None, f"off: {nbytes} bytes, under one huge page"
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as error:
        logger.info("huge pages: a %d-byte mapping was refused (%s); 4 KiB pages", nbytes, error)
        return None, f"off: the mapping was refused ({error})"
    # frombuffer keeps `region` alive as long as the tensor (or any view of it) lives.
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    data = raw[start : start + nbytes]
    data[::PAGE_BYTES].fill_(0)  # every page taken now
    return data, found
