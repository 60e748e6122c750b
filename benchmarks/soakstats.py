"""soak.py's arithmetic, apart from sockets and processes: how an answer is counted, what
a run adds up to, and the issue's targets checked against it.

An attempt ends in exactly one of these (``Outcome``):

* ``answered``: a 2xx;
* ``refused``: 429, 503 or 504, the statuses a server shedding load answers with;
* ``error``: any other status (a 4xx or 500 is a fault of the benchmark or the server);
* ``lost``: the request was written, then the connection was reset or closed (or answered
  bytes that are not HTTP) without a status;
* ``not_accepted``: the connection was refused (or closed by the server) before anything
  was sent;
* ``unanswered``: still waiting for its answer when the run gave up (``drain_s`` after
  the load stopped).

``lost`` and ``unanswered`` are requests the server accepted and never answered: the
target allows none. ``not_accepted`` and requests the client never managed to send
(``unsent``, open loop) are counted apart: the server never took them.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from carpool.tools.summary import Percentiles

REFUSAL_STATUSES = frozenset({429, 503, 504})
MIB = 1024 * 1024


class Outcome(enum.Enum):
    ANSWERED = "answered"
    REFUSED = "refused"
    ERROR = "error"
    LOST = "lost"
    NOT_ACCEPTED = "not_accepted"


def classify(status: int | None, *, was_sent: bool) -> Outcome:
    """An attempt's outcome from its HTTP status (None: the connection ended without one)."""
    if status is None:
        return Outcome.LOST if was_sent else Outcome.NOT_ACCEPTED
    if 200 <= status < 300:
        return Outcome.ANSWERED
    if status in REFUSAL_STATUSES:
        return Outcome.REFUSED
    return Outcome.ERROR


@dataclass(slots=True)
class Tally:
    """What one load phase saw, filled by the load generator as answers come.

    Times are ``time.perf_counter`` seconds. ``answered_s`` and ``refused_s`` count from
    when the request was written; ``answered_waited_s`` (open loop) from when it was
    scheduled, so it includes any wait for a free connection in the client.
    """

    start_s: float
    duration_s: float
    statuses: Counter[int] = field(default_factory=Counter)
    answered_s: list[float] = field(default_factory=list)
    refused_s: list[float] = field(default_factory=list)
    answered_waited_s: list[float] = field(default_factory=list)
    answered_per_s: list[int] = field(default_factory=list)  # by second of the window
    num_sent: int = 0
    num_lost: int = 0
    num_not_accepted: int = 0
    num_unanswered: int = 0
    num_unsent: int = 0
    client_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        self.answered_per_s = [0] * max(1, int(self.duration_s + 0.999))

    def answer(self, status: int, sent_s: float, now_s: float, scheduled_s: float) -> None:
        """Counts one answer (the hot path: no more than a few list appends)."""
        self.statuses[status] += 1
        if 200 <= status < 300:
            self.answered_s.append(now_s - sent_s)
            self.answered_waited_s.append(now_s - scheduled_s)
            second = int(now_s - self.start_s)
            if second < len(self.answered_per_s):
                self.answered_per_s[second] += 1
        elif status in REFUSAL_STATUSES:
            self.refused_s.append(now_s - sent_s)

    @property
    def num_answered_in_window(self) -> int:
        return sum(self.answered_per_s)


def latency_ms(values_s: list[float]) -> dict[str, float | int] | None:
    """Count, p50, p99 and max of ``values_s`` in milliseconds; None for none."""
    summary = Percentiles.of(values_s)
    if summary is None:
        return None
    return {
        "count": summary.count,
        "p50_ms": summary.p50_s * 1e3,
        "p99_ms": summary.p99_s * 1e3,
        "max_ms": summary.max_s * 1e3,
    }


