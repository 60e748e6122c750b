"""The tensors a decode step streams through, on transparent huge pages where Linux has them.

A decode step reads every packed weight once and every running sequence's K/V once per
layer: hundreds of MB a step, in 4 KiB pages a translation each. On 2 MiB pages the same
reads need 512 times fewer, and the processor's table walks stop stalling the stream
(docs/benchmarks.md, "Huge pages"). Linux gives an anonymous mapping 2 MiB pages when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always``, or ``madvise`` and the
mapping asks (``MADV_HUGEPAGE``), which is what :func:`zeros` does: the tensor's memory is
an anonymous ``mmap`` of its own, asked for huge pages before any page of it is touched
(the kernel then faults it in 2 MiB at a time), and freed with the tensor.

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


def is_enabled() -> bool:
    return not setting().startswith("off")


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros of ``shape`` and ``dtype``, on huge pages where
    :func:`setting` allows and the tensor fills at least one (:data:`MIN_BYTES`): a fresh
    mapping, zero-filled by the kernel as its pages are first touched. Else
    ``torch.zeros``; a refused mapping falls back too, with one log line."""
    item = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * item
    if nbytes < MIN_BYTES or not is_enabled():
        return torch.zeros(shape, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as error:
        logger.info("huge pages: a %d-byte mapping was refused (%s); 4 KiB pages", nbytes, error)
        return torch.zeros(shape, dtype=dtype)
    # frombuffer keeps `region` alive as long as the tensor (or any view of it) lives.
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


def copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in a contiguous tensor of :func:`zeros`' memory (the tensor
    itself where huge pages do not apply: a CPU tensor smaller than one, or another
    device)."""
    if tensor.device.type != "cpu" or tensor.numel() * tensor.element_size() < MIN_BYTES:
        return tensor
    if not is_enabled():
        return tensor
    out = zeros(tuple(tensor.shape), tensor.dtype)
    out.copy_(tensor)
    return out
