"""Orthogonal arrays are built, not pasted: every one is checked orthogonal here."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from carpool.errors import ConfigError
from carpool.tools.orthogonal import design_for, is_orthogonal, main_effects, orthogonal_array

TAGUCHI = [  # (levels, power, runs, columns)
    (2, 2, 4, 3),
    (2, 3, 8, 7),
    (3, 2, 9, 4),
    (2, 4, 16, 15),
    (4, 2, 16, 5),
    (3, 3, 27, 13),
    (5, 2, 25, 6),
    (2, 5, 32, 31),
    (7, 2, 49, 8),
    (4, 3, 64, 21),
    (8, 2, 64, 9),
]


@pytest.mark.parametrize(("q", "k", "runs", "columns"), TAGUCHI)
def test_every_array_is_orthogonal_with_the_taguchi_size(
    q: int, k: int, runs: int, columns: int
) -> None:
    array = orthogonal_array(q, k)
    assert (array.num_runs, array.num_columns) == (runs, columns)
    assert array.name == f"L{runs}({q}^{columns})"
    assert array.levels.min() == 0 and array.levels.max() == q - 1
    assert is_orthogonal(array.levels, [q] * columns)


def test_each_level_appears_equally_often_in_every_column() -> None:
    array = orthogonal_array(3, 3)
    for column in array.levels.T:
        assert np.bincount(column).tolist() == [9, 9, 9]


def test_is_orthogonal_detects_a_broken_array() -> None:
    broken = orthogonal_array(2, 3).levels.copy()
    broken[0, 0] = 1 - broken[0, 0]
    assert not is_orthogonal(broken)


def test_a_full_factorial_of_two_factors_is_orthogonal_but_correlated_columns_are_not() -> None:
    full = np.array(list(itertools.product(range(3), range(3))))
    assert is_orthogonal(full)
    assert not is_orthogonal(np.stack([full[:, 0], full[:, 0]], axis=1))


@pytest.mark.parametrize(
    ("levels", "name", "is_exact"),
    [
        ([2, 2, 2], "L4(2^3)", True),
        ([2, 2, 2, 2], "L8(2^7)", True),
        ([3, 3, 3], "L9(3^4)", True),
        ([2] * 8, "L16(2^15)", True),
        ([4, 4, 2], "L16(4^5)", True),
        ([3] * 5, "L16(4^5)", False),  # dummy levels: 16 runs beat L27's 27
        ([3] * 7, "L27(3^13)", True),
        ([5, 5], "L25(5^6)", True),
        ([2, 3], "L9(3^4)", False),
    ],
)
def test_design_picks_the_smallest_array_that_fits(
    levels: list[int], name: str, is_exact: bool
) -> None:
    design = design_for(levels)
    assert design.array.name == name
    assert design.is_exact is is_exact
    assert design.levels.shape == (design.array.num_runs, len(levels))
    for j, n in enumerate(levels):
        assert set(design.levels[:, j].tolist()) == set(range(n))
    if is_exact:
        assert is_orthogonal(design.levels, levels)


def test_equal_runs_prefer_the_exact_array() -> None:
    # L16(2^15) and L16(4^5) both have 16 runs; only L16(4^5) holds a 4-level factor exactly.
    assert design_for([4, 2, 2, 2, 2]).array.name == "L16(4^5)"
    assert design_for([2] * 5).array.name == "L8(2^7)"


@pytest.mark.parametrize("levels", [[9], [2] * 32, [], [0]])
def test_design_refuses_what_no_array_holds(levels: list[int]) -> None:
    with pytest.raises(ConfigError):
        design_for(levels)


def test_unsupported_field_orders_are_refused() -> None:
    with pytest.raises(ConfigError, match="Galois"):
        orthogonal_array(6, 2)
    with pytest.raises(ConfigError):
        orthogonal_array(2, 1)


def test_main_effects_recover_an_additive_response_exactly() -> None:
    design = design_for([3, 3, 3, 3])  # L9
    true = [np.array([0.0, 1.0, 2.0]), np.array([0.0, 10.0, 5.0]),
            np.array([3.0, 0.0, 0.0]), np.array([0.0, 0.5, 0.2])]  # fmt: skip
    response = 100 + sum(true[j][design.levels[:, j]] for j in range(4))
    effects = main_effects(["a", "b", "c", "d"], design.levels, response)
    assert [e.rank for e in effects] == [3, 1, 2, 4]
    assert [e.best_level for e in effects] == [2, 1, 0, 1]
    # Orthogonality balances the others out: each level mean is the grand mean plus its effect.
    grand = 100 + sum(t.mean() for t in true)
    for effect, t in zip(effects, true, strict=True):
        assert np.allclose(effect.level_means, grand + t - t.mean())
        assert effect.delta == pytest.approx(t.max() - t.min())


def test_main_effects_rank_factors_of_a_noisy_response() -> None:
    design = design_for([2] * 7)  # L8
    rng = np.random.default_rng(0)
    weights = [5.0, 0.0, 2.0, 0.0, 0.0, 9.0, 0.0]
    response = design.levels @ np.array(weights) + rng.normal(0, 0.1, design.num_runs)
    effects = main_effects([f"f{i}" for i in range(7)], design.levels, response)
    top = sorted(effects, key=lambda e: e.rank)[:3]
    assert [e.factor for e in top] == ["f5", "f0", "f2"]


def test_main_effects_skip_missing_responses_and_compute_sn() -> None:
    design = design_for([2, 2, 2])
    response = np.array([1.0, 2.0, np.nan, 4.0])
    effects = main_effects(["a", "b", "c"], design.levels, response, with_sn=True)
    for effect in effects:
        assert effect.sn_db is not None and len(effect.sn_db) == 2
        assert all(np.isfinite(m) for m in effect.level_means)
    with pytest.raises(ConfigError):
        main_effects(["a"], design.levels[:, :1], [1.0, 2.0])
