"""The checks of a :class:`~carpool.core.batcher.Batcher`'s own arguments, made when it is
built (a policy's fields are checked by :class:`~carpool.core.policy.BatchPolicy`)."""

from __future__ import annotations

import math

from carpool.core.policy import BatchPolicy
from carpool.errors import ConfigError


def check_options(
    policy: object,
    name: object,
    clock: object,
    slow_request_s: object,
    *hooks: object,
) -> None:
    """Refuse a Batcher argument of the wrong kind when it is built: otherwise a hook that
    is not callable fails every batch (logged and skipped) and a policy dict fails with an
    AttributeError far from the call that passed it."""
    if policy is not None and not isinstance(policy, BatchPolicy):
        raise ConfigError(
            "policy", policy, "a BatchPolicy, as Batcher(fn, BatchPolicy(max_batch_size=64))"
        )
    if name is not None and not isinstance(name, str):
        raise ConfigError("name", name, "a string or None")
    if clock is not None and not all(callable(getattr(clock, m, None)) for m in ("now", "call_at")):
        raise ConfigError("clock", clock, "a Clock: an object with now() and call_at()")
    if slow_request_s is not None and not (
        isinstance(slow_request_s, int | float)
        and not isinstance(slow_request_s, bool)
        and 0 <= slow_request_s < math.inf
    ):
        raise ConfigError("slow_request_s", slow_request_s, "a finite number of seconds >= 0")
    expected = (
        ("fn", "a callable taking one batch"),
        ("fn_factory", "a callable taking a device string and returning the model"),
        ("on_trace", "a callable taking a RequestTrace, or None"),
        ("memory_probe", "a callable returning (used_bytes, total_bytes), or None"),
        ("policy_check", "a callable taking a BatchPolicy, or None"),
    )
    for (hook_name, what), hook in zip(expected, hooks, strict=True):
        if hook is not None and not callable(hook):
            raise ConfigError(hook_name, hook, what)
