"""Batch invariance and input-length variance, on NumPy models and synthetic timings."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from carpool.tools.doctor_checks import (
    LengthTiming,
    check_invariance,
    default_rtol,
    deviation,
    jitter_risk,
    length_report,
    measure_lengths,
    stack_padded,
    suggest_buckets,
    superlinear_steps,
)

Array = Any
RNG = np.random.default_rng(0)
W = RNG.standard_normal((8, 4)).astype(np.float32)


def outputs(fn: Callable[[Array], Array]) -> Callable[[Array], dict[str, Array]]:
    return lambda batch: {"output": fn(batch)}


def neighbours(shape: tuple[int, ...] = (8,)) -> dict[str, Callable[[int], Array]]:
    rng = np.random.default_rng(1)
    return {
        "random": lambda n: rng.standard_normal((n, *shape)).astype(np.float32),
        "large": lambda n: 1e3 * rng.standard_normal((n, *shape)).astype(np.float32),
        "zeros": lambda n: np.zeros((n, *shape), dtype=np.float32),
    }


def probes(shape: tuple[int, ...] = (8,)) -> list[Array]:
    return list(np.random.default_rng(2).standard_normal((2, *shape)).astype(np.float32))


def test_row_wise_model_passes() -> None:
    verdict = check_invariance(outputs(lambda b: np.tanh(b @ W)), probes(), neighbours(), [4, 8])
    assert verdict.is_passed, verdict.reasons
    assert {d.kind for d in verdict.deviations} == {"repeat", "random", "large", "zeros"}


def test_flags_subtracting_the_batch_mean() -> None:
    model = outputs(lambda b: (b - b.mean(axis=0, keepdims=True)) @ W)
    verdict = check_invariance(model, probes(), neighbours(), [4])
    assert not verdict.is_passed
    assert {d.kind for d in verdict.deviations if d.is_flagged} == {"random", "large", "zeros"}
    assert all("cross-sample dependency" in r for r in verdict.reasons)


def test_flags_a_dependency_on_position_only() -> None:
    model = outputs(lambda b: b + np.arange(len(b), dtype=b.dtype)[:, None])
    verdict = check_invariance(model, probes(), {"zeros": neighbours()["zeros"]}, [4])
    worst = next(d for d in verdict.deviations if d.kind == "zeros")
    assert worst.is_flagged and worst.position == 3


def test_flags_a_stochastic_model() -> None:
    rng = np.random.default_rng(3)
    model = outputs(lambda b: b * rng.random(b.shape))
    verdict = check_invariance(model, probes(), {}, [])
    assert any("not deterministic" in r for r in verdict.reasons)


def test_rtol_overrides_the_dtype_default() -> None:
    model = outputs(lambda b: b + 1e-4 * b.mean(axis=0, keepdims=True))
    assert not check_invariance(model, probes(), neighbours(), [4]).is_passed
    assert check_invariance(model, probes(), neighbours(), [4], rtol=1.0).is_passed


def test_flags_outputs_that_change_with_padding_only_where_they_do() -> None:
    shape = (4, 3)
    long = {"longer": lambda n: np.ones((n, 8, 3), dtype=np.float32)}
    args = (probes(shape), long, [4])
    mean = check_invariance(outputs(lambda b: b.mean(axis=1)), *args, pad_axis=0, pad_lengths=[8])
    total = check_invariance(outputs(lambda b: b.sum(axis=1)), *args, pad_axis=0, pad_lengths=[8])
    assert {d.kind for d in mean.deviations if d.is_flagged} == {"longer", "padding"}
    assert total.is_passed, total.reasons


def test_per_token_outputs_are_compared_on_the_real_positions() -> None:
    long = {"longer": lambda n: np.ones((n, 8, 3), dtype=np.float32)}
    verdict = check_invariance(outputs(lambda b: 2 * b), probes((4, 3)), long, [4], pad_axis=0)
    assert verdict.is_passed, verdict.reasons


def test_deviation_is_normwise_and_never_passes_nan() -> None:
    assert deviation(np.array([1.0, 0.0]), np.array([1.0, 1e-9])) == pytest.approx((1e-9, 1e-9))
    assert deviation(np.array([0.0]), np.array([0.0])) == (0.0, 0.0)
    assert deviation(np.array([np.nan]), np.array([1.0])) == (math.inf, math.inf)


def test_default_tolerances_by_dtype() -> None:
    assert default_rtol(np.float32) == 1e-5
    assert default_rtol(np.float16) == 1e-2
    assert default_rtol(np.int64) == 0.0


def test_stack_padded_pads_the_variable_axis_with_zeros() -> None:
    batch = stack_padded([np.ones((2, 3)), np.ones((4, 3))], axis=0)
    assert batch.shape == (2, 4, 3)
    assert batch[0, 2:].sum() == 0


# -- lengths --------------------------------------------------------------------------------


def test_buckets_merge_flat_lengths_and_split_where_time_grows() -> None:
    # flat (overhead-bound) up to 64, then linear, then quadratic
    points = [(8, 1.0), (16, 1.0), (32, 1.05), (64, 1.2), (128, 2.4), (256, 9.6)]
    assert suggest_buckets(points) == [64, 128, 256]
    assert superlinear_steps(points) == [(128, 256, pytest.approx(2.0))]


def test_jitter_risk_compares_mixed_with_uniform_variation() -> None:
    assert jitter_risk(0.02, 0.4)[0] == "high"
    assert jitter_risk(0.02, 0.15)[0] == "moderate"
    assert jitter_risk(0.05, 0.06)[0] == "low"


def test_length_report_summarises_uniform_and_mixed_timings() -> None:
    timings = [LengthTiming(8, 0.001, 0.01), LengthTiming(256, 0.01, 0.03)]
    report = length_report(4, timings, [0.001, 0.01, 0.01, 0.001], 0.5)
    assert report.cv_uniform == pytest.approx(0.02)
    assert report.jitter_risk == "high"
    assert report.bucket_edges == [8, 256]


def test_measure_lengths_times_with_the_injected_clock() -> None:
    now = [0.0]

    def model(batch: Array) -> dict[str, Array]:
        now[0] += 1e-5 * batch.shape[1]  # time grows with the padded length
        return {"output": batch.sum(axis=(1, 2))}

    report = measure_lengths(
        model,
        lambda n: np.ones((n, 2), dtype=np.float32),
        [8, 32, 128],
        4,
        axis=0,
        repeats=3,
        warmup=1,
        rng=np.random.default_rng(0),
        clock=lambda: now[0],
    )
    assert [t.median_s for t in report.timings] == pytest.approx([8e-5, 32e-5, 128e-5])
    assert report.cv_uniform == pytest.approx(0.0, abs=1e-9)
    assert report.bucket_edges == [8, 32, 128]
    assert 0.0 < report.padding_waste < 1.0


def _nan_where_negative(batch: np.ndarray) -> dict[str, np.ndarray]:
    """Row-wise: log of the first feature, NaN for negative inputs, whatever the batch."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"output": np.log(batch[:, :1].astype(np.float64))}


