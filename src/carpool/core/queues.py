"""Per-class FIFO queues with admission bounds and lazy deletion.

Each class keeps a deque of requests in arrival order plus running totals of its live
(QUEUED) requests, items and cost. A request that expires or is cancelled while queued
is only marked and subtracted from the totals (O(1)); scans skip it and pops discard it,
and the deque is compacted once dead requests outnumber the live ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from carpool.core.policy import BatchPolicy, ClassLimits
from carpool.core.request import Request, RequestState
from carpool.errors import ConfigError, QueueFull

_QUEUED = RequestState.QUEUED
UNBOUNDED = 1 << 30  # Queues.num_free with no bound in force


class ClassQueue:
    """The waiting requests of one priority class, oldest first."""

    __slots__ = (
        "_deque",
        "limits",
        "live_cost",
        "num_live",
        "num_live_items",
        "num_live_tokens",
        "num_running",
    )

    def __init__(self, limits: ClassLimits) -> None:
        self.limits = limits
        self._deque: deque[Request] = deque()
        self.num_live = 0
        self.num_live_items = 0
        self.num_live_tokens = 0
        self.live_cost = 0.0
        self.num_running = 0  # replicas running (or holding) a batch led by this class

    @property
    def name(self) -> str:
        return self.limits.name

    def push(self, request: Request) -> None:
        self._deque.append(request)
        self.num_live += 1
        self.num_live_items += request.num_items
        self.num_live_tokens += request.num_tokens
        self.live_cost += request.cost

    def head(self) -> Request | None:
        """The oldest live request, discarding dead ones in front of it."""
        dq = self._deque
        while dq:
            if dq[0].state is _QUEUED:
                return dq[0]
            dq.popleft()
        return None

    def live(self) -> Iterator[Request]:
        """Live requests, oldest first."""
        return (r for r in self._deque if r.state is _QUEUED)

    def forget(self, request: Request) -> None:
        """Subtract a request that left the QUEUED state without being popped."""
        self.num_live -= 1
        self.num_live_items -= request.num_items
        self.num_live_tokens -= request.num_tokens
        self.live_cost -= request.cost
        if self.num_live == 0:
            self._deque.clear()
            self.live_cost = 0.0
        else:
            self._compact()

    def _compact(self) -> None:
        """Drop dead requests once they outnumber the live ones: behind a head that waits
        (a long delay, a capped class) they would otherwise pile up, payloads and all,
        however low the queue bound. Each compaction halves the deque: O(1) amortized."""
        if len(self._deque) > 2 * self.num_live + 16:
            self._deque = deque(r for r in self._deque if r.state is _QUEUED)

    def head_bucket(self) -> int | None:
        """The length bucket of the oldest live request."""
        head = self.head()
        return None if head is None else head.bucket

    def take(self, requests: list[Request]) -> None:
        """Remove live ``requests`` from anywhere in the queue (they leave QUEUED now;
        the deque drops them lazily)."""
        for request in requests:
            request.state = RequestState.RUNNING
            self.num_live -= 1
            self.num_live_items -= request.num_items
            self.num_live_tokens -= request.num_tokens
            self.live_cost -= request.cost
        if self.num_live == 0:
            self._deque.clear()
            self.live_cost = 0.0
        else:
            self._compact()

    def pop_live(self, count: int) -> list[Request]:
        """Remove and return the ``count`` oldest live requests."""
        out: list[Request] = []
        dq = self._deque
        while len(out) < count:
            request = dq.popleft()
            if request.state is _QUEUED:
                out.append(request)
                self.num_live -= 1
                self.num_live_items -= request.num_items
                self.num_live_tokens -= request.num_tokens
                self.live_cost -= request.cost
        if self.num_live == 0:
            self.live_cost = 0.0
        return out


class Queues:
    """All classes' queues of one model, in priority order, with admission control."""

    __slots__ = ("_retired", "by_name", "max_queue_size", "ordered")

    def __init__(self, policy: BatchPolicy) -> None:
        self.ordered = [ClassQueue(policy.limits[c.name]) for c in policy.classes]
        self.by_name = {q.name: q for q in self.ordered}
        self.max_queue_size = policy.max_queue_size
        # Classes a policy change removed while batches they lead still ran: their
        # running count must come down when those land, and come back with the class.
        self._retired: dict[str, ClassQueue] = {}

    def leading(self, class_name: str) -> ClassQueue | None:
        """The queue whose running count a batch led by ``class_name`` holds, current or
        retired."""
        return self.by_name.get(class_name) or self._retired.get(class_name)

    @property
    def num_live(self) -> int:
        """Requests waiting across all classes."""
        return sum(q.num_live for q in self.ordered)

    def admit(self, request: Request) -> None:
        """Queue ``request`` or raise :class:`QueueFull` naming the bound it hit."""
        queue = self.by_name[request.class_name]
        if self.max_queue_size is not None and self.num_live >= self.max_queue_size:
            raise QueueFull("all classes", self.max_queue_size)
        bound = queue.limits.max_queue_size
        if bound is not None and queue.num_live >= bound:
            raise QueueFull(queue.name, bound)
        queue.push(request)

    def full(self, num_reserved: int = 0) -> QueueFull | None:
        """The refusal any request would get now, whatever its class: the bound across
        classes is reached, counting ``num_reserved`` requests promised a place (a
        server's waiting connections), or every class is at its own bound (then the
        first class's); None while some class has room."""
        num_live = self.num_live + num_reserved
        if self.max_queue_size is not None and num_live >= self.max_queue_size:
            return QueueFull("all classes", self.max_queue_size)
        for queue in self.ordered:
            bound = queue.limits.max_queue_size
            if bound is None or queue.num_live < bound:
                return None
        return QueueFull(self.ordered[0].name, self.ordered[0].limits.max_queue_size or 0)

    def num_free(self) -> int:
        """How many more requests could be admitted now, at most, whatever their class
        (a large number when some class has no bound)."""
        free = UNBOUNDED
        if self.max_queue_size is not None:
            free = max(0, self.max_queue_size - self.num_live)
        by_class = 0
        for queue in self.ordered:
            bound = queue.limits.max_queue_size
            if bound is None:
                return free
            by_class += max(0, bound - queue.num_live)
        return min(free, by_class)

    def forget(self, request: Request) -> None:
        self.by_name[request.class_name].forget(request)

    def replicas_gone(self) -> None:
        """Every replica ended without landing its batches (their event loop closed)."""
        for queue in self.ordered:
            queue.num_running = 0
        self._retired.clear()

    def pending_by_class(self) -> dict[str, int]:
        return {q.name: q.num_live for q in self.ordered}

    def reconfigure(self, policy: BatchPolicy) -> None:
        """Adopt a new policy's classes; a class with waiting requests may not vanish."""
        for queue in self.ordered:
            if queue.name not in policy.limits and queue.num_live:
                raise ConfigError(
                    "classes",
                    [c.name for c in policy.classes],
                    f"to keep class {queue.name!r}, which has {queue.num_live} waiting requests",
                )
        old = {**self._retired, **self.by_name}
        self.ordered = []
        for c in policy.classes:
            queue = old.get(c.name) or ClassQueue(policy.limits[c.name])
            queue.limits = policy.limits[c.name]
            self.ordered.append(queue)
        self.by_name = {q.name: q for q in self.ordered}
        self._retired = {
            name: q for name, q in old.items() if name not in self.by_name and q.num_running
        }
        self.max_queue_size = policy.max_queue_size
