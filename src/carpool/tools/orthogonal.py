"""Taguchi orthogonal arrays, built from Galois fields, and main-effect analysis.

An orthogonal array ``L_n(q^m)`` has ``n`` runs (rows) and ``m`` factors (columns) of ``q``
levels each; in every pair of columns every pair of levels appears equally often (strength
2). So ``n`` trials estimate every factor's main effect as if each were varied alone, with
the others balanced out, where a full grid would take ``q^m`` trials.

Construction (Bose, Rao): over the field GF(q), the runs are every vector ``r`` of GF(q)^k
and the columns every direction ``c`` of GF(q)^k (non-zero, first non-zero entry 1); the
entry is the dot product ``r . c``. That gives ``q^k`` runs and ``(q^k - 1)/(q - 1)``
columns::

    q=2, k=2,3,4,5   L4(2^3)  L8(2^7)  L16(2^15)  L32(2^31)   (Sylvester-Hadamard)
    q=3, k=2,3       L9(3^4)  L27(3^13)
    q=4, k=2,3       L16(4^5) L64(4^21)
    q=5, 7, 8; k=2   L25(5^6) L49(7^8) L64(8^9)

A factor with fewer levels than its column takes the column through a "dummy level" map
(``level mod num_levels``): balanced exactly when ``num_levels`` divides ``q``, nearly so
otherwise.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from functools import cache

import numpy as np
import numpy.typing as npt

from carpool.errors import ConfigError

Levels = npt.NDArray[np.int64]

# Irreducible polynomials (bit i = coefficient of x^i) for the fields GF(2^m) used here.
_IRREDUCIBLE_2M = {4: 0b111, 8: 0b1011}
# (q, k) of every array offered, by number of runs then levels.
_CATALOG = ((2, 2), (3, 2), (2, 3), (2, 4), (4, 2), (5, 2), (3, 3), (2, 5), (7, 2), (4, 3), (8, 2))


@dataclass(frozen=True, slots=True)
class OrthogonalArray:
    """``levels[run, column]`` in ``0..num_levels-1``; ``name`` as Taguchi writes it."""

    num_levels: int
    levels: Levels

    @property
    def num_runs(self) -> int:
        return int(self.levels.shape[0])

    @property
    def num_columns(self) -> int:
        return int(self.levels.shape[1])

    @property
    def name(self) -> str:
        return f"L{self.num_runs}({self.num_levels}^{self.num_columns})"


class _Field:
    """Addition and multiplication tables of GF(q) for q prime or 4 or 8."""

    def __init__(self, q: int) -> None:
        elems = range(q)
        if q in _IRREDUCIBLE_2M:
            poly = _IRREDUCIBLE_2M[q]
            self.add = np.array([[a ^ b for b in elems] for a in elems], dtype=np.int64)
            self.mul = np.array([[_gf2_mul(a, b, poly, q) for b in elems] for a in elems])
        elif _is_prime(q):
            self.add = np.array([[(a + b) % q for b in elems] for a in elems], dtype=np.int64)
            self.mul = np.array([[(a * b) % q for b in elems] for a in elems], dtype=np.int64)
        else:
            raise ConfigError("num_levels", q, "a prime, 4 or 8 (a Galois field order)")


def _gf2_mul(a: int, b: int, poly: int, q: int) -> int:
    """Carry-less product of a and b modulo ``poly`` (GF(2^m) multiplication)."""
    out = 0
    while b:
        if b & 1:
            out ^= a
        b >>= 1
        a <<= 1
        if a & q:
            a ^= poly
    return out


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


@cache
def orthogonal_array(num_levels: int, power: int) -> OrthogonalArray:
    """The array ``L_{q^k}(q^{(q^k-1)/(q-1)})`` for ``q = num_levels``, ``k = power``.

    Raises:
        ConfigError: when ``num_levels`` is not a supported field order or ``power < 2``.
    """
    if power < 2:
        raise ConfigError("power", power, "an integer >= 2")
    field = _Field(num_levels)
    runs = list(itertools.product(range(num_levels), repeat=power))
    directions = [c for c in runs if any(c) and c[next(i for i, x in enumerate(c) if x)] == 1]
    table = np.zeros((len(runs), len(directions)), dtype=np.int64)
    for i, r in enumerate(runs):
        for j, c in enumerate(directions):
            acc = 0
            for ri, ci in zip(r, c, strict=True):
                acc = int(field.add[acc, field.mul[ri, ci]])
            table[i, j] = acc
    return OrthogonalArray(num_levels, table)


def is_orthogonal(levels: Levels, num_levels_per_column: list[int] | None = None) -> bool:
    """Whether every pair of columns holds every pair of levels equally often."""
    num_columns = levels.shape[1]
    counts = num_levels_per_column or [int(levels[:, j].max()) + 1 for j in range(num_columns)]
    for a, b in itertools.combinations(range(num_columns), 2):
        pairs = Counter(zip(levels[:, a].tolist(), levels[:, b].tolist(), strict=True))
        if len(pairs) != counts[a] * counts[b] or len(set(pairs.values())) != 1:
            return False
    return True


@dataclass(frozen=True, slots=True)
class Design:
    """An array fitted to factors: ``levels[run, factor]`` within each factor's levels."""

    array: OrthogonalArray
    levels: Levels
    is_exact: bool  # every factor's level count divides the array's: strictly orthogonal

    @property
    def num_runs(self) -> int:
        return int(self.levels.shape[0])


