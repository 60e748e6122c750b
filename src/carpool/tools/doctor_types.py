"""The values ``carpool doctor`` passes between its measuring (``doctor.py``) and its
report (``doctor_report.py``): what to measure, and what was measured and concluded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from carpool.errors import ConfigError
from carpool.tools.doctor_checks import InvarianceVerdict, LengthReport
from carpool.tools.doctor_sweep import BatchTiming, KneeVerdict, MemoryVerdict


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    """What to measure. ``shape`` is one item's shape; ``-1`` marks the variable dim."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    max_batch: int = 128
    device: str = "cpu"
    repeats: int = 15
    warmup: int = 3
    seed: int = 0
    memory_budget_bytes: int | None = None
    lengths: tuple[int, ...] = ()
    pad_axis: int | None = None
    num_probes: int = 3
    rtol: float | None = None
    knee_gain: float = 1.3
    input_name: str | None = None
    length_batch_size: int = 16

    def __post_init__(self) -> None:
        if not self.shape or any(d == 0 or d < -1 for d in self.shape):
            raise ConfigError("shape", self.shape, "positive dims, with -1 for a variable one")
        if sum(d == -1 for d in self.shape) > 1:
            raise ConfigError("shape", self.shape, "at most one variable (-1) dim")
        if self.dtype != "bfloat16":
            try:
                np.dtype(self.dtype)
            except TypeError:
                raise ConfigError("dtype", self.dtype, "a dtype name such as float32") from None
        if self.max_batch < 1:
            raise ConfigError("max_batch", self.max_batch, "an integer >= 1")
        if self.rtol is not None and not self.rtol >= 0:
            raise ConfigError("rtol", self.rtol, "a tolerance >= 0")
        if self.repeats < 1:
            raise ConfigError("repeats", self.repeats, "an integer >= 1")
        if self.warmup < 0:
            raise ConfigError("warmup", self.warmup, "an integer >= 0")
        if any(n < 1 for n in self.lengths):
            raise ConfigError("lengths", self.lengths, "positive lengths")
        if self.lengths and self.variable_axis is None:
            raise ConfigError("lengths", self.lengths, "a --shape with a -1 dim or a --pad-axis")
        if -1 in self.shape and not self.lengths:
            raise ConfigError("lengths", self.lengths, "--lengths when --shape has a -1 dim")
        if self.pad_axis is not None and not 0 <= self.pad_axis < len(self.shape):
            raise ConfigError("pad_axis", self.pad_axis, f"an item axis in [0, {len(self.shape)})")
        if not self.knee_gain > 1.0:  # NaN too
            raise ConfigError("knee_gain", self.knee_gain, "a throughput gain > 1.0")
        if self.num_probes < 1:
            raise ConfigError("num_probes", self.num_probes, "an integer >= 1")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise ConfigError("memory_budget_bytes", self.memory_budget_bytes, "bytes, above 0")

    @property
    def variable_axis(self) -> int | None:
        """The item axis whose length varies: the ``-1`` dim, else ``pad_axis``."""
        return self.shape.index(-1) if -1 in self.shape else self.pad_axis

    def item_shape(self, length: int | None = None) -> tuple[int, ...]:
        """One item's concrete shape, with the variable axis set to ``length`` if given."""
        axis = self.variable_axis
        dims = list(self.shape)
        if axis is not None and (length is not None or dims[axis] == -1):
            dims[axis] = length if length is not None else max(self.lengths)
        return tuple(dims)

    @property
    def sweep_length(self) -> int | None:
        """The length the sweep runs at: the longest one (worst case for memory and time)."""
        return max(self.lengths) if self.lengths else None


@dataclass(frozen=True, slots=True)
class DoctorReport:
    """Everything ``carpool doctor`` measured and concluded about one model."""

    source: str
    options: DoctorOptions
    machine: dict[str, Any]
    memory_kind: str  # rss | cuda
    sweep: list[BatchTiming]
    knee: KneeVerdict
    memory: MemoryVerdict | None
    invariance: InvarianceVerdict
    lengths: LengthReport | None
