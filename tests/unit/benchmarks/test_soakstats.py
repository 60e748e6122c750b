"""soak.py's arithmetic (benchmarks/soakstats.py): how each attempt is counted, what a
run adds up to, and the targets' verdicts, on hand-made runs."""

from __future__ import annotations

from typing import Any

import pytest

from soakstats import (
    Outcome,
    Tally,
    Targets,
    check_targets,
    classify,
    health_summary,
    latency_ms,
    rss_summary,
    shortfall,
    summarise_load,
    table,
)


@pytest.mark.parametrize(
    ("status", "was_sent", "outcome"),
    [
        (200, True, Outcome.ANSWERED),
        (204, True, Outcome.ANSWERED),
        (429, True, Outcome.REFUSED),
        (503, True, Outcome.REFUSED),
        (504, True, Outcome.REFUSED),
        (400, True, Outcome.ERROR),
        (500, True, Outcome.ERROR),
        (None, True, Outcome.LOST),
        (None, False, Outcome.NOT_ACCEPTED),
    ],
)
def test_each_attempt_has_one_outcome(status: int | None, was_sent: bool, outcome: Outcome) -> None:
    assert classify(status, was_sent=was_sent) is outcome


def test_a_tally_times_answers_from_the_write_and_from_the_schedule() -> None:
    tally = Tally(start_s=100.0, duration_s=2.0)
    tally.answer(200, sent_s=100.5, now_s=100.75, scheduled_s=100.25)
    tally.answer(429, sent_s=100.5, now_s=100.502, scheduled_s=100.5)
    tally.answer(200, sent_s=101.0, now_s=101.5, scheduled_s=101.0)
    tally.answer(200, sent_s=101.5, now_s=102.5, scheduled_s=101.5)  # after the window
    tally.answer(404, sent_s=101.0, now_s=101.1, scheduled_s=101.0)
    assert tally.answered_s == [0.25, 0.5, 1.0]
    assert tally.answered_waited_s == [0.5, 0.5, 1.0]
    assert tally.refused_s == pytest.approx([0.002])
    assert tally.answered_per_s == [1, 1]
    assert tally.num_answered_in_window == 2


def test_a_load_summary_counts_by_status_and_outcome() -> None:
    tally = Tally(start_s=0.0, duration_s=4.0)
    for i in range(100):
        tally.answer(200, sent_s=0.0, now_s=0.001 * (i + 1), scheduled_s=0.0)
    for _ in range(30):
        tally.answer(429, sent_s=1.0, now_s=1.002, scheduled_s=1.0)
    tally.answer(503, sent_s=1.0, now_s=1.004, scheduled_s=1.0)
    tally.answer(400, sent_s=1.0, now_s=1.004, scheduled_s=1.0)
    tally.num_sent, tally.num_lost, tally.num_unanswered = 140, 3, 5
    tally.num_not_accepted, tally.num_unsent, tally.client_cpu_s = 7, 11, 2.0
    load = summarise_load(tally, target_rate_rps=50.0)
    assert load["statuses"] == {"200": 100, "400": 1, "429": 30, "503": 1}
    assert (load["num_answered"], load["num_refused"], load["num_errors"]) == (100, 31, 1)
    assert (load["num_lost"], load["num_unanswered"]) == (3, 5)
    assert (load["num_not_accepted"], load["num_unsent"]) == (7, 11)
    assert load["goodput_rps"] == 25.0
    assert load["offered_rate_rps"] == 35.0
    assert load["client_cpu_ratio"] == 0.5
    assert load["answered"]["count"] == 100
    assert load["answered"]["p50_ms"] == pytest.approx(50.5)
    assert load["answered"]["max_ms"] == pytest.approx(100.0)
    assert load["refused"]["p99_ms"] == pytest.approx(4.0, rel=0.2)


def test_latencies_of_nothing_are_none() -> None:
    assert latency_ms([]) is None
    assert latency_ms([0.001, 0.003])["p50_ms"] == pytest.approx(2.0)


def _load(**changes: Any) -> dict[str, Any]:
    load = {"target_rate_rps": 1000.0, "offered_rate_rps": 1000.0, "client_cpu_ratio": 0.3}
    return {**load, "num_unsent": 0, **changes}


def test_a_shortfall_of_the_offered_rate_says_why() -> None:
    assert shortfall(_load()) is None
    assert shortfall(_load(offered_rate_rps=960.0)) is None
    assert shortfall(_load(offered_rate_rps=500.0, client_cpu_ratio=0.97)) == "client CPU-bound"
    assert shortfall(_load(offered_rate_rps=500.0, num_unsent=10)) == "connection pool full"
    assert shortfall(_load(target_rate_rps=None, offered_rate_rps=5.0)) is None


def test_health_counts_every_probe_overlapping_the_window_and_its_failures() -> None:
    samples = [
        {"kind": "health", "t": 9.0, "latency_s": 0.5, "status": 200},  # before
        {"kind": "health", "t": 9.5, "latency_s": 1.0, "status": None},  # into the window
        {"kind": "health", "t": 11.0, "latency_s": 0.01, "status": 200},
        {"kind": "health", "t": 12.0, "latency_s": 0.02, "status": 503},
        {"kind": "health_kept", "t": 12.0, "latency_s": 0.02, "status": 200},
        {"kind": "rss", "t": 12.0, "rss_kib": 1},
        {"kind": "health", "t": 20.0, "latency_s": 0.01, "status": 200},  # after
    ]
    health = health_summary(samples, start=10.0, end=20.0)
    assert health["count"] == 3
    assert health["num_failed"] == 2
    assert health["statuses"] == {"None": 1, "200": 1, "503": 1}
    assert health["max_ms"] == pytest.approx(1000.0)
    assert health_summary(samples, 10.0, 20.0, kind="health_kept")["count"] == 1
    assert health_summary(samples, 30.0, 40.0) == {"count": 0, "num_failed": 0, "statuses": {}}


