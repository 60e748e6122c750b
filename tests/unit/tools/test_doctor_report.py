"""The doctor's text report and JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from carpool.tools.doctor import load_target, run_doctor
from carpool.tools.doctor_report import machine_info, render_text, report_dict, write_json
from carpool.tools.doctor_types import DoctorOptions, DoctorReport


class TickClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 0.001
        return self.now_s


class NoMemory:
    def start(self) -> None:
        pass

    def stop(self) -> int:
        return 0


def needs_two(batch: Any) -> Any:
    if len(batch) < 2:
        raise ValueError("needs two items")
    return batch - batch.mean(axis=0, keepdims=True)


def _report(fn: Any, **overrides: Any) -> DoctorReport:
    fields: dict[str, Any] = {"shape": (4,), "max_batch": 4, "repeats": 2, "warmup": 0}
    options = DoctorOptions(**(fields | overrides))
    return run_doctor(load_target(fn), options, source="m:fn", clock=TickClock(), memory=NoMemory())


def test_text_report_has_the_four_parts_and_the_reasons() -> None:
    text = render_text(_report(needs_two))
    for heading in ("1. Throughput", "knee:", "2. Batch invariance: FAIL", "3. Input variance"):
        assert heading in text
    assert "raised ValueError: needs two items" in text
    assert "a batch of 1 fails" in text
    assert "\x1b[" not in text  # no terminal codes: the same in a pipe or a file


def test_text_report_shows_lengths_and_buckets() -> None:
    report = _report(lambda b: b.sum(axis=1), shape=(-1, 2), lengths=(2, 4))
    text = render_text(report)
    assert "3. Input variance (batch 4)" in text
    assert "suggested bucket edges:" in text


def test_json_has_verdicts_and_turns_nan_into_null(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "doctor.json"
    write_json(_report(needs_two, memory_budget_bytes=1 << 20), path)
    data = json.loads(path.read_text())
    assert data["sweep"][0]["median_s"] is None
    assert data["sweep"][0]["error"] == "ValueError: needs two items"
    assert data["verdicts"]["invariance_passed"] is False
    assert data["verdicts"]["max_batch_under_budget"] is None
    assert data["options"]["shape"] == [4]
    assert all("is_flagged" in d for d in data["invariance"]["deviations"])


def test_report_dict_is_plain_json() -> None:
    data = report_dict(_report(lambda b: np.tanh(b)))
    assert json.loads(json.dumps(data, allow_nan=False)) == data


def test_machine_info_names_the_platform_and_cpu() -> None:
    info = machine_info()
    assert {"platform", "cpu_model", "num_cpus", "python", "numpy", "torch"} <= info.keys()
