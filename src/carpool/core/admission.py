"""Checks a request must pass before it is queued: items, signature, cost, lengths,
deadline; and the out-of-memory cap that lowers the batch size for a while.

Each check raises :class:`~carpool.errors.InvalidInput` naming what was wrong and what
was expected.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable
from typing import Any

from carpool.core.buffer_pool import BufferPool
from carpool.core.collate import Collator, collator_for
from carpool.core.collate_pool import pooled
from carpool.core.layout import LengthBuckets
from carpool.core.policy import BatchPolicy, ClassLimits
from carpool.core.request import Request
from carpool.errors import ConfigError, InvalidInput


def inspect_payload(collator: Collator, payload: Any, is_many: bool) -> tuple[int, Hashable]:
    """The payload's item count and the signature that must match to share a batch."""
    num_items = _num_items(collator, payload) if is_many else 1
    if num_items < 1:  # before the signature, which may look at the first item
        raise InvalidInput("submit_many got 0 items; expected at least one along axis 0")
    try:
        signature = collator.signature(payload, is_many)
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        raise InvalidInput(f"payload cannot be batched ({type(exc).__name__}: {exc})") from exc
    return num_items, signature


def _num_items(collator: Collator, payload: Any) -> int:
    """How many items a ``submit_many`` payload carries along axis 0; a payload with no
    axis 0 (a number, None, a 0-d array) is refused naming what it was and ``submit``."""
    try:
        return collator.num_items(payload)
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        if hasattr(payload, "__len__") and getattr(payload, "ndim", 1) != 0:
            raise InvalidInput(f"payload cannot be batched ({type(exc).__name__}: {exc})") from exc
        try:
            shown = repr(payload)
        except Exception:  # a payload's own __repr__ failing must not hide the message
            shown = "(no repr)"
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise InvalidInput(
            f"submit_many got {type(payload).__name__} {shown}: expected k items along "
            "axis 0 (a list, a tuple, an array or a dict of arrays with a batch dimension); "
            f"for one item use submit() ({type(exc).__name__}: {exc})"
        ) from exc


def request_cost(
    policy: BatchPolicy, limits: ClassLimits, payload: Any, num_items: int, cost: float | None
) -> float:
    """The request's cost (given, from ``cost_fn``, or its item count), checked to fit."""
    if num_items > limits.max_batch_size:
        raise InvalidInput(
            f"the request carries {num_items} items, more than max_batch_size="
            f"{limits.max_batch_size} of class {limits.name!r}; split it into smaller requests"
        )
    cost_fn = policy.cost_fn
    if cost is None and cost_fn is None:
        cost = num_items  # a count >= 1: nothing to check (the common case, per request)
    else:
        if cost is None and cost_fn is not None:
            try:
                cost = float(cost_fn(payload))
            except (TypeError, ValueError, AttributeError, IndexError, KeyError) as exc:
                raise InvalidInput(
                    f"cost_fn could not price this payload ({type(exc).__name__}: {exc})"
                ) from exc
        if isinstance(cost, bool) or not (
            isinstance(cost, numbers.Real) and math.isfinite(cost) and cost >= 0
        ):
            raise InvalidInput(f"cost={cost!r}: expected a finite number >= 0")
    if policy.max_batch_cost is not None and cost > policy.max_batch_cost:
        raise InvalidInput(
            f"the request costs {cost:g}, more than max_batch_cost={policy.max_batch_cost:g}; "
            "it could never fit in a batch"
        )
    return float(cost)


