"""A queue bound in time (``max_queue_time_s``): a request is refused at admission when
the work queued ahead of it would keep it waiting too long.

A bound in count (``max_queue_size``) is a bound in time only for one batch size and one
model speed: 64 queued requests are 20 ms of W1 in one batch, 150 ms one at a time, and
a second on a slower model. What a caller with a latency target cares about is when the
answer comes. So at admission the wait is predicted from what the batcher measured:

- the work ahead: the requests of the request's class and the classes above it, in
  the policy's budget unit (items, tokens or cost), plus its own;
- the batches it drains in: at most the batch cap in force (the adaptive controller's,
  as it computed it at most :data:`~carpool.core.adaptive.ADMISSION_CAP_S` ago, or the
  class's limit), each taking its measured time
  (:meth:`~carpool.core.batch_times.BatchTimes.predict_s`, the span a batch really
  took), spread over the replicas the class may use;
- the time until a replica is free: the least a batch in flight has left.

The request's batch is the last of those. ``max_queue_time_s: <seconds>`` refuses it
when the wait before its batch is longer; ``"auto"`` when the wait plus its batch's time
would take it past the share of its class's ``slo_s`` the adaptive controller plans with
(:data:`~carpool.core.adaptive.SLO_HEADROOM`; the rest is the request's reading,
decoding and answer, which the batch times do not hold): its answer could only be late, and under
overload a queue that grows past the target makes every answer late (goodput falls to
nothing), where refusing the excess at once keeps the rest within it. The refusal is a
:class:`~carpool.errors.QueueTooLong` (a ``QueueFull``: HTTP 429, gRPC UNAVAILABLE).

A request with nothing queued ahead of it is always admitted: the bound is on the queue,
not on the model, and a model slower than the target must not be shut out (nor one
whose batch times are not measured yet, or not lately: ``predict_s`` is then 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from carpool.core.adaptive import SLO_HEADROOM
from carpool.core.policy import ClassLimits
from carpool.core.queues import Queues
from carpool.core.scheduler import queue_units, share_cap
from carpool.errors import QueueTooLong


def predict_wait_s(
    queues: Queues,
    limits: ClassLimits,
    units: float,
    unit: str,
    cap_units: Callable[[], float],
    num_replicas: int,
    busy_left_s: Callable[[], float],
    predict_s: Callable[[float], float],
) -> tuple[float, float]:
    """``(wait, own)``: how long a request of ``units`` in class ``limits`` would wait for
    its batch to start, and that batch's time; ``(0, 0)`` with nothing queued ahead.
    ``cap_units`` and ``busy_left_s`` are asked only when something is."""
    ahead = sum(queue_units(q, unit) for q in queues.ordered if q.limits.rank <= limits.rank)
    if ahead <= 0:
        return 0.0, 0.0
    cap = max(1.0, cap_units())
    total = ahead + units
    num_batches = max(1, math.ceil(total / cap))
    last = total - (num_batches - 1) * cap
    replicas = share_cap(limits.share, num_replicas)
    wait_s = busy_left_s() + (num_batches - 1) * predict_s(cap) / replicas
    return wait_s, predict_s(last)


def check_queue_time(limits: ClassLimits, wait_s: float, own_s: float) -> None:
    """Raise :class:`QueueTooLong` when the predicted ``wait_s`` (and, under ``"auto"``,
    the batch's ``own_s``) breaks the class's bound in time."""
    queue = limits.name
    if limits.is_auto_queue_time:
        slo_s = limits.slo_s
        assert slo_s is not None, "the policy refuses max_queue_time_s: auto without slo_s"
        if wait_s + own_s > SLO_HEADROOM * slo_s:
            raise QueueTooLong(queue, wait_s, max(0.0, SLO_HEADROOM * slo_s - own_s), slo_s)
    elif limits.max_queue_time_s is not None and wait_s > limits.max_queue_time_s:
        raise QueueTooLong(queue, wait_s, limits.max_queue_time_s)
