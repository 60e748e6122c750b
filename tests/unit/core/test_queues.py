"""Per-class queues: admission bounds, lazy deletion, FIFO pops, reconfiguration; and,
through the Batcher, that cancelled requests do not pile up behind a waiting head."""

from __future__ import annotations

import asyncio
import itertools
import weakref

import numpy as np
import pytest

from carpool import BatchPolicy, ClassPolicy, ConfigError, QueueFull
from carpool.core.clock import settle
from carpool.core.queues import Queues
from carpool.core.request import Request, RequestState

from .conftest import finish

_ids = itertools.count()


def _policy(**changes: object) -> BatchPolicy:
    fields: dict[str, object] = {
        "classes": (ClassPolicy("hi"), ClassPolicy("lo")),
        "default_class": "lo",
    }
    fields.update(changes)
    return BatchPolicy(**fields)  # type: ignore[arg-type]


def _request(
    class_name: str = "lo", *, num_items: int = 1, cost: float | None = None, arrival_s: float = 0.0
) -> Request:
    return Request(
        request_id=next(_ids),
        payload=None,
        num_items=num_items,
        is_many=num_items > 1,
        cost=float(num_items) if cost is None else cost,
        class_name=class_name,
        rank=0 if class_name == "hi" else 1,
        arrival_s=arrival_s,
        deadline_s=None,
        future=asyncio.get_running_loop().create_future(),
    )


def _drop(queues: Queues, request: Request) -> None:
    request.state = RequestState.CANCELLED
    queues.forget(request)


# -- admission ----------------------------------------------------------------------------


async def test_admits_into_the_queue_of_the_request_class() -> None:
    queues = Queues(_policy())
    queues.admit(_request("hi"))
    queues.admit(_request("lo"))
    queues.admit(_request("lo"))
    assert queues.pending_by_class() == {"hi": 1, "lo": 2}
    assert queues.num_live == 3


async def test_full_only_when_no_class_has_room() -> None:
    queues = Queues(_policy(classes=(ClassPolicy("hi", max_queue_size=1), ClassPolicy("lo"))))
    queues.admit(_request("hi"))
    assert queues.full() is None  # "lo" has no bound: a request for it fits
    bounded = Queues(
        _policy(classes=(ClassPolicy("hi", max_queue_size=1), ClassPolicy("lo", max_queue_size=2)))
    )
    bounded.admit(_request("hi"))
    bounded.admit(_request("lo"))
    assert bounded.full() is None
    bounded.admit(_request("lo"))
    assert isinstance(bounded.full(), QueueFull)


async def test_full_at_the_bound_across_classes() -> None:
    queues = Queues(_policy(max_queue_size=2))
    queues.admit(_request("hi"))
    assert queues.full() is None
    queues.admit(_request("lo"))
    full = queues.full()
    assert full is not None and (full.queue, full.limit) == ("all classes", 2)
    _drop(queues, queues.by_name["lo"].head())  # type: ignore[arg-type]
    assert queues.full() is None


async def test_orders_queues_by_priority() -> None:
    queues = Queues(_policy())
    assert [q.name for q in queues.ordered] == ["hi", "lo"]


async def test_rejects_when_global_bound_reached_across_classes() -> None:
    queues = Queues(_policy(max_queue_size=3))
    queues.admit(_request("hi"))
    queues.admit(_request("lo"))
    queues.admit(_request("lo"))
    with pytest.raises(QueueFull) as excinfo:
        queues.admit(_request("hi"))
    assert excinfo.value.limit == 3
    assert excinfo.value.queue == "all classes"
    assert "3 requests waiting" in str(excinfo.value)
    assert queues.num_live == 3


async def test_rejects_when_class_bound_reached_but_admits_other_classes() -> None:
    policy = _policy(classes=(ClassPolicy("hi", max_queue_size=2), ClassPolicy("lo")))
    queues = Queues(policy)
    queues.admit(_request("hi"))
    queues.admit(_request("hi"))
    with pytest.raises(QueueFull) as excinfo:
        queues.admit(_request("hi"))
    assert (excinfo.value.queue, excinfo.value.limit) == ("hi", 2)
    assert "'hi'" in str(excinfo.value)
    queues.admit(_request("lo"))
    assert queues.pending_by_class() == {"hi": 2, "lo": 1}


