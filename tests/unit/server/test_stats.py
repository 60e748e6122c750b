"""A model's statistics (carpool.server.stats) as Triton's statistics extension counts them."""

from __future__ import annotations

import numpy as np
import pytest

from carpool.server.stats import model_stats

from .apps import served


def broken(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    raise RuntimeError("boom")


async def test_stats_count_only_successful_inferences() -> None:
    # Triton: inference_count / execution_count are the cumulative counts of *successful*
    # inferences / executions. A model that raised on its only batch has done none.
    model = served(broken)
    await model.batcher.start()
    try:
        with pytest.raises(Exception, match="boom"):
            await model.run({"x": np.ones((3, 2), np.float32)}, {})
    finally:
        await model.batcher.stop()
    stats = model_stats(model)
    assert stats["inference_stats"]["fail"]["count"] == 1
    assert (stats["inference_count"], stats["execution_count"]) == (0, 0)
