"""How long a batch of n items takes on this model, learned from its own batches.

Sizes are in the policy's budget unit (:attr:`~carpool.core.policy.BatchPolicy.budget_unit`):
items, or tokens under ``max_batch_tokens``, or cost under ``max_batch_cost``, whatever
limits the batch and so sets its time; "items" below stands for that unit.

The scheduler asks it before it closes a batch: a request whose deadline would pass
before the batch ends is not run (it could only be answered late). Each batch's compute
time updates a moving average for its size bucket (powers of two: 1, 2, 3-4, 5-8, ...),
so the estimate follows a model whose speed drifts (a warmed-up GPU, a noisy
neighbour) within a few batches, and one slow batch moves it by a fifth.
:class:`BatchTimeFit` fits the same batches with a line, ``t(b) = overhead + per_item * b``,
for the adaptive controller (:mod:`carpool.core.adaptive`), which needs the slope.

An estimate must never shut a model out. Requests dropped on its word run no batch, so
a wrong one would never be corrected: a first batch of a new shape (kernels chosen,
weights packed, caches cold) can take a hundred times a warm one, and the timeout of
every request that followed would look too short for good. So the first batch of each
bucket is not learned, and an estimate not confirmed by a batch within
:data:`MAX_AGE_S` is not used: at worst one batch that often runs on a model truly
slower than the timeout, and measures it again.
"""

from __future__ import annotations

import math

from carpool.core.clock import Clock

SMOOTHING = 0.2  # weight of the newest batch in its bucket's average
MAX_AGE_S = 1.0  # an estimate older than this is not trusted to drop a request
FIT_KEEP = 0.98  # weight a batch keeps in the fit per newer batch: ~50 batches of memory
# The fit has a slope once the sizes it saw vary this much (variance in items squared),
MIN_SIZE_VARIANCE = 0.25
# and takes a new one only when its standard error is under this share of the mean time
# per item: batches of nearly one size (a closed loop of 16 clients) with noisy times
# give a slope of anything, 0 included, which would put the knee at infinity.
MAX_SLOPE_ERROR = 0.1


class BatchTimeFit:
    """``t(b) = overhead_s + per_item_s * b`` by least squares over recent batches, each
    older batch weighing :data:`FIT_KEEP` times less (so the line follows drift).

    Once the sizes seen stop varying (a saturated replica runs full batches only) the
    slope last fitted is kept, and the overhead follows the recent batches' mean time:
    forgetting the slope would switch off what depends on it just under load. The sizes
    vary enough when the slope they give is known to within :data:`MAX_SLOPE_ERROR` of
    the mean time per item (its standard error, from the residuals and the weights)."""

    __slots__ = (
        "_sb",
        "_sbb",
        "_sbt",
        "_slope",
        "_st",
        "_stt",
        "_sw",
        "_sww",
        "num_batches",
        "stretch",
    )

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Back to no batch seen (the policy's budget unit changed: a line in another
        unit says nothing of this one)."""
        self._sw = self._sb = self._sbb = self._st = self._sbt = 0.0
        self._stt = self._sww = 0.0  # for the slope's standard error
        self._slope: float | None = None  # the last slope the sizes seen identified
        self.num_batches = 0
        # A batch's span over the model's own time, a moving average (1 when the model
        # has its core to itself): how much longer a batch really takes than the line
        # says while the event loop also reads and answers requests between its steps.
        self.stretch = 1.0

    def note_stretch(self, span_s: float, own_s: float) -> None:
        """A batch spanned ``span_s`` for ``own_s`` of the model's own time."""
        if own_s > 0 and span_s >= own_s:
            self.stretch += SMOOTHING * (span_s / own_s - self.stretch)

    def observe(self, num_items: float, compute_s: float) -> None:
        k = FIT_KEEP
        self._sw = k * self._sw + 1.0
        self._sww = k * k * self._sww + 1.0
        self._sb = k * self._sb + num_items
        self._sbb = k * self._sbb + num_items * num_items
        self._st = k * self._st + compute_s
        self._stt = k * self._stt + compute_s * compute_s
        self._sbt = k * self._sbt + num_items * compute_s
        self.num_batches += 1
        variance = self._variance()
        num_effective = self._sw * self._sw / self._sww  # the batches the weights amount to
        if variance < MIN_SIZE_VARIANCE or num_effective <= 2.0:
            return
        mean_b, mean_t = self._sb / self._sw, self._st / self._sw
        covariance = self._sbt / self._sw - mean_b * mean_t
        slope = covariance / variance
        # What the line leaves unexplained.
        residual = max(0.0, self._stt / self._sw - mean_t * mean_t - slope * covariance)
        error = math.sqrt(residual / ((num_effective - 2.0) * variance))
        if error <= MAX_SLOPE_ERROR * mean_t / mean_b:
            self._slope = max(slope, 0.0)

    @property
    def is_identified(self) -> bool:
        """Whether the batches seen differ enough in size to give a slope, or did once."""
        return self._slope is not None

    def _variance(self) -> float:
        mean_b = self._sb / self._sw
        return self._sbb / self._sw - mean_b * mean_b

    def line(self) -> tuple[float, float]:
        """``(overhead_s, per_item_s)``, both >= 0; ``(0, mean time per item)`` while the
        sizes seen are all alike and never varied (a batch is then taken to cost its
        size times that); ``(0, 0)`` before any batch."""
        if self._sw == 0:
            return 0.0, 0.0
        mean_b, mean_t = self._sb / self._sw, self._st / self._sw
        slope = self._slope
        if slope is None:
            return 0.0, mean_t / mean_b
        overhead = mean_t - slope * mean_b
        if overhead < 0:  # a line through the origin, fitted by the same sums
            return 0.0, self._sbt / self._sbb
        return overhead, slope

    def predict_s(self, num_items: float) -> float:
        overhead_s, per_item_s = self.line()
        return overhead_s + per_item_s * num_items