def summarise_load(tally: Tally, target_rate_rps: float | None) -> dict[str, Any]:
    """A load phase as the JSON records it: counts by status and outcome, goodput
    (answers inside the window per second of it), offered rate (requests written per
    second of the window) against ``target_rate_rps``, and latencies."""
    num_refused = sum(n for s, n in tally.statuses.items() if s in REFUSAL_STATUSES)
    num_answered = sum(n for s, n in tally.statuses.items() if 200 <= s < 300)
    return {
        "duration_s": tally.duration_s,
        "target_rate_rps": target_rate_rps,
        "offered_rate_rps": tally.num_sent / tally.duration_s,
        "goodput_rps": tally.num_answered_in_window / tally.duration_s,
        "statuses": {str(s): n for s, n in sorted(tally.statuses.items())},
        "num_sent": tally.num_sent,
        "num_answered": num_answered,
        "num_refused": num_refused,
        "num_errors": sum(tally.statuses.values()) - num_answered - num_refused,
        "num_lost": tally.num_lost,
        "num_unanswered": tally.num_unanswered,
        "num_not_accepted": tally.num_not_accepted,
        "num_unsent": tally.num_unsent,
        "answered": latency_ms(tally.answered_s),
        "answered_from_schedule": latency_ms(tally.answered_waited_s),
        "refused": latency_ms(tally.refused_s),
        "answered_per_s": tally.answered_per_s,
        "client_cpu_ratio": tally.client_cpu_s / tally.duration_s,
    }


def shortfall(load: dict[str, Any]) -> str | None:
    """Why fewer requests were written than the target rate asked for, if they were:
    the generator spent its core (what one Python process could write is not what was
    asked for), or every connection of the pool was waiting for an answer (arrivals
    waited in the client: the server held them). None when at least 95% went out."""
    target = load["target_rate_rps"]
    if target is None or load["offered_rate_rps"] >= 0.95 * target:
        return None
    if load["client_cpu_ratio"] > 0.9:
        return "client CPU-bound"
    if load["num_unsent"]:
        return "connection pool full"
    return "unknown"


@dataclass(frozen=True, slots=True)
class Targets:
    """The issue's targets for 10x overload (``timeout_s``: the limits run's model
    ``timeout_s``; the RSS bounds are in MiB over the RSS before the load)."""

    timeout_s: float = 0.5
    goodput_ratio: float = 0.9
    refusal_p99_ms: float = 10.0
    health_p99_ms: float = 50.0
    rss_budget_mib: float = 256.0  # the issue's --max-inflight-bytes default
    rss_return_mib: float = 50.0  # left over 5 s after the load ends


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    limit: str
    measured: str
    passed: bool | None  # None: nothing to measure (no refusals, say)

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "n/a"}[self.passed]


def health_summary(
    samples: list[dict[str, Any]], start: float, end: float, kind: str = "health"
) -> dict[str, Any]:
    """The probes of ``kind`` (soakmonitor.py's records) that overlap [start, end): their
    latency (a failed probe counts with the time it took to fail), how many failed (no
    answer, or not a 200) and the statuses seen ("None": no answer)."""
    probes = [
        s
        for s in samples
        if s["kind"] == kind and s["t"] < end and s["t"] + s["latency_s"] >= start
    ]
    summary: dict[str, Any] = latency_ms([s["latency_s"] for s in probes]) or {"count": 0}
    summary["num_failed"] = sum(s["status"] != 200 for s in probes)
    summary["statuses"] = dict(Counter(str(s["status"]) for s in probes))
    return summary


def _p99(section: dict[str, Any] | None) -> float | None:
    return None if section is None else float(section["p99_ms"])


def _at_most(name: str, value: float | None, limit: float, unit: str) -> Check:
    if value is None:
        return Check(name, f"<= {limit:g} {unit}", "none measured", None)
    return Check(name, f"<= {limit:g} {unit}", f"{value:.1f} {unit}", value <= limit)


def _health_check(health: dict[str, Any], limit_ms: float) -> Check:
    """p99 of the probes within ``limit_ms``, and none of them failed."""
    p99, failed = _p99(health) if health["count"] else None, health["num_failed"]
    if p99 is None:
        return Check("health p99", f"<= {limit_ms:g} ms, none failed", "no probe", None)
    measured = f"{p99:.1f} ms, {failed} failed"
    return Check(
        "health p99", f"<= {limit_ms:g} ms, none failed", measured, p99 <= limit_ms and not failed
    )


