"""Decides, for a replica that is free now, which batch to close, or when to look again.

The scheduler is pure bookkeeping over :class:`~carpool.core.queues.Queues`: no asyncio,
no threads, time passed in. That keeps every rule testable with a fake clock:

1. Classes are tried in priority order, except that a class whose oldest request has
   waited past its ``max_wait_s`` (aging) goes before all others, oldest first; a
   higher class whose oldest request is older still keeps its place before it.
2. A class already on as many replicas as its ``share`` allows is skipped (unless aged;
   the time it ages is reported, so a free replica looks again then). A busy replica may
   queue a full batch of its running batch's class behind it: that takes no new replica.
3. A batch is planned FIFO from the class, then (``fill_from_lower``) from lower classes,
   stopping at the first request that would break ``max_batch_size``, ``max_batch_cost``
   or ``max_batch_tokens``, or once one of them is reached (then it is full).
4. It is closed now if it is full, if the oldest request's ``max_delay_s`` has expired,
   if its class is aged, if the batcher is draining, or if a preferred size can be
   filled exactly (then the largest such). Otherwise the earliest expiry among classes
   is when to look again.
5. Under ``max_delay_s``/``max_batch_size`` "auto", the
   :class:`~carpool.core.adaptive.Adaptive` controller gives the batch's size cap and
   when it is due instead of the fixed values. Both count the policy's budget unit
   (items, or tokens/cost under a budget): a cap in tokens or cost is applied as a
   budget lower than the policy's own.
6. ``preempt``: a replica computing a lower-class batch in steps asks for a batch of the
   classes above it only (``above_rank``), filled from those classes only; it takes no
   further replica, so the share caps do not apply.
7. A request whose deadline would pass before its batch ends (now plus the compute time
   measured for batches of that size in the same unit, or a lower bound where that size
   was not measured lately: :meth:`~carpool.core.batch_times.BatchTimes.predict_at_least_s`)
   is not run: it expires now, answered at once rather than late, and leaves its place
   to others. Lower classes' fill leaves the batch first: it never costs the class
   leading the batch a request that would be on time without it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from carpool.core.adaptive import Adaptive
from carpool.core.policy import UNIT_COST, UNIT_ITEMS, UNIT_TOKENS, BatchPolicy
from carpool.core.queues import ClassQueue, Queues
from carpool.core.request import Batch, Request


@dataclass(slots=True)
class Decision:
    """Either a batch to run now, or the time to decide again (``None``: on next event).

    ``ages_at_s`` is when the oldest request of a class held back now (by its share cap
    or its delay) reaches ``max_wait_s``: aging makes it due then, so look again then too.
    """

    batch: Batch | None = None
    wake_at_s: float | None = None
    ages_at_s: float | None = None


@dataclass(slots=True)
class _Plan:
    takes: list[tuple[ClassQueue, int]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    num_items: int = 0
    cost: float = 0.0
    num_tokens: int = 0
    max_length: int = 0
    is_full: bool = False
    is_contiguous: bool = True  # False when requests of other length buckets were skipped


def share_cap(share: float, num_replicas: int) -> int:
    """How many batches a class with ``share`` may lead at once on ``num_replicas``."""
    return max(1, math.floor(share * num_replicas + 1e-9))


class Scheduler:
    """Forms batches from queues under a policy; see the module docstring for the rules."""

    __slots__ = ("_batch_ids", "padded_cost")

    def __init__(self, *, padded_cost: bool = False) -> None:
        self._batch_ids = itertools.count()
        # True when the model pads: a batch's tokens are then items x longest item.
        self.padded_cost = padded_cost

    def decide(
        self,
        now: float,
        policy: BatchPolicy,
        queues: Queues,
        *,
        num_replicas: int,
        max_items_cap: int | None,
        is_draining: bool,
        expire: Callable[[Request], None],
        require_full: bool = False,
        behind_class: str | None = None,
        predict_s: Callable[[float], float] | None = None,
        adaptive: Adaptive | None = None,
        above_rank: int | None = None,
    ) -> Decision:
        """The batch a free replica should run now, or when to ask again.

        With ``require_full`` only a full batch is returned (for a replica that is
        still busy and may queue one batch behind the running one). ``behind_class`` is
        the lead class of that running batch: a batch of the same class queued behind it
        occupies no further replica, so it neither meets nor counts against the class's
        share cap; other classes keep their cap (``None``: waive it for every class).
        """
        candidates: list[ClassQueue] = []
        heads: dict[str, Request] = {}
        for queue in queues.ordered:
            if above_rank is not None and queue.limits.rank >= above_rank:
                continue
            head = queue.head()
            # A head past its deadline will never run: it must not make its class aged.
            while head is not None and head.deadline_s is not None and head.deadline_s <= now:
                expire(head)
                head = queue.head()
            if head is not None:
                candidates.append(queue)
                heads[queue.name] = head
        if not candidates:
            return Decision()
        aged = [
            q
            for q in candidates
            if q.limits.max_wait_s is not None
            and now >= heads[q.name].arrival_s + q.limits.max_wait_s
        ]
        order = candidates
        if aged:
            # An aged class goes before younger requests, not before a higher class whose
            # oldest request waited longer still: that class (which may never age) would
            # starve under a backlog of aged requests below it.
            front = [
                q
                for q in candidates
                if q in aged
                or any(
                    q.limits.rank < a.limits.rank
                    and heads[q.name].arrival_s <= heads[a.name].arrival_s
                    for a in aged
                )
            ]
            front.sort(key=lambda q: (heads[q.name].arrival_s, q.limits.rank))
            order = front + [q for q in candidates if q not in front]
        wake_at_s: float | None = None
        ages_first_s: float | None = None
        unit = policy.budget_unit
        for queue in order:
            is_aged = queue in aged
            # Not yet aged: aging makes the class due (and lifts its cap) at this time.
            ages_at_s = None
            if not is_aged and queue.limits.max_wait_s is not None:
                ages_at_s = heads[queue.name].arrival_s + queue.limits.max_wait_s
            # A batch queued behind a busy replica's current one of the same class
            # (require_full) adds no concurrency, so the share cap does not apply to it.
            is_same_replica = require_full and behind_class in (None, queue.name)
            is_capped = queue.num_running >= share_cap(queue.limits.share, num_replicas)
            if is_capped and not (is_aged or is_same_replica or above_rank is not None):
                ages_first_s = _earliest(ages_first_s, ages_at_s)
                continue
            max_items = queue.limits.max_batch_size
            max_units: float | None = None  # the controller's cap in a budget's unit
            if adaptive is not None:
                oldest_s = heads[queue.name].arrival_s
                own = queue_units(queue, unit)
                max_units = adaptive.max_units(policy, queue.limits, oldest_s, now, own)
                if unit == UNIT_ITEMS:
                    max_items, max_units = int(max_units), None
            if max_items_cap is not None:
                max_items = min(max_items, max_items_cap)
            plan, expired = self._plan(queue, queues, policy, max_items, now, max_units, above_rank)
            if predict_s is not None and plan.requests:
                expired += _drop_late(plan, lambda p: now + predict_s(self._units(p, unit)))
            for request in expired:
                expire(request)
            if not plan.requests:
                continue
            if require_full and not plan.is_full:
                continue  # a replica already busy takes only a batch that cannot grow
            due_s = plan.requests[0].arrival_s + queue.limits.max_delay_s
            if adaptive is not None and queue.limits.is_auto_delay:
                oldest_s = plan.requests[0].arrival_s
                num_units = self._units(plan, unit)
                cap = max_items if max_units is None else max_units
                due_s = adaptive.due_s(queue.limits, num_units, cap, oldest_s, now)
            is_due = is_aged or is_draining or plan.is_full or now >= due_s
            if not is_due and not _trim_to_preferred(plan, policy.preferred_batch_sizes):
                wake_at_s = _earliest(wake_at_s, due_s)
                ages_first_s = _earliest(ages_first_s, ages_at_s)
                continue
            counts = not (require_full and behind_class == queue.name)
            batch = self._commit(plan, queue, max_items, now, counts)
            batch.units, batch.unit = self._units(plan, unit), unit
            return Decision(batch=batch)
        return Decision(wake_at_s=wake_at_s, ages_at_s=ages_first_s)

    def _plan(
        self,
        lead: ClassQueue,
        queues: Queues,
        policy: BatchPolicy,
        max_items: int,
        now: float,
        max_units: float | None = None,
        above_rank: int | None = None,
    ) -> tuple[_Plan, list[Request]]:
        plan = _Plan()
        expired: list[Request] = []
        sources = [lead]
        if policy.fill_from_lower:
            below = above_rank if above_rank is not None else math.inf
            sources += [q for q in queues.ordered if lead.limits.rank < q.limits.rank < below]
        max_cost = policy.max_batch_cost
        max_tokens: float | None = policy.max_batch_tokens
        if max_units is not None:  # the adaptive cap, in the budget's own unit
            if policy.budget_unit == UNIT_TOKENS:
                max_tokens = min(max_tokens or max_units, max_units)
            else:
                max_cost = min(max_cost or max_units, max_units)
        bucket = lead.head_bucket() if policy.length_buckets is not None else None
        for queue in sources:
            taken = 0
            for request in queue.live():
                if request.deadline_s is not None and request.deadline_s <= now:
                    expired.append(request)
                    continue
                if bucket is not None and request.bucket != bucket:
                    plan.is_contiguous = False
                    continue
                fits = (
                    plan.num_items + request.num_items <= max_items
                    and (max_cost is None or plan.cost + request.cost <= max_cost)
                    and (max_tokens is None or self._tokens_with(plan, request) <= max_tokens)
                )
                if not fits and plan.requests:
                    plan.is_full = True
                    break
                # A request that alone exceeds a limit lowered after its admission (an
                # out-of-memory cap, a policy update) runs alone rather than never.
                plan.requests.append(request)
                plan.num_items += request.num_items
                plan.cost += request.cost
                plan.num_tokens += request.num_tokens
                plan.max_length = max(plan.max_length, request.length)
                taken += 1
                if (
                    not fits
                    or plan.num_items == max_items
                    or self._at_budget(plan, max_cost, max_tokens)
                ):
                    plan.is_full = True
                    break
            if taken:
                plan.takes.append((queue, taken))
            # A class whose requests all expired leads nothing: lower classes wait for
            # their own turn (their own delay and share), not this class's.
            if plan.is_full or not plan.requests:
                break
        return plan, expired

    def _units(self, plan: _Plan, unit: str) -> float:
        """The plan's size in ``unit``: items, tokens (as padded when the model pads) or
        cost."""
        if unit == UNIT_TOKENS:
            if self.padded_cost:
                return float(plan.num_items * plan.max_length)
            return float(plan.num_tokens)
        return plan.cost if unit == UNIT_COST else float(plan.num_items)

    def _at_budget(self, plan: _Plan, max_cost: float | None, max_tokens: float | None) -> bool:
        """Whether the plan has reached its cost or token budget: no request that costs
        anything fits any more, so it is as full as one at ``max_batch_size`` and goes
        without waiting out its window."""
        if max_cost is not None and plan.cost >= max_cost:
            return True
        if max_tokens is None:
            return False
        tokens = plan.num_items * plan.max_length if self.padded_cost else plan.num_tokens
        return tokens >= max_tokens

    def _tokens_with(self, plan: _Plan, request: Request) -> int:
        """The batch's tokens if ``request`` joined it."""
        if self.padded_cost:
            return (plan.num_items + request.num_items) * max(plan.max_length, request.length)
        return plan.num_tokens + request.num_tokens

    def _commit(
        self, plan: _Plan, lead: ClassQueue, max_items: int, now: float, counts: bool
    ) -> Batch:
        requests: list[Request] = []
        if plan.is_contiguous:
            for queue, count in plan.takes:
                requests += queue.pop_live(count)
            assert requests == plan.requests, "a plan pops exactly the requests it chose"
        else:
            for queue, count in plan.takes:
                chosen = [r for r in plan.requests if r.class_name == queue.name][:count]
                queue.take(chosen)
                requests += chosen
        if counts:
            lead.num_running += 1
        return Batch(
            batch_id=next(self._batch_ids),
            requests=requests,
            num_items=plan.num_items,
            cost=plan.cost,
            lead_class=lead.name,
            max_batch_size=max(max_items, plan.num_items),  # a lone oversized request
            closed_s=now,
        )


