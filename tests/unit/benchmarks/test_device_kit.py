"""benchmarks/device/run.sh, the steps a lent GPU machine runs. The kit is used rarely, so a
renamed benchmark flag would first show there, in the device's few minutes: every
benchmark command it names must still parse. And its exit status must say when a step
failed, with each step's in summary.txt."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
RUN = BENCHMARKS / "device" / "run.sh"


def _commands() -> list[tuple[str, list[str]]]:
    """(script, the flags run.sh gives it) for each benchmark step."""
    text = RUN.read_text(encoding="utf-8")
    found = []
    for match in re.finditer(r"benchmarks/(\w+\.py)(.*?);;", text, re.S):
        flags = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", match.group(2))
        found.append((match.group(1), flags))
    return found


def test_run_sh_has_a_benchmark_step_for_each_issue() -> None:
    scripts = [script for script, _ in _commands()]
    assert scripts == [
        "bench_generation.py",
        "bench_cuda_memory_path.py",
        "bench_w1_process_replicas.py",
        "bench_workers.py",
        "bench_cuda.py",
    ]


@pytest.mark.parametrize(("script", "flags"), _commands(), ids=[s for s, _ in _commands()])
def test_each_benchmark_command_in_run_sh_names_flags_its_script_has(
    script: str, flags: list[str]
) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(BENCHMARKS.parent / "src")},
    )
    assert done.returncode == 0, done.stderr
    assert flags, script
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", done.stdout), (script, flag)


def _run(tmp_path: Path, python: str, *steps: str) -> tuple[int, str, str]:
    out = tmp_path / "out"
    env = {**os.environ, "CARPOOL_DEVICE_LOCAL": "1", "PYTHON": python, "OUT": str(out)}
    done = subprocess.run(
        ["bash", str(RUN), *steps], capture_output=True, text=True, timeout=60, env=env
    )
    summary = out / "summary.txt"
    return done.returncode, done.stdout, summary.read_text() if summary.exists() else ""


def test_steps_that_pass_exit_zero_with_each_in_the_summary(tmp_path: Path) -> None:
    status, _, summary = _run(tmp_path, "true", "tests", "mem")
    assert status == 0
    assert summary.splitlines() == ["tests exit 0", "mem exit 0"]


def test_a_failed_step_or_an_unknown_one_makes_it_exit_one(tmp_path: Path) -> None:
    status, _, summary = _run(tmp_path, "false", "tests", "mem")
    assert status == 1
    assert summary.splitlines() == ["tests exit 1", "mem exit 1"]
    status, stdout, _ = _run(tmp_path / "again", "true", "bogus")
    assert status == 1 and "unknown step bogus" in stdout
