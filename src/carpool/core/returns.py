"""Closed-loop clients: requests that come back as soon as their answers leave.

A caller that sends its next request only when the last is answered (a fixed pool of
workers, a benchmark's ``--concurrency``) brings a request back right after each batch
lands. Its arrival rate is the rate the server answers at, so a controller that sizes
batches by the rate (:mod:`carpool.core.adaptive`) settles at whatever batch size the
loop happens to run: 64 clients served as two alternating batches of 32 look exactly like
traffic that brings 32 per batch time, and each batch pays the model's fixed overhead for
half the clients. What tells the two apart is *when* requests arrive: a closed loop's come
back within a round trip of their answers, open-loop traffic does not care when answers
leave. So, per class:

- when a batch lands, the requests it answered are noted (clients, whatever each holds
  in the budget unit); requests arriving within :data:`RETURN_WINDOW_S` after it are
  counted as coming back;
- when the next batch lands, the share of the previous one that came back, beyond what the
  class's rate between windows would have brought anyway, updates a moving average
  (:data:`SMOOTHING`); (the overall rate would not do: a closed loop's arrivals all fall
  in the windows, and its overall rate is high);
- while that share is at least :data:`CLOSED_LOOP_SHARE`, :meth:`Returns.pending` is
  the part of the last batch still expected back within its window: worth waiting for
  when a replica is free (a round trip, against a whole batch's overhead saved; for a
  closed loop, larger batches mean more answers per second *and* lower latency, as the
  same clients cycle faster).

Open-loop traffic shows a share near 0, and a lone client (concurrency 1) has nothing
pending once its one request is back: neither waits. Each landing closes the window of
the one before: with several replicas landing batches within a window of each other, the
windows are cut short, the share reads low, and the rule stays off (the controller then
behaves as it did without it).
"""

from __future__ import annotations

import math

RETURN_WINDOW_S = 0.005  # arrivals this soon after a batch lands count as coming back
CLOSED_LOOP_SHARE = 0.5  # a class whose batches come back at least this much is a closed loop
SMOOTHING = 0.2  # the weight of each batch's share (and rate) in the moving averages
MIN_OUTSIDE_S = 0.001  # time between windows too short to measure the rate over


class Returns:
    """Of one class: how much of each landed batch comes back at once."""

    __slots__ = ("_after", "_answered", "_answered_s", "_back", "outside_rate", "share")

    def __init__(self) -> None:
        self._answered = 0.0  # requests the last landed batch answered
        self._answered_s = -math.inf  # when it landed
        self._back = 0.0  # requests arrived within the window after it
        self._after = 0.0  # requests arrived after that window
        self.outside_rate = 0.0  # requests per second arriving between windows (average)
        self.share = 0.0  # moving average of the share that came back

    def answered(self, now: float, num: float) -> None:
        """A batch answering ``num`` requests of the class landed at ``now``."""
        if self._answered > 0:
            since_s = max(0.0, now - self._answered_s)
            window_s = min(RETURN_WINDOW_S, since_s)
            if since_s - window_s >= MIN_OUTSIDE_S:
                rate = self._after / (since_s - window_s)
                self.outside_rate += SMOOTHING * (rate - self.outside_rate)
            beyond = self._back - self.outside_rate * window_s
            sample = min(1.0, max(0.0, beyond / self._answered))
            self.share += SMOOTHING * (sample - self.share)
        self._answered, self._answered_s = num, now
        self._back = self._after = 0.0

    def arrived(self, now: float, num: float) -> None:
        if now - self._answered_s <= RETURN_WINDOW_S:
            self._back += num
        else:
            self._after += num

    def pending(self, now: float) -> float:
        """Requests of the last landed batch still expected back within its window (0
        outside a closed loop, or once the window closed)."""
        if self.share < CLOSED_LOOP_SHARE or now - self._answered_s > RETURN_WINDOW_S:
            return 0.0
        return max(0.0, self.share * self._answered - self._back)

    @property
    def window_end_s(self) -> float:
        """When the window after the last landed batch closes."""
        return self._answered_s + RETURN_WINDOW_S