def check_targets(run: dict[str, Any], targets: Targets, *, has_limits: bool) -> list[Check]:
    """The targets of one run: nothing accepted lost, the server alive at the end and RSS
    bounded always; with limits also goodput against the capacity measured before it,
    refusal and answer p99, and health p99 with no probe failed."""
    load = run["load"]
    lost = load["num_lost"] + load["num_unanswered"]
    checks = [Check("accepted lost", "0", str(lost), lost == 0)]
    alive = run["is_alive_at_end"]
    checks.append(Check("server alive", "yes", "yes" if alive else "no: it died", alive))
    if has_limits:
        capacity = run["capacity_rps"]
        floor = targets.goodput_ratio * capacity
        checks.append(
            Check(
                "goodput",
                f">= {targets.goodput_ratio:g} x {capacity:.0f} = {floor:.0f} req/s",
                f"{load['goodput_rps']:.0f} req/s",
                load["goodput_rps"] >= floor,
            )
        )
        checks.append(_at_most("refusal p99", _p99(load["refused"]), targets.refusal_p99_ms, "ms"))
        timeout_ms = targets.timeout_s * 1e3
        checks.append(_at_most("answered p99", _p99(load["answered"]), timeout_ms, "ms"))
        checks.append(_health_check(run["health"], targets.health_p99_ms))
    rss = run["rss"]
    growth = rss["peak_mib"] - rss["baseline_mib"]
    checks.append(_at_most("RSS growth", growth, targets.rss_budget_mib, "MiB"))
    left = rss["after_mib"] - rss["baseline_mib"]
    checks.append(_at_most("RSS left after 5 s", left, targets.rss_return_mib, "MiB"))
    return checks


def rss_summary(samples_kib: list[int], baseline_kib: int, after_kib: int) -> dict[str, Any]:
    """RSS in MiB: before the load, each second of it, its peak, and 5 s after it."""
    per_s = [kib / 1024 for kib in samples_kib]
    return {
        "baseline_mib": baseline_kib / 1024,
        "per_s_mib": per_s,
        "peak_mib": max([baseline_kib / 1024, *per_s]),
        "after_mib": after_kib / 1024,
    }


def _cell(section: dict[str, Any] | None, key: str) -> str:
    return "-" if section is None or key not in section else f"{section[key]:.1f}"


def table(runs: list[dict[str, Any]]) -> str:
    """One line per run: goodput against capacity, offered against target rate, outcome
    counts, p50/p99 of answers and refusals, health p99 and RSS."""
    header = (
        f"{'run':<16} {'capacity':>8} {'goodput':>8} {'target':>8} {'offered':>8} "
        f"{'2xx':>8} {'refused':>8} {'other':>6} {'lost':>5} {'unans':>5} {'notacc':>6} "
        f"{'ok p50':>7} {'ok p99':>7} {'ref p50':>7} {'ref p99':>7} {'hlth p99':>8} "
        f"{'RSS base':>8} {'peak':>7} {'after':>7}"
    )
    lines = [header, "(rates in req/s, latencies in ms, RSS in MiB)"]
    for run in runs:
        load, rss = run["load"], run["rss"]
        target = load["target_rate_rps"]
        lines.append(
            f"{run['name']:<16} {run['capacity_rps']:8.0f} {load['goodput_rps']:8.0f} "
            f"{'-' if target is None else f'{target:.0f}':>8} {load['offered_rate_rps']:8.0f} "
            f"{load['num_answered']:8d} {load['num_refused']:8d} {load['num_errors']:6d} "
            f"{load['num_lost']:5d} {load['num_unanswered']:5d} {load['num_not_accepted']:6d} "
            f"{_cell(load['answered'], 'p50_ms'):>7} {_cell(load['answered'], 'p99_ms'):>7} "
            f"{_cell(load['refused'], 'p50_ms'):>7} {_cell(load['refused'], 'p99_ms'):>7} "
            f"{_cell(run['health'], 'p99_ms'):>8} {rss['baseline_mib']:8.0f} "
            f"{rss['peak_mib']:7.0f} {rss['after_mib']:7.0f}"
        )
    return "\n".join(lines)
