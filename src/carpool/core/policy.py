"""Batch policy and per-class policy, validated once when built.

A :class:`BatchPolicy` holds the model-wide limits and an ordered tuple of
:class:`ClassPolicy` (highest priority first). A class field left as ``None``
inherits the model-wide value; :attr:`BatchPolicy.limits` holds the resolved
values per class so the hot path never looks twice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from carpool.core.layout import LengthBuckets
from carpool.errors import ConfigError

CostFn = Callable[[Any], float]

# ``max_delay_s`` and ``max_batch_size`` may be this: chosen from the traffic by
# :mod:`carpool.core.adaptive` instead of fixed.
AUTO = "auto"
# ``max_batch_size: auto`` never runs a batch larger than this (a class's own
# ``max_batch_size``, ``max_batch_cost`` and ``max_batch_tokens`` still cap it lower).
AUTO_MAX_BATCH_SIZE = 256
# Under ``max_delay_s: auto``, the window of a class before its batches were measured.
COLD_START_DELAY_S = 0.001
# Under ``max_delay_s: auto``, the longest any request waits for company, whatever its SLO.
MAX_AUTO_DELAY_S = 0.1
# What the adaptive controller measures a batch in (:attr:`BatchPolicy.budget_unit`).
UNIT_ITEMS = "items"
UNIT_TOKENS = "tokens"
UNIT_COST = "cost"


def _check_int(field_name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field_name, value, f"an integer >= {minimum}")


def _check_optional_int(field_name: str, value: object, *, minimum: int) -> None:
    if value is not None:
        _check_int(field_name, value, minimum=minimum)


def _check_float(field_name: str, value: object, *, minimum: float, strict: bool = False) -> None:
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > minimum if strict else value >= minimum)
    )
    if not ok:
        op = ">" if strict else ">="
        raise ConfigError(field_name, value, f"a finite number {op} {minimum}")


def _check_delay(field_name: str, value: object) -> None:
    """A delay: a number of seconds >= 0, or "auto"."""
    if value != AUTO:
        try:
            _check_float(field_name, value, minimum=0.0)
        except ConfigError:
            raise ConfigError(field_name, value, 'a finite number >= 0.0, or "auto"') from None


def _check_optional_float(
    field_name: str, value: object, *, minimum: float, strict: bool = False
) -> None:
    if value is not None:
        _check_float(field_name, value, minimum=minimum, strict=strict)


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    """One priority class. Fields left ``None`` inherit the model-wide policy.

    ``share`` is the fraction of replicas that batches led by this class may occupy at
    once (at least one). ``max_wait_s`` is the aging bound: a request that has waited
    longer is served before any younger request of any class, so no class starves.
    ``slo_s`` is the end-to-end latency target that SLO attainment is measured against,
    and under ``max_delay_s: "auto"`` the budget the controller keeps the class within
    (the model's ``slo_s`` when ``None``). ``max_delay_s`` may be ``"auto"``.
    ``max_queue_time_s`` bounds the class's queue in time (the model's when ``None``):
    see :attr:`BatchPolicy.max_queue_time_s`.
    """

    name: str
    max_batch_size: int | None = None
    max_delay_s: float | str | None = None
    max_queue_size: int | None = None
    timeout_s: float | None = None
    share: float = 1.0
    max_wait_s: float | None = None
    slo_s: float | None = None
    max_queue_time_s: float | str | None = None

    def __post_init__(self) -> None:
        where = f"classes[{self.name!r}]"
        if not self.name or not isinstance(self.name, str):
            raise ConfigError("classes[].name", self.name, "a non-empty string")
        _check_optional_int(f"{where}.max_batch_size", self.max_batch_size, minimum=1)
        if self.max_delay_s is not None:
            _check_delay(f"{where}.max_delay_s", self.max_delay_s)
        _check_optional_int(f"{where}.max_queue_size", self.max_queue_size, minimum=1)
        _check_optional_float(f"{where}.timeout_s", self.timeout_s, minimum=0.0, strict=True)
        _check_optional_float(f"{where}.max_wait_s", self.max_wait_s, minimum=0.0)
        _check_optional_float(f"{where}.slo_s", self.slo_s, minimum=0.0, strict=True)
        if self.max_queue_time_s is not None:
            _check_delay(f"{where}.max_queue_time_s", self.max_queue_time_s)
        share = self.share
        if isinstance(share, bool) or not (isinstance(share, int | float) and 0.0 < share <= 1.0):
            raise ConfigError(f"{where}.share", self.share, "a number in (0, 1]")


DEFAULT_CLASSES: tuple[ClassPolicy, ...] = (
    ClassPolicy("interactive", slo_s=0.1),
    ClassPolicy("normal", max_wait_s=1.0, slo_s=1.0),
    ClassPolicy("background", share=0.5, max_wait_s=5.0, slo_s=30.0),
)
DEFAULT_CLASS = "normal"


@dataclass(frozen=True, slots=True)
class ClassLimits:
    """The resolved limits of one class (no ``None`` left where a default exists)."""

    name: str
    rank: int
    max_batch_size: int
    max_delay_s: float
    max_queue_size: int | None
    timeout_s: float | None
    share: float
    max_wait_s: float | None
    slo_s: float | None
    # The longest predicted wait a request is admitted with; with is_auto_queue_time,
    # what slo_s leaves (carpool.core.queue_time). None: no bound in time.
    max_queue_time_s: float | None = None
    is_auto_queue_time: bool = False
    # Chosen by the adaptive controller: the delay (max_delay_s then holds the cold-start
    # window) and the batch size (max_batch_size then holds the most it may choose).
    is_auto_delay: bool = False
    is_auto_size: bool = False

    @property
    def bounds_queue_time(self) -> bool:
        """Whether the class's queue is bounded in time (``max_queue_time_s``)."""
        return self.max_queue_time_s is not None or self.is_auto_queue_time


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """How requests of one model are grouped into batches.

    Args:
        max_batch_size: most items in one batch; ``"auto"``: the size past which the
            model's measured batch time grows as fast as the batch (at most
            :data:`AUTO_MAX_BATCH_SIZE`), see :mod:`carpool.core.adaptive`.
        max_delay_s: longest a request waits for others, counted from the arrival of
            the oldest waiting request; ``"auto"``: chosen at each free replica from
            the arrival rate and the measured batch times, within ``slo_s``.
        preferred_batch_sizes: sizes to send as soon as the queue can fill one (the
            largest that fits) when a replica is free.
        max_batch_cost: budget of one batch in the units of ``cost_fn`` (tokens,
            pixels, rows); ``None`` means no budget.
        cost_fn: cost of one request's payload; defaults to its number of items.
        max_queue_size: most requests waiting across all classes.
        max_queue_time_s: a queue bound in time, per class: a request is refused at
            admission (:class:`~carpool.errors.QueueTooLong`, a kind of ``QueueFull``)
            when the work queued ahead of it, at the batch times measured, would keep it
            waiting longer than this; ``"auto"``: when its answer would come after the
            80% of its class's ``slo_s`` the adaptive controller plans with
            (:mod:`carpool.core.queue_time`). ``None``: no bound.
        timeout_s: default deadline of a request, counted from its arrival.
        classes: priority classes, highest first.
        default_class: the class of a request that names none.
        fill_from_lower: fill a batch's leftover room with lower-class requests.
        oom_recovery_s: after an out-of-memory split, how long without another before
            the effective max batch size doubles back towards ``max_batch_size``.
        max_batch_tokens: budget of one batch in tokens (variable-length items, with a
            ``packed`` or ``padded`` collator): the sum of the lengths when packed, the
            number of items times the longest (rounded up as padded) when padded.
        length_buckets: a batch takes only items whose length falls in the bucket of its
            oldest request: ascending inclusive upper edges, or "auto" (quantiles of
            recently seen lengths); ``None`` mixes all lengths.
        batch_timeout_s: longest one model call may run (on a replica thread, or an
            ``async`` model): past it the batch's requests fail with
            :class:`~carpool.errors.BatchTimeout` and a threaded replica is replaced by a
            fresh one (its stuck thread is left behind); ``None`` waits for ever.
        slo_s: the model's latency target, inherited by classes that set none (and by
            the default classes, whose targets are defaults): with ``"auto"`` the
            controller never lets a request wait past it less its predicted compute.
        preempt: a batch of a higher class may start while a lower-class batch computes
            in steps on the event loop (:mod:`carpool.core.stepwise`): the lower one
            waits at its next step until the higher one is done. The model's steps must
            keep their state in the generator, as two calls are then in progress at once.

    Raises:
        ConfigError: naming the first invalid field.
    """

    max_batch_size: int | str = 32
    max_delay_s: float | str = 0.005
    preferred_batch_sizes: tuple[int, ...] = ()
    max_batch_cost: float | None = None
    cost_fn: CostFn | None = None
    max_queue_size: int | None = None
    timeout_s: float | None = None
    classes: tuple[ClassPolicy, ...] = DEFAULT_CLASSES
    default_class: str = DEFAULT_CLASS
    fill_from_lower: bool = True
    oom_recovery_s: float = 30.0
    max_batch_tokens: int | None = None
    length_buckets: tuple[int, ...] | str | None = None
    batch_timeout_s: float | None = 60.0
    slo_s: float | None = None
    preempt: bool = False
    max_queue_time_s: float | str | None = None
    limits: dict[str, ClassLimits] = field(init=False, repr=False, compare=False)
    # max_batch_size as a number: AUTO_MAX_BATCH_SIZE under "auto".
    size_limit: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_batch_size != AUTO:
            try:
                _check_int("max_batch_size", self.max_batch_size, minimum=1)
            except ConfigError:
                raise ConfigError(
                    "max_batch_size", self.max_batch_size, 'an integer >= 1, or "auto"'
                ) from None
        limit = AUTO_MAX_BATCH_SIZE if self.max_batch_size == AUTO else self.max_batch_size
        assert isinstance(limit, int)
        object.__setattr__(self, "size_limit", limit)
        _check_delay("max_delay_s", self.max_delay_s)
        _check_optional_float("slo_s", self.slo_s, minimum=0.0, strict=True)
        _check_optional_float("max_batch_cost", self.max_batch_cost, minimum=0.0, strict=True)
        _check_optional_int("max_queue_size", self.max_queue_size, minimum=1)
        if self.max_queue_time_s is not None:
            _check_delay("max_queue_time_s", self.max_queue_time_s)
        _check_optional_float("timeout_s", self.timeout_s, minimum=0.0, strict=True)
        _check_float("oom_recovery_s", self.oom_recovery_s, minimum=0.0)
        _check_optional_int("max_batch_tokens", self.max_batch_tokens, minimum=1)
        timeout_s = self.batch_timeout_s
        if timeout_s is not None and not (
            isinstance(timeout_s, int | float)
            and not isinstance(timeout_s, bool)
            and math.isfinite(timeout_s)
            and timeout_s > 0
        ):
            raise ConfigError(
                "batch_timeout_s", timeout_s, "a finite number of seconds > 0, or None for no limit"
            )
        for flag in ("fill_from_lower", "preempt"):
            if not isinstance(getattr(self, flag), bool):  # "no" would be truthy
                raise ConfigError(flag, getattr(self, flag), "True or False")
        buckets = self.length_buckets
        if buckets is not None:
            if not isinstance(buckets, str | list | tuple):
                raise ConfigError(
                    "length_buckets", buckets, '"auto" or a list of ascending integer edges'
                )
            buckets = buckets if isinstance(buckets, str) else tuple(buckets)
            LengthBuckets(buckets)  # validates the edges
            object.__setattr__(self, "length_buckets", buckets)
        if self.cost_fn is not None and not callable(self.cost_fn):
            raise ConfigError("cost_fn", self.cost_fn, "a callable taking one payload")
        preferred = _sequence("preferred_batch_sizes", self.preferred_batch_sizes, "sizes")
        for size in preferred:
            _check_int("preferred_batch_sizes[]", size, minimum=1)
            if size > self.size_limit:
                raise ConfigError(
                    "preferred_batch_sizes",
                    preferred,
                    f"sizes no larger than max_batch_size={self.size_limit}",
                )
        object.__setattr__(self, "preferred_batch_sizes", tuple(sorted(set(preferred))))
        classes = _sequence("classes", self.classes, "ClassPolicy values")
        if not classes:
            raise ConfigError("classes", classes, "at least one class")
        for c in classes:
            if not isinstance(c, ClassPolicy):
                raise ConfigError("classes[]", c, "a ClassPolicy(name, ...)")
        names = [c.name for c in classes]
        if len(set(names)) != len(names):
            raise ConfigError("classes", names, "unique class names")
        if self.default_class not in names:
            raise ConfigError("default_class", self.default_class, f"one of {names}")
        object.__setattr__(self, "classes", classes)
        object.__setattr__(
            self, "limits", {c.name: self._resolve(c, i) for i, c in enumerate(classes)}
        )

    def _resolve(self, c: ClassPolicy, rank: int) -> ClassLimits:
        delay = self.max_delay_s if c.max_delay_s is None else c.max_delay_s
        slo_s = c.slo_s
        if self.slo_s is not None and (c.slo_s is None or self.classes is DEFAULT_CLASSES):
            slo_s = self.slo_s
        queue_time = self.max_queue_time_s if c.max_queue_time_s is None else c.max_queue_time_s
        if queue_time == AUTO and slo_s is None:
            raise ConfigError(
                f"classes[{c.name!r}].max_queue_time_s",
                queue_time,
                'a number of seconds: "auto" bounds the wait by slo_s, and the class has none',
            )
        return ClassLimits(
            name=c.name,
            rank=rank,
            max_batch_size=min(c.max_batch_size or self.size_limit, self.size_limit),
            max_delay_s=COLD_START_DELAY_S if isinstance(delay, str) else delay,
            max_queue_size=c.max_queue_size,
            timeout_s=self.timeout_s if c.timeout_s is None else c.timeout_s,
            share=c.share,
            max_wait_s=c.max_wait_s,
            slo_s=slo_s,
            max_queue_time_s=None if isinstance(queue_time, str) else queue_time,
            is_auto_queue_time=queue_time == AUTO,
            is_auto_delay=delay == AUTO,
            is_auto_size=self.max_batch_size == AUTO and c.max_batch_size is None,
        )

    @property
    def budget_unit(self) -> str:
        """What the adaptive controller counts a batch in: its batch times follow the
        budget that limits it, so ``"tokens"`` under ``max_batch_tokens``, else
        ``"cost"`` under ``max_batch_cost``, else ``"items"``."""
        if self.max_batch_tokens is not None:
            return UNIT_TOKENS
        return UNIT_COST if self.max_batch_cost is not None else UNIT_ITEMS

    def unit_limit(self, limits: ClassLimits) -> float:
        """The most a batch led by class ``limits`` may hold, in :attr:`budget_unit`."""
        if self.max_batch_tokens is not None:
            return float(self.max_batch_tokens)
        if self.max_batch_cost is not None:
            return self.max_batch_cost
        return float(limits.max_batch_size)

    @property
    def is_adaptive(self) -> bool:
        """Whether some class's delay or batch size is chosen from the traffic."""
        return any(lim.is_auto_delay or lim.is_auto_size for lim in self.limits.values())

    def replace(self, **changes: Any) -> BatchPolicy:
        """A copy with ``changes`` applied and validated again."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self) if f.init}
        if unknown:
            raise ConfigError(
                "policy", sorted(unknown), "fields of BatchPolicy (max_batch_size, ...)"
            )
        return dataclasses.replace(self, **changes)

    def max_queued(self, name: str | None) -> int | None:
        """The most requests of class ``name`` (the default class for ``None``) that can
        wait at once: the smaller of the model's and the class's queue bounds (an unknown
        class: the model's), None when neither is set."""
        limits = self.limits.get(self.default_class if name is None else name)
        bounds = (self.max_queue_size, limits.max_queue_size if limits is not None else None)
        return min((b for b in bounds if b is not None), default=None)

    def class_limits(self, name: str | None) -> ClassLimits:
        """Resolved limits of class ``name`` (the default class for ``None``)."""
        try:
            return self.limits[self.default_class if name is None else name]
        except KeyError:
            raise ConfigError("priority", name, f"one of {list(self.limits)}") from None


def _sequence(field: str, value: Any, what: str) -> tuple[Any, ...]:
    """``value`` as a tuple, when it is a list, tuple or set of ``what``."""
    if not isinstance(value, list | tuple | set | frozenset):
        raise ConfigError(field, value, f"a list of {what}")
    return tuple(value)