def test_nan_outputs_that_batching_does_not_change_pass() -> None:
    rng = np.random.default_rng(0)
    probes = [np.array([-1.0, 2.0]), np.array([3.0, 1.0])]
    verdict = check_invariance(
        _nan_where_negative,
        probes,
        {"random": lambda n: rng.standard_normal((n, 2))},
        [8],
    )
    assert verdict.is_passed, verdict.reasons


def test_nan_that_only_batching_produces_is_flagged_at_that_size_only() -> None:
    def leaks_at_eight(batch: np.ndarray) -> dict[str, np.ndarray]:
        out = batch[:, :1].astype(np.float64).copy()
        if len(batch) >= 8:
            out[:] = np.nan
        return {"output": out}

    rng = np.random.default_rng(0)
    verdict = check_invariance(
        leaks_at_eight,
        [np.array([1.0, 2.0])],
        {"random": lambda n: rng.standard_normal((n, 2))},
        [2, 8],
    )
    assert not verdict.is_passed
    [flagged] = [d for d in verdict.deviations if d.is_flagged]
    assert flagged.batch_size == 8 and flagged.max_rel == math.inf


def test_deviation_matches_nan_and_inf_in_the_same_places() -> None:
    ref = np.array([np.nan, np.inf, -np.inf, 1.0])
    assert deviation(ref.copy(), ref) == (0.0, 0.0)
    moved = np.array([np.nan, np.inf, -np.inf, 1.5])
    assert deviation(moved, ref) == pytest.approx((0.5, 0.5 / 1.5))
    assert deviation(np.array([np.nan, np.inf, np.inf, 1.0]), ref) == (math.inf, math.inf)
    assert deviation(np.array([1.0, np.inf, -np.inf, 1.0]), ref) == (math.inf, math.inf)