def is_timeout(value: object) -> bool:
    """Whether ``value`` can be a timeout: a real number (not a bool), finite and > 0."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    number = float(value)
    return number > 0 and math.isfinite(number)


def deadline(now: float, timeout_s: float | None, limits: ClassLimits) -> float | None:
    """When the request expires: ``timeout_s`` or the class default from ``now``; or never."""
    if timeout_s is None:
        timeout_s = limits.timeout_s
        if timeout_s is None:
            return None
    elif not is_timeout(timeout_s):
        raise InvalidInput(f"timeout_s={timeout_s!r}: expected a finite number of seconds > 0")
    return now + float(timeout_s)


_COLLATOR_METHODS = ("signature", "num_items", "collate", "split")


class Intake:
    """The batcher's collator and what it knows of item lengths (token budgets, buckets).

    ``collate`` is a name ("auto", "numpy", "packed", ...) or a Collator; "auto" picks one
    from the first payload (:meth:`choose`). A collator with a ``lengths`` method (packed,
    padded) measures each request's tokens, longest item and length bucket. With a
    ``pool``, the adopted collator writes its batches into the pool's buffers
    (:mod:`carpool.core.collate_pool`).
    """

    __slots__ = (
        "_buckets",
        "_buckets_source",
        "_collate",
        "collator",
        "has_lengths",
        "pads",
        "pool",
    )

    def __init__(self, collate: str | Collator, pool: BufferPool | None = None) -> None:
        self._collate = collate
        self.pool = pool
        self.collator: Collator | None = None
        if isinstance(collate, str):
            named = collator_for(collate, None)  # validates the name now, not on the first request
            if collate != "auto":  # a named one is known now: adopted with the policy
                self.collator = named
        elif all(callable(getattr(collate, m, None)) for m in _COLLATOR_METHODS):
            self.collator = collate
        else:  # refused now, not as every request's "payload cannot be batched"
            raise ConfigError(
                "collate",
                collate,
                'a collator name ("auto", "numpy", ...) or a Collator: an object with '
                f"methods {', '.join(_COLLATOR_METHODS)}",
            )
        self.has_lengths = False
        self.pads = False
        self._buckets: LengthBuckets | None = None
        self._buckets_source: tuple[int, ...] | str | None = None

    def choose(self, payload: Any) -> Collator:
        return collator_for(self._collate, payload)

    def adopt(self, collator: Collator, policy: BatchPolicy) -> None:
        _check_tokens(policy, collator)
        self.has_lengths = hasattr(collator, "lengths")
        self.pads = bool(getattr(collator, "pads", False))
        self.collator = pooled(collator, self.pool)

    def check(self, policy: BatchPolicy) -> None:
        """Refuse a token budget that the collator in use cannot measure. None chosen yet
        means ``collate="auto"``, which never chooses one that measures lengths."""
        _check_tokens(policy, self.collator)

    def lengths(self, payload: Any, is_many: bool, policy: BatchPolicy) -> tuple[int, int, int]:
        """``(num_tokens, longest, bucket)`` of a variable-length payload, checked to fit."""
        try:
            lengths: list[int] = self.collator.lengths(payload, is_many)  # type: ignore[union-attr]
        except (TypeError, ValueError, IndexError, AttributeError) as exc:
            raise InvalidInput(f"payload has no length ({type(exc).__name__}: {exc})") from exc
        num_tokens, longest = sum(lengths), max(lengths)
        max_tokens = policy.max_batch_tokens
        if max_tokens is not None:
            need = len(lengths) * longest if self.pads else num_tokens
            if need > max_tokens:
                raise InvalidInput(
                    f"the request needs {need} tokens, more than max_batch_tokens={max_tokens}; "
                    "it could never fit in a batch"
                )
        bucket = 0
        if policy.length_buckets is not None:
            buckets = self._buckets
            if buckets is None or self._buckets_source != policy.length_buckets:
                buckets = self._buckets = LengthBuckets(policy.length_buckets)
                self._buckets_source = policy.length_buckets
            bucket = buckets.bucket_of(longest)
        return num_tokens, longest, bucket

    def token_slots(self, groups: list[list[Request]]) -> tuple[int, int]:
        """Real tokens and computed slots of a batch's model calls (padded: n x longest)."""
        tokens = slots = 0
        step = getattr(self.collator, "multiple_of", None) or 1
        for group in groups:
            num_tokens = sum(r.num_tokens for r in group)
            tokens += num_tokens
            if self.pads:
                longest = max(r.length for r in group)
                slots += sum(r.num_items for r in group) * (-(-longest // step) * step)
            else:
                slots += num_tokens
        return tokens, slots


class OomCap:
    """After an out-of-memory error the batch size is capped at half the failed batch; the
    cap doubles back once per ``policy.oom_recovery_s`` that passes without another."""

    __slots__ = ("_at_s", "_cap")

    def __init__(self) -> None:
        self._cap: int | None = None
        self._at_s = 0.0

    def note(self, num_items: int, now: float) -> None:
        cap = max(1, num_items // 2)
        self._cap = cap if self._cap is None else min(self._cap, cap)
        self._at_s = now

    def current(self, now: float, policy: BatchPolicy) -> int | None:
        """The cap now (``None``: no cap)."""
        cap = self._cap
        if cap is None:
            return None
        recovery_s = policy.oom_recovery_s
        periods = math.inf if recovery_s <= 0 else (now - self._at_s) // recovery_s
        if periods >= 1:
            max_size = policy.size_limit
            while periods >= 1 and cap < max_size:
                cap *= 2
                periods -= 1
                # The next period counts from the end of this one, not from when we looked.
                self._at_s += recovery_s
            self._cap = None if cap >= max_size else cap
        return self._cap


def _check_tokens(policy: BatchPolicy, collator: Collator | None) -> None:
    if policy.max_batch_tokens is not None and not hasattr(collator, "lengths"):
        raise ConfigError(
            "max_batch_tokens",
            policy.max_batch_tokens,
            'a variable-length collator (collate="packed" or "padded")',
        )
