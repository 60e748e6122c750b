"""Checks a request must pass before it is queued: items, signature, cost, deadline.

Pure functions of the payload, the policy and the time; each raises
:class:`~carpool.errors.InvalidInput` naming what was wrong and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

from carpool.core.collate import Collator
from carpool.core.policy import BatchPolicy, ClassLimits
from carpool.errors import InvalidInput


def inspect_payload(collator: Collator, payload: Any, is_many: bool) -> tuple[int, Hashable]:
    """The payload's item count and the signature that must match to share a batch."""
    try:
        num_items = collator.num_items(payload) if is_many else 1
        signature = collator.signature(payload, is_many)
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        raise InvalidInput(f"payload cannot be batched ({type(exc).__name__}: {exc})") from exc
    if num_items < 1:
        raise InvalidInput("submit_many got 0 items; expected at least one along axis 0")
    return num_items, signature


def request_cost(
    policy: BatchPolicy, limits: ClassLimits, payload: Any, num_items: int, cost: float | None
) -> float:
    """The request's cost (given, from ``cost_fn``, or its item count), checked to fit."""
    if num_items > limits.max_batch_size:
        raise InvalidInput(
            f"the request carries {num_items} items, more than max_batch_size="
            f"{limits.max_batch_size} of class {limits.name!r}; split it into smaller requests"
        )
    if cost is None and policy.cost_fn is not None:
        try:
            cost = float(policy.cost_fn(payload))
        except (TypeError, ValueError, AttributeError, IndexError, KeyError) as exc:
            raise InvalidInput(
                f"cost_fn could not price this payload ({type(exc).__name__}: {exc})"
            ) from exc
    elif cost is None:
        cost = num_items
    if isinstance(cost, bool) or not (
        isinstance(cost, int | float) and math.isfinite(cost) and cost >= 0
    ):
        raise InvalidInput(f"cost={cost!r}: expected a finite number >= 0")
    if policy.max_batch_cost is not None and cost > policy.max_batch_cost:
        raise InvalidInput(
            f"the request costs {cost:g}, more than max_batch_cost={policy.max_batch_cost:g}; "
            "it could never fit in a batch"
        )
    return float(cost)


def deadline(now: float, timeout_s: float | None, limits: ClassLimits) -> float | None:
    """When the request expires: ``timeout_s`` or the class default from ``now``; or never."""
    if timeout_s is None:
        timeout_s = limits.timeout_s
        if timeout_s is None:
            return None
    elif isinstance(timeout_s, bool) or not (
        isinstance(timeout_s, int | float) and timeout_s > 0 and math.isfinite(timeout_s)
    ):
        raise InvalidInput(f"timeout_s={timeout_s!r}: expected a finite number of seconds > 0")
    return now + timeout_s