def request_units(request: Request, unit: str) -> float:
    """What ``request`` holds in ``unit`` (:attr:`BatchPolicy.budget_unit`)."""
    if unit == UNIT_TOKENS:
        return float(request.num_tokens)
    return request.cost if unit == UNIT_COST else float(request.num_items)


def requests_by_class(requests: list[Request]) -> dict[str, int]:
    """How many of ``requests`` each class has."""
    counts: dict[str, int] = {}
    for request in requests:
        name = request.class_name
        counts[name] = counts.get(name, 0) + 1
    return counts


def queue_units(queue: ClassQueue, unit: str) -> float:
    """What ``queue``'s live requests hold, in ``unit``."""
    if unit == UNIT_TOKENS:
        return float(queue.num_live_tokens)
    return queue.live_cost if unit == UNIT_COST else float(queue.num_live_items)


def _drop_late(plan: _Plan, end_of: Callable[[_Plan], float]) -> list[Request]:
    """Take out of ``plan`` the requests whose deadline falls before ``end_of(plan)``,
    when the batch would end; they are returned to be expired. The plan keeps its other
    requests in order (``takes`` counts only those: the late ones are no longer live when
    it pops).

    Lower classes' fill (``fill_from_lower``) goes first: while a request of the class
    leading the batch would be late only because of the fill (on time in a batch of its
    class's requests alone), the plan's last request leaves it (it stays queued, for a
    batch of its own) and the end is predicted again. Room filled with lower-class work
    must never cost the leading class its answers."""
    end_s = end_of(plan)
    lead_count = plan.takes[0][1]  # the lead class's requests come first
    if lead_count < len(plan.requests) and any(_is_late(r, end_s) for r in plan.requests):
        alone_end_s = end_of(_first(plan, lead_count))
        lead = plan.requests[:lead_count]
        while len(plan.requests) > lead_count and any(
            _is_late(r, end_s) and not _is_late(r, alone_end_s) for r in lead
        ):
            _pop_last(plan)
            # A padding model's tokens are items x the longest: the fill's may be gone.
            plan.max_length = max(r.length for r in plan.requests)
            end_s = end_of(plan)
        # is_full stays: the batch holds all it can run in time, and is due as it was.
    late = [r for r in plan.requests if _is_late(r, end_s)]
    if not late:
        return late
    kept = [r for r in plan.requests if not _is_late(r, end_s)]
    counts = {id(q): sum(1 for r in kept if r.class_name == q.name) for q, _ in plan.takes}
    plan.takes = [(q, counts[id(q)]) for q, _ in plan.takes if counts[id(q)]]
    plan.requests = kept
    plan.num_items = sum(r.num_items for r in kept)
    plan.cost = sum(r.cost for r in kept)
    plan.num_tokens = sum(r.num_tokens for r in kept)
    plan.max_length = max((r.length for r in kept), default=0)
    plan.is_full = False  # it has room again; it may wait for more
    return late