async def test_rejected_request_is_not_queued() -> None:
    queues = Queues(_policy(max_queue_size=1))
    first = _request("lo")
    queues.admit(first)
    with pytest.raises(QueueFull):
        queues.admit(_request("lo"))
    assert list(queues.by_name["lo"].live()) == [first]


async def test_bound_counts_only_live_requests() -> None:
    queues = Queues(_policy(max_queue_size=2))
    first = _request("lo")
    queues.admit(first)
    queues.admit(_request("lo"))
    _drop(queues, first)
    queues.admit(_request("hi"))  # room again: the dropped one no longer counts
    assert queues.num_live == 2


async def test_class_bound_counts_only_live_requests() -> None:
    queues = Queues(_policy(classes=(ClassPolicy("hi"), ClassPolicy("lo", max_queue_size=1))))
    first = _request("lo")
    queues.admit(first)
    _drop(queues, first)
    queues.admit(_request("lo"))
    assert queues.pending_by_class()["lo"] == 1


# -- lazy deletion -----------------------------------------------------------------------


async def test_forget_subtracts_live_counts_items_and_cost() -> None:
    queues = Queues(_policy())
    a = _request(num_items=2, cost=5.0)
    b = _request(num_items=3, cost=7.0)
    queues.admit(a)
    queues.admit(b)
    queue = queues.by_name["lo"]
    assert (queue.num_live, queue.num_live_items, queue.live_cost) == (2, 5, 12.0)
    _drop(queues, a)
    assert (queue.num_live, queue.num_live_items, queue.live_cost) == (1, 3, 7.0)


async def test_forget_of_the_last_live_request_zeroes_counters() -> None:
    queues = Queues(_policy())
    a = _request(cost=0.1)
    b = _request(cost=0.2)
    queues.admit(a)
    queues.admit(b)
    _drop(queues, b)
    _drop(queues, a)
    queue = queues.by_name["lo"]
    assert (queue.num_live, queue.num_live_items, queue.live_cost) == (0, 0, 0.0)
    assert queue.head() is None


async def test_head_skips_dead_requests_in_front() -> None:
    queues = Queues(_policy())
    a, b, c = _request(), _request(), _request()
    for r in (a, b, c):
        queues.admit(r)
    _drop(queues, a)
    _drop(queues, b)
    assert queues.by_name["lo"].head() is c


async def test_head_is_none_for_an_empty_queue() -> None:
    assert Queues(_policy()).by_name["hi"].head() is None


async def test_live_iterates_only_queued_requests_in_arrival_order() -> None:
    queues = Queues(_policy())
    requests = [_request() for _ in range(5)]
    for r in requests:
        queues.admit(r)
    _drop(queues, requests[1])
    _drop(queues, requests[3])
    assert list(queues.by_name["lo"].live()) == [requests[0], requests[2], requests[4]]


# -- pop_live ----------------------------------------------------------------------------


async def test_pop_live_returns_oldest_live_requests_in_order_skipping_dead() -> None:
    queues = Queues(_policy())
    requests = [_request(num_items=i + 1) for i in range(5)]
    for r in requests:
        queues.admit(r)
    _drop(queues, requests[0])
    _drop(queues, requests[2])
    queue = queues.by_name["lo"]
    assert queue.pop_live(2) == [requests[1], requests[3]]
    assert list(queue.live()) == [requests[4]]
    assert (queue.num_live, queue.num_live_items, queue.live_cost) == (1, 5, 5.0)


async def test_pop_live_of_everything_leaves_zero_counters() -> None:
    queues = Queues(_policy())
    for cost in (0.1, 0.2, 0.3):
        queues.admit(_request(cost=cost))
    queue = queues.by_name["lo"]
    assert len(queue.pop_live(3)) == 3
    assert (queue.num_live, queue.num_live_items, queue.live_cost) == (0, 0, 0.0)
    assert queue.head() is None


