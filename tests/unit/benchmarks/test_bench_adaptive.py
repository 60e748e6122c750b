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


def test_the_sweep_runs_every_setting_at_each_load_in_a_turning_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[tuple[str, str]] = []  # (load, setting) in the order they ran
    policies: list[dict[str, Any]] = []

    def goodput(url: str, work: Any, flags: list[str], duration_s: float) -> dict[str, Any]:
        load = next(label for label, f, _ in loads if f == flags)
        setting = "aimd" if aimd_on else _name(policies[-1])
        ran.append((load, setting))
        return {"goodput_rps": 1.0, "p50_ms": 1.0, "p99_ms": 1.0}

    def _name(policy: dict[str, Any]) -> str:
        if policy["max_delay_s"] == "auto":
            return "auto"
        return f"fixed {policy['max_delay_s'] * 1e3:g} ms x {policy['max_batch_size']}"

    aimd_on = False

    class Aimd:
        def __init__(self, url: str, work: Any) -> None:
            pass

        def __enter__(self) -> None:
            nonlocal aimd_on
            aimd_on = True

        def __exit__(self, *exc: object) -> None:
            nonlocal aimd_on
            aimd_on = False

    class Trace:
        def __init__(self, url: str, model: str) -> None:
            self.samples: list[Any] = []

        def __enter__(self) -> Trace:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    class Response:
        def json(self) -> dict[str, Any]:
            return {"adaptive": {}}

    loads = bench_adaptive._loads(1000.0, True, True)
    monkeypatch.setattr(bench_adaptive, "goodput", goodput)
    monkeypatch.setattr(bench_adaptive, "set_policy", lambda url, m, **p: policies.append(p))
    monkeypatch.setattr(bench_adaptive, "Aimd", Aimd)
    monkeypatch.setattr(bench_adaptive, "PolicyTrace", Trace)
    monkeypatch.setattr(bench_adaptive.httpx, "get", lambda *a, **k: Response())

    sweep = bench_adaptive.run_sweep("url", bench_adaptive.W1, 1000.0, True)

    settings = list(sweep["table"])
    labels = [label for label, _, _ in loads]
    assert [load for load, _ in ran] == [lb for lb in labels for _ in settings]  # load by load
    for i, label in enumerate(labels):
        order = [setting for load, setting in ran if load == label]
        assert order == settings[i:] + settings[:i]  # every setting, turned by one a load


def test_names_the_sweep_does_not_have_are_refused_with_the_ones_it_has() -> None:
    w1 = bench_adaptive.W1
    assert bench_adaptive.unknown_names(w1, False, ["poisson 110%", "day/night"], None) is None
    assert bench_adaptive.unknown_names(w1, False, None, ["fixed 10 ms x 64", "aimd"]) is None
    problem = bench_adaptive.unknown_names(w1, True, ["poisson 111%"], None)
    assert problem is not None and problem.startswith("--loads: unknown poisson 111%;")
    assert "poisson 110%" in problem
    problem = bench_adaptive.unknown_names(w1, True, None, ["fixed 5 ms x 64"])
    assert problem is not None and "--settings: unknown fixed 5 ms x 64;" in problem
    assert "(this grid: --quick)" in problem  # 5 ms is in the full grid only