def _is_late(request: Request, end_s: float) -> bool:
    """Whether ``request``'s deadline falls before ``end_s``."""
    return request.deadline_s is not None and request.deadline_s < end_s


def _first(plan: _Plan, count: int) -> _Plan:
    """A plan of ``plan``'s first ``count`` requests, all of its first take's class."""
    requests = plan.requests[:count]
    return _Plan(
        takes=[(plan.takes[0][0], count)],
        requests=requests,
        num_items=sum(r.num_items for r in requests),
        cost=sum(r.cost for r in requests),
        num_tokens=sum(r.num_tokens for r in requests),
        max_length=max(r.length for r in requests),
    )


def _pop_last(plan: _Plan) -> None:
    """Take the plan's last request out of it (it stays in its queue); ``max_length`` is
    the caller's to recompute."""
    request = plan.requests.pop()
    plan.num_items -= request.num_items
    plan.cost -= request.cost
    plan.num_tokens -= request.num_tokens
    queue, count = plan.takes[-1]
    plan.takes[-1] = (queue, count - 1)
    if count == 1:
        plan.takes.pop()


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _trim_to_preferred(plan: _Plan, preferred: tuple[int, ...]) -> bool:
    """Cut ``plan`` to its longest FIFO prefix whose size is a preferred size (the largest
    preferred size it can fill, as Triton does); False if no prefix is one.

    A request of k items (``submit_many``) can straddle a preferred size: with sizes
    (2, 4) and requests of 1, 1 and 3 items no prefix makes 4, but the first two make 2.
    """
    if not preferred:
        return False
    keep = total = 0
    for i, request in enumerate(plan.requests):
        total += request.num_items
        if total in preferred:
            keep = i + 1
    if keep == 0:
        return False
    while len(plan.requests) > keep:
        _pop_last(plan)
    plan.max_length = max(r.length for r in plan.requests)
    return True
