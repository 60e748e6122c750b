"""bench_engine_handoff: both ways answer every request, and the figures are read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def test_a_short_run_answers_both_ways_and_writes_a_row_per_group(tmp_path: Path) -> None:
    out = tmp_path / "handoff.json"
    cpu = str(min(os.sched_getaffinity(0)))
    subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_engine_handoff.py"), "--groups", "4,16",
         "--requests", "256", "--repeat", "2", "--cpu", cpu, "--json", str(out)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [row["requests_per_turn"] for row in rows] == [4, 16]
    for row in rows:
        assert row["direct_cpu_us"] > 0 and row["peer_cpu_us"] > 0
        assert len(row["runs"]["direct"]) == len(row["runs"]["peer"]) == 2
        difference = row["peer_cpu_us"] - row["direct_cpu_us"]
        assert abs(row["handoff_cpu_us"] - difference) <= 0.011  # each figure rounded apart
