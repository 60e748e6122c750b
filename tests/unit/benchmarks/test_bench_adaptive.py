"""bench_adaptive: the sweep repeated on fresh servers, and each load's median ratio."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import bench_adaptive


def _sweep(ratios: dict[str, float], total: float) -> dict[str, Any]:
    return {
        "per_load": {load: {"auto_over_best_fixed": r} for load, r in ratios.items()},
        "auto_over_single_fixed_total": total,
    }


def test_rounds_each_get_a_fresh_server_and_report_each_loads_median(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    served: list[str] = []
    sweeps = iter(
        [
            _sweep({"poisson 110%": 0.8, "bursty 70%": 1.0}, 0.9),
            _sweep({"poisson 110%": 1.2, "bursty 70%": 0.7}, 1.1),
            _sweep({"poisson 110%": 0.9, "bursty 70%": 0.95}, 0.95),
        ]
    )

    @contextmanager
    def serving(config: str) -> Iterator[str]:
        served.append(f"server {len(served)}")
        yield served[-1]

    monkeypatch.setattr(bench_adaptive, "serving", serving)
    monkeypatch.setattr(bench_adaptive, "measure_capacity", lambda url, work, quick: 3000.0)
    monkeypatch.setattr(bench_adaptive, "run_sweep", lambda url, *args: next(sweeps) | {"on": url})
    monkeypatch.setattr(bench_adaptive, "print_sweep", lambda sweep: None)

    out = bench_adaptive.sweep_rounds(bench_adaptive.W1, False, 3, None, None)

    assert [r["sweep"]["on"] for r in out["rounds"]] == ["server 0", "server 1", "server 2"]
    per_load = out["medians"]["per_load"]
    assert per_load["poisson 110%"] == {"auto_over_best_fixed": [0.8, 1.2, 0.9], "median": 0.9}
    assert per_load["bursty 70%"]["median"] == 0.95
    assert out["medians"]["auto_over_single_fixed_total_median"] == 0.95