def design_for(num_levels: list[int]) -> Design:
    """The smallest orthogonal array with a column for each factor (``num_levels[i]`` levels),
    preferring, among arrays of equal size, one that is exactly orthogonal for these factors.

    Raises:
        ConfigError: when a factor has more than 8 levels or there are too many factors.
    """
    if not num_levels or any(n < 1 for n in num_levels):
        raise ConfigError("factors", num_levels, "at least one factor, each with >= 1 level")
    best: tuple[int, bool, OrthogonalArray] | None = None
    for q, k in _CATALOG:
        num_runs, num_columns = q**k, (q**k - 1) // (q - 1)
        if max(num_levels) > q or len(num_levels) > num_columns:
            continue
        exact = all(q % n == 0 for n in num_levels)
        key = (num_runs, not exact)
        if best is None or key < (best[0], not best[1]):
            best = (num_runs, exact, orthogonal_array(q, k))
    if best is None:
        raise ConfigError(
            "factors",
            num_levels,
            "at most 8 levels per factor and at most 31 factors for an orthogonal array "
            "(use the grid or hill search instead)",
        )
    _, exact, array = best
    columns = array.levels[:, : len(num_levels)]
    fitted = np.stack([columns[:, j] % n for j, n in enumerate(num_levels)], axis=1)
    return Design(array, fitted.astype(np.int64), exact)


@dataclass(frozen=True, slots=True)
class FactorEffect:
    """Mean response at each level of one factor, its range, and its importance rank (1 =
    matters most). ``sn_db`` is the larger-is-better signal-to-noise ratio per level."""

    factor: str
    level_means: tuple[float, ...]
    delta: float
    rank: int
    best_level: int
    sn_db: tuple[float, ...] | None


def main_effects(
    factors: list[str],
    levels: Levels,
    responses: npt.ArrayLike,
    *,
    with_sn: bool = False,
) -> list[FactorEffect]:
    """Main effects of each factor on ``responses`` (one per run; NaN runs are left out).

    A level that no run with a response reached has a NaN mean. Ranks order the factors by
    ``delta`` (largest first).
    """
    y = np.asarray(responses, dtype=np.float64)
    if y.shape != (levels.shape[0],):
        raise ConfigError("responses", y.shape, f"one per run ({levels.shape[0]})")
    keep = np.isfinite(y)
    raw: list[tuple[str, tuple[float, ...], float, tuple[float, ...] | None]] = []
    for j, factor in enumerate(factors):
        column = levels[keep, j]
        values = y[keep]
        count = int(levels[:, j].max()) + 1
        means = tuple(
            float(values[column == lv].mean()) if np.any(column == lv) else math.nan
            for lv in range(count)
        )
        finite = [m for m in means if not math.isnan(m)]
        delta = max(finite) - min(finite) if finite else 0.0
        sn = tuple(_sn_larger_better(values[column == lv]) for lv in range(count))
        raw.append((factor, means, delta, sn if with_sn else None))
    order = sorted(range(len(raw)), key=lambda i: -raw[i][2])
    ranks = {i: r + 1 for r, i in enumerate(order)}
    return [
        FactorEffect(
            factor=name,
            level_means=means,
            delta=delta,
            rank=ranks[i],
            best_level=int(np.nanargmax(means)) if any(not math.isnan(m) for m in means) else 0,
            sn_db=sn,
        )
        for i, (name, means, delta, sn) in enumerate(raw)
    ]


def _sn_larger_better(values: npt.NDArray[np.float64]) -> float:
    """-10 log10(mean(1 / y^2)): higher when responses are large and consistent."""
    positive = values[values > 0]
    if positive.size == 0:
        return math.nan
    return float(-10.0 * np.log10(np.mean(1.0 / positive**2)))
