"""The torch runner's GPU path on a CUDA GPU: pinned pool buffers, copies on a copy stream,
CUDA graphs at fixed sizes with padding, autocast. Skipped where torch sees no GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from carpool.core.buffer_pool import BufferPool
from carpool.models.mlp import build_w1
from carpool.models.torch import TorchRunner

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch sees none here"
)


def _w1(**options: object) -> TorchRunner:
    return TorchRunner(
        build_w1(), input_names=["x"], output_names=["y"], device="cuda:0", **options
    )


def test_pool_buffers_are_pinned_on_a_cuda_device():
    pool = BufferPool(1 << 24, pin_memory=True)
    buffer = pool.acquire_numpy((8, 256), np.float32)
    assert pool.pin_memory and torch.from_numpy(buffer).is_pinned()


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_cuda_graphs_give_the_eager_outputs_and_count_padding(rows):
    x = np.random.default_rng(rows).standard_normal((rows, 256), dtype=np.float32)
    eager = _w1()({"x": x})["y"]
    graphed = _w1(cuda_graphs=(1, 2, 4, 8))
    for _ in range(2):  # captured on the first call, replayed on the second
        np.testing.assert_allclose(graphed({"x": x})["y"], eager, rtol=1e-4, atol=1e-4)
    stats = graphed.graphs.stats
    if rows > 8:
        assert stats.eager_batches == 2
    else:
        size = next(s for s in (1, 2, 4, 8) if s >= rows)
        assert stats.padded_rows == 2 * (size - rows)


def test_autocast_runs_float16_and_stays_close():
    x = np.random.default_rng(0).standard_normal((16, 256), dtype=np.float32)
    want = _w1()({"x": x})["y"]
    runner = _w1(autocast=True)
    assert runner.precision == "float16"
    got = runner({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * float(np.abs(want).max()))


def test_copies_from_pinned_pool_buffers_give_the_same_outputs():
    pool = BufferPool(1 << 24, pin_memory=True)
    x = np.random.default_rng(1).standard_normal((32, 256), dtype=np.float32)
    pinned = pool.acquire_numpy((32, 256), np.float32)
    pinned[:] = x
    runner = _w1()
    np.testing.assert_array_equal(runner({"x": pinned})["y"], runner({"x": x})["y"])