def _run(**load_changes: Any) -> dict[str, Any]:
    load = {
        "num_lost": 0,
        "num_unanswered": 0,
        "goodput_rps": 950.0,
        "refused": {"count": 5, "p50_ms": 1.0, "p99_ms": 4.0, "max_ms": 5.0},
        "answered": {"count": 5, "p50_ms": 100.0, "p99_ms": 400.0, "max_ms": 450.0},
        **load_changes,
    }
    return {
        "is_alive_at_end": True,
        "capacity_rps": 1000.0,
        "load": load,
        "health": {"count": 10, "p50_ms": 2.0, "p99_ms": 20.0, "max_ms": 21.0, "num_failed": 0},
        "rss": {"baseline_mib": 300.0, "peak_mib": 400.0, "after_mib": 320.0},
    }


def _verdicts(run: dict[str, Any], *, has_limits: bool = True) -> dict[str, bool | None]:
    return {c.name: c.passed for c in check_targets(run, Targets(), has_limits=has_limits)}


def test_a_run_within_every_target_passes_them_all() -> None:
    assert _verdicts(_run()) == {
        "accepted lost": True,
        "server alive": True,
        "goodput": True,
        "refusal p99": True,
        "answered p99": True,
        "health p99": True,
        "RSS growth": True,
        "RSS left after 5 s": True,
    }


def test_the_default_config_is_held_to_nothing_lost_and_bounded_memory_only() -> None:
    slow = _run(goodput_rps=10.0, answered={"count": 1, "p50_ms": 1, "p99_ms": 9e3, "max_ms": 1})
    assert _verdicts(slow, has_limits=False) == {
        "accepted lost": True,
        "server alive": True,
        "RSS growth": True,
        "RSS left after 5 s": True,
    }


@pytest.mark.parametrize(
    ("changes", "failed"),
    [
        ({"num_lost": 1}, "accepted lost"),
        ({"num_unanswered": 2}, "accepted lost"),
        ({"goodput_rps": 899.0}, "goodput"),
        ({"refused": {"count": 1, "p50_ms": 1.0, "p99_ms": 10.5, "max_ms": 11}}, "refusal p99"),
        ({"answered": {"count": 1, "p50_ms": 1.0, "p99_ms": 501.0, "max_ms": 9}}, "answered p99"),
    ],
)
def test_each_load_target_fails_alone_past_its_bound(changes: dict[str, Any], failed: str) -> None:
    verdicts = _verdicts(_run(**changes))
    assert [name for name, passed in verdicts.items() if passed is False] == [failed]


def test_health_fails_on_a_slow_or_a_failed_probe_and_memory_on_its_bounds() -> None:
    run = _run()
    run["health"] = {**run["health"], "p99_ms": 51.0}
    assert _verdicts(run)["health p99"] is False
    run["health"] = {**run["health"], "p99_ms": 1.0, "num_failed": 1}
    assert _verdicts(run)["health p99"] is False
    run = _run()
    run["rss"] = {"baseline_mib": 300.0, "peak_mib": 557.0, "after_mib": 351.0}
    verdicts = _verdicts(run)
    assert (verdicts["RSS growth"], verdicts["RSS left after 5 s"]) == (False, False)


def test_a_server_that_died_fails() -> None:
    run = _run()
    run["is_alive_at_end"] = False
    assert _verdicts(run, has_limits=False)["server alive"] is False


def test_a_target_with_nothing_to_measure_is_not_applicable() -> None:
    run = _run(refused=None)
    run["health"] = {"count": 0, "num_failed": 0}
    checks = {c.name: c for c in check_targets(run, Targets(), has_limits=True)}
    assert checks["refusal p99"].verdict == "n/a"
    assert checks["health p99"].verdict == "n/a"
    assert checks["goodput"].verdict == "PASS"


def test_rss_is_summed_up_in_mib_around_the_load() -> None:
    rss = rss_summary([1024 * 310, 1024 * 350, 1024 * 330], baseline_kib=1024 * 300, after_kib=0)
    assert rss == {
        "baseline_mib": 300.0,
        "per_s_mib": [310.0, 350.0, 330.0],
        "peak_mib": 350.0,
        "after_mib": 0.0,
    }
    assert rss_summary([], 1024, 1024)["peak_mib"] == 1.0


def test_the_table_has_a_line_per_run_even_without_refusals_or_probes() -> None:
    tally = Tally(start_s=0.0, duration_s=1.0)
    tally.answer(200, 0.0, 0.01, 0.0)
    tally.num_sent = 1
    run = {
        "name": "default-open",
        "capacity_rps": 10.0,
        "load": summarise_load(tally, 100.0),
        "health": {"count": 0, "num_failed": 0},
        "rss": rss_summary([2048], 1024, 1024),
    }
    lines = table([run]).splitlines()
    assert len(lines) == 3
    assert lines[2].startswith("default-open")
