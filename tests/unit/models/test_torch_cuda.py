"""The torch runner's GPU options where they run without a GPU: graph sizes, the bucket a
batch runs in, padding accounting, and the CPU fallbacks of ``cuda_graphs`` and
``autocast`` (logged, never raised). The GPU runs are in test_cuda_torch_path.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from carpool import ConfigError
from carpool.core.buffer_pool import BufferPool
from carpool.models.mlp import build_w1
from carpool.models.torch import TorchRunner
from carpool.models.torch_cuda import GraphStats, autocast_dtype, graph_size_for, graph_sizes


@pytest.mark.parametrize(
    ("preferred", "max_batch_size", "sizes"),
    [
        ((), 8, (1, 2, 4, 8)),
        ((), 12, (1, 2, 4, 8, 12)),
        ((), 1, (1,)),
        ((16, 4, 4), 64, (4, 16)),
    ],
)
def test_graph_sizes_are_the_preferred_else_powers_of_two(preferred, max_batch_size, sizes):
    assert graph_sizes(preferred, max_batch_size) == sizes


def test_graph_sizes_refuse_sizes_below_one():
    with pytest.raises(ConfigError, match="batch sizes >= 1"):
        graph_sizes((0, 4), 8)


@pytest.mark.parametrize(("rows", "size"), [(1, 1), (3, 4), (4, 4), (5, 8), (8, 8), (9, None)])
def test_a_batch_runs_in_the_smallest_graph_that_holds_it(rows, size):
    assert graph_size_for(rows, (1, 2, 4, 8)) == size


def test_padding_is_counted_per_graph_batch():
    stats = GraphStats()
    for rows in (3, 4, 5, 9):
        stats.count(rows, graph_size_for(rows, (1, 2, 4, 8)))
    assert (stats.graph_batches, stats.eager_batches) == (3, 1)
    assert (stats.rows, stats.padded_rows) == (12, 1 + 0 + 3)
    assert stats.padding_share == pytest.approx(4 / 16)
    assert GraphStats().padding_share == 0.0


def test_autocast_on_a_cpu_falls_back_with_a_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="carpool.models.torch"):  # seen by default
        assert autocast_dtype(True, torch.device("cpu"), None) is None
    assert "needs a CUDA device" in caplog.text
    assert autocast_dtype(False, torch.device("cuda"), None) is None
    assert autocast_dtype(True, torch.device("cuda"), None) is torch.float16
    assert autocast_dtype(True, torch.device("cuda"), torch.bfloat16) is None  # dtype: given


def test_gpu_options_on_a_cpu_runner_log_and_run_eagerly(caplog):
    x = np.random.default_rng(0).standard_normal((5, 256), dtype=np.float32)
    plain = TorchRunner(build_w1(), input_names=["x"], output_names=["y"])
    with caplog.at_level(logging.WARNING, logger="carpool.models.torch"):  # seen by default
        runner = TorchRunner(
            build_w1(), input_names=["x"], output_names=["y"], autocast=True, cuda_graphs=(4, 8)
        )
    assert "cuda_graphs: true needs a CUDA device" in caplog.text
    assert runner.graphs is None and runner.autocast is None and runner.precision == "float32"
    np.testing.assert_array_equal(runner({"x": x})["y"], plain({"x": x})["y"])


def test_pool_on_a_cpu_keeps_ordinary_memory():
    pool = BufferPool(1 << 20, pin_memory=True)
    buffer = pool.acquire_numpy((4, 4), np.float32)
    assert not pool.pin_memory and isinstance(buffer, np.ndarray)
