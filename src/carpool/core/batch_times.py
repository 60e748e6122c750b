"""How long a batch of n items takes on this model, learned from its own batches.

The scheduler asks it before it closes a batch: a request whose deadline would pass
before the batch ends is not run (it could only be answered late). Each batch's compute
time updates a moving average for its size bucket (powers of two: 1, 2, 3-4, 5-8, ...),
so the estimate follows a model whose speed drifts (a warmed-up GPU, a noisy
neighbour) within a few batches, and one slow batch moves it by a fifth.
"""

from __future__ import annotations

import math

SMOOTHING = 0.2  # weight of the newest batch in its bucket's average


def bucket_of(num_items: int) -> int:
    """The bucket of a batch size: 0 for 1 item, k for 2**(k-1) < n <= 2**k."""
    return max(0, math.ceil(math.log2(num_items))) if num_items > 1 else 0


class BatchTimes:
    """Recent compute seconds per batch-size bucket; ``predict_s`` reads them."""

    __slots__ = ("_mean_s",)

    def __init__(self) -> None:
        self._mean_s: dict[int, float] = {}

    def observe(self, num_items: int, compute_s: float) -> None:
        """A batch of ``num_items`` computed in ``compute_s`` seconds."""
        if num_items < 1 or not (compute_s >= 0 and math.isfinite(compute_s)):
            return
        bucket = bucket_of(num_items)
        mean = self._mean_s.get(bucket)
        self._mean_s[bucket] = compute_s if mean is None else mean + SMOOTHING * (compute_s - mean)

    def predict_s(self, num_items: int) -> float:
        """The expected compute time of a batch of ``num_items``: its bucket's average;
        else the nearest larger bucket's (a batch is rarely slower than a larger one);
        else the largest smaller bucket's, scaled by size (an overestimate: time grows
        slower than size); 0.0 before any batch was measured."""
        means = self._mean_s
        if not means:
            return 0.0
        bucket = bucket_of(num_items)
        mean = means.get(bucket)
        if mean is not None:
            return mean
        larger = [b for b in means if b > bucket]
        if larger:
            return means[min(larger)]
        below = max(means)
        return means[below] * num_items / (1 << below)

    def as_dict(self) -> dict[int, float]:
        """Each measured bucket's upper batch size and its mean seconds."""
        return {1 << b: s for b, s in sorted(self._mean_s.items())}