async def test_pop_live_does_not_touch_other_classes() -> None:
    queues = Queues(_policy())
    hi = _request("hi")
    queues.admit(hi)
    queues.admit(_request("lo"))
    queues.by_name["lo"].pop_live(1)
    assert queues.pending_by_class() == {"hi": 1, "lo": 0}
    assert queues.by_name["hi"].head() is hi


# -- reconfigure --------------------------------------------------------------------------


async def test_reconfigure_refuses_to_drop_a_class_with_waiting_requests() -> None:
    queues = Queues(_policy())
    waiting = _request("hi")
    queues.admit(waiting)
    new = BatchPolicy(classes=(ClassPolicy("lo"),), default_class="lo")
    with pytest.raises(ConfigError) as excinfo:
        queues.reconfigure(new)
    assert excinfo.value.field == "classes"
    assert "'hi'" in str(excinfo.value)
    assert "1 waiting" in str(excinfo.value)
    # Unchanged after the refusal.
    assert [q.name for q in queues.ordered] == ["hi", "lo"]
    assert queues.by_name["hi"].head() is waiting


async def test_reconfigure_drops_an_empty_class_and_adds_new_ones() -> None:
    queues = Queues(_policy())
    kept = _request("lo")
    queues.admit(kept)
    new = BatchPolicy(classes=(ClassPolicy("new"), ClassPolicy("lo")), default_class="lo")
    queues.reconfigure(new)
    assert [q.name for q in queues.ordered] == ["new", "lo"]
    assert "hi" not in queues.by_name
    assert queues.by_name["lo"].head() is kept
    assert queues.pending_by_class() == {"new": 0, "lo": 1}


async def test_reconfigure_keeps_waiting_requests_and_adopts_new_limits() -> None:
    queues = Queues(_policy())
    queues.admit(_request("lo"))
    running_before = queues.by_name["lo"]
    running_before.num_running = 1
    new = _policy(max_queue_size=5, classes=(ClassPolicy("hi"), ClassPolicy("lo", share=0.5)))
    queues.reconfigure(new)
    lo = queues.by_name["lo"]
    assert lo is running_before
    assert lo.num_running == 1
    assert lo.limits.share == 0.5
    assert queues.max_queue_size == 5


async def test_reconfigure_applies_new_class_bound_to_later_admissions() -> None:
    queues = Queues(_policy())
    queues.admit(_request("lo"))
    queues.reconfigure(_policy(classes=(ClassPolicy("hi"), ClassPolicy("lo", max_queue_size=1))))
    with pytest.raises(QueueFull) as excinfo:
        queues.admit(_request("lo"))
    assert excinfo.value.limit == 1


# -- through the batcher ----------------------------------------------------------------------


async def test_cancelled_requests_do_not_pile_up_behind_a_waiting_head(
    make_batcher, fake_model, spawn
):
    # A queue bound caps the *live* requests; cancelled ones are only marked and stay
    # in the deque (with their payloads) until the head moves. A head that waits long
    # (a long delay, a capped class) must not let clients that give up and retry grow
    # the queue's memory without bound.
    payloads: list[weakref.ref[np.ndarray]] = []
    batcher = make_batcher(max_batch_size=8, max_delay_s=100.0, max_queue_size=2)
    await batcher.start()
    head = spawn(batcher.submit(np.zeros(4)))
    await settle()
    for _ in range(200):
        payload = np.zeros((1, 4))
        payloads.append(weakref.ref(payload))
        request = batcher.enqueue_many(payload)
        batcher.cancel(request)
        del payload, request
    assert batcher.num_pending == 1
    retained = sum(ref() is not None for ref in payloads)
    assert retained <= 64, f"{retained} payloads of cancelled requests are still held"
    await batcher.stop(drain=True)
    assert (await finish(head))[0].shape == (4,)