def bucket_of(num_items: float) -> int:
    """The bucket of a batch size: 0 for 1 item, k for 2**(k-1) < n <= 2**k."""
    return max(0, math.ceil(math.log2(num_items))) if num_items > 1 else 0


class BatchTimes:
    """Recent compute seconds per batch-size bucket; ``predict_s`` reads them."""

    __slots__ = ("_clock", "_mean_s", "_seen", "_updated_s", "fit", "unit")

    def __init__(self, clock: Clock, unit: str = "items") -> None:
        self._clock = clock
        self.fit = BatchTimeFit()
        self._mean_s: dict[int, float] = {}
        self._updated_s: dict[int, float] = {}
        self._seen: set[int] = set()  # buckets whose first (cold) batch has run
        self.unit = unit  # the budget unit of the batches observed (see forget)

    def forget(self, unit: str) -> None:
        """Back to no batch seen, the line too (in place: the controller reads it), now in
        ``unit``: a batch formed in another (one still running) is not fitted after."""
        self.unit = unit
        self.fit.forget()
        self._mean_s.clear()
        self._updated_s.clear()
        self._seen.clear()

    def observe(self, num_items: float, compute_s: float, model_s: float | None = None) -> None:
        """A batch of ``num_items`` (in the policy's budget unit: items, tokens or
        cost) computed in ``compute_s`` seconds, of which ``model_s`` were the model's own
        (a model in steps on the event loop, :mod:`carpool.core.stepwise`, shares its span
        with the loop's other work). The line is fitted to the model's own time (it is
        the model's, whatever the load); the deadline estimates follow the span (when
        the batch's answers really come)."""
        if not num_items > 0 or not (compute_s >= 0 and math.isfinite(compute_s)):
            return
        bucket = bucket_of(num_items)
        if bucket not in self._seen:
            self._seen.add(bucket)
            return
        own_s = compute_s if model_s is None or not math.isfinite(model_s) else model_s
        self.fit.observe(num_items, min(own_s, compute_s))
        self.fit.note_stretch(compute_s, own_s)
        mean = self._mean_s.get(bucket)
        self._mean_s[bucket] = compute_s if mean is None else mean + SMOOTHING * (compute_s - mean)
        self._updated_s[bucket] = self._clock.now()

    def predict_s(self, num_items: float) -> float:
        """The expected compute time of a batch of ``num_items``: its bucket's average;
        else the nearest larger bucket's (a batch is rarely slower than a larger one);
        else the largest smaller bucket's, scaled by size (an overestimate: time grows
        slower than size); 0.0 when no bucket was measured within :data:`MAX_AGE_S`."""
        bucket = bucket_of(num_items)
        own, means = self._fresh(bucket)
        if own is not None:  # asked at every admission
            return own
        if not means:
            return 0.0
        larger = [b for b in means if b > bucket]
        if larger:
            return means[min(larger)]
        below = max(means)
        return means[below] * num_items / (1 << below)

    def predict_at_least_s(self, num_items: float) -> float:
        """A lower bound on a batch of ``num_items``, for deciding that a request would be
        late: its bucket's average; else the larger of the largest smaller bucket's (a
        batch is rarely faster than a smaller one) and the nearest larger bucket's scaled
        down by size (time grows slower than size); 0.0 when none was measured within
        :data:`MAX_AGE_S`. Never the larger bucket's whole time, as :meth:`predict_s`
        gives: a size never measured would be judged by larger batches for ever (a lone
        request with a short timeout, behind a stream of full batches, would be dropped
        each time and its size never run, nor measured)."""
        bucket = bucket_of(num_items)
        own, means = self._fresh(bucket)
        if own is not None:
            return own
        smaller = [b for b in means if b < bucket]
        larger = [b for b in means if b > bucket]
        below = means[max(smaller)] if smaller else 0.0
        above = means[min(larger)] * num_items / (1 << min(larger)) if larger else 0.0
        return max(below, above)

    def _fresh(self, bucket: int) -> tuple[float | None, dict[int, float]]:
        """``bucket``'s mean if a batch confirmed it within :data:`MAX_AGE_S` (then no
        other is looked at); else None and every bucket's mean so confirmed."""
        oldest_s = self._clock.now() - MAX_AGE_S
        updated_s = self._updated_s.get(bucket)
        if updated_s is not None and updated_s >= oldest_s:
            return self._mean_s[bucket], {}
        return None, {b: s for b, s in self._mean_s.items() if self._updated_s[b] >= oldest_s}

    def as_dict(self) -> dict[int, float]:
        """Each measured bucket's upper batch size and its mean seconds."""
        return {1 << b: s for b, s in sorted(self._mean_s.items())}
