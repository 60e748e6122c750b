"""The values ``carpool bench`` passes between its sweep (``bench.py``) and its report
(``benchreport.py``): what to run, and what one point of the sweep measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from carpool.tools.loadgen import ArrivalProcess, Times
from carpool.tools.serverstats import ServerStats
from carpool.tools.summary import Summary
from carpool.tools.targets import TargetSpec


@dataclass(frozen=True, slots=True)
class Point:
    """One point of the sweep: closed loop at ``concurrency``, or open loop on ``arrivals``
    (a steady rate or a schedule) or a replayed ``trace``."""

    label: str
    concurrency: int | None = None
    arrivals: ArrivalProcess | None = None
    trace: Times | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    spec: TargetSpec
    points: tuple[Point, ...]
    duration_s: float
    warmup_s: float
    seed: int
    drain_timeout_s: float
    json_path: Path | None
    csv_path: Path | None
    plots_dir: Path | None
    show_progress: bool
    html_path: Path | None = None  # the self-contained report (tools/report.py)


@dataclass(frozen=True, slots=True)
class PointResult:
    label: str
    summary: Summary
    server: ServerStats | None
    latencies_s: list[float]  # successful requests, for the CDF plot (not in the JSON)
