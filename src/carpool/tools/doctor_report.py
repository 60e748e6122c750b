"""The doctor's output (part 4): a plain-text report and a JSON document with every number.

The text is fixed-width and has no colour or terminal codes, so it reads the same on a TTY,
in a pipe and in a file. The JSON holds the options, the machine, every measurement and the
verdicts; floats that are not finite (an ``inf`` deviation) become ``null``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from carpool.tools.doctor_types import DoctorReport
from carpool.tools.machine import cpu_flags, cpu_model, torch_kernels

_MIB = 1024 * 1024


def machine_info() -> dict[str, Any]:
    """Platform, CPU model, flags and cores, Python, NumPy and torch versions, thread
    settings, and the kernels torch and carpool chose on this CPU."""
    import numpy as np

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "num_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpu_affinity"] = sorted(os.sched_getaffinity(0))
    try:
        info["torch"] = metadata.version("torch")
    except metadata.PackageNotFoundError:
        info["torch"] = None
    torch = sys.modules.get("torch")  # only when the model already imported it
    if torch is not None:
        info["torch_num_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["cuda_device"] = torch.cuda.get_device_name()
        info["kernels"] = torch_kernels()
    return info


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def report_dict(report: DoctorReport) -> dict[str, Any]:
    """``report`` as JSON-ready data: the fields plus a ``verdicts`` summary."""
    data: dict[str, Any] = dataclasses.asdict(report)
    inv = report.invariance
    data["invariance"]["deviations"] = [
        {**dataclasses.asdict(d), "is_flagged": d.is_flagged} for d in inv.deviations
    ]
    memory = report.memory
    data["verdicts"] = {
        "knee_batch_size": report.knee.knee_batch_size,
        "knee": report.knee.reason,
        "max_batch_under_budget": memory.max_batch_size if memory else None,
        "memory": memory.reason if memory else "no --memory-budget-mb given",
        "invariance_passed": inv.is_passed,
        "invariance_reasons": inv.reasons,
        "bucket_edges": report.lengths.bucket_edges if report.lengths else None,
        "jitter_risk": report.lengths.jitter_risk if report.lengths else None,
    }
    result: dict[str, Any] = _jsonable(data)
    return result


def write_json(report: DoctorReport, path: str | Path) -> None:
    """Write :func:`report_dict` of ``report`` to ``path`` (folders created)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report_dict(report), indent=2) + "\n", encoding="utf-8")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / _MIB:.1f}"


def _sweep_lines(report: DoctorReport) -> list[str]:
    rows = [
        [
            str(t.batch_size),
            f"{t.median_s * 1e3:.3f}",
            f"{t.p90_s * 1e3:.3f}",
            f"{t.items_per_s:,.0f}",
            _mib(t.memory_bytes),
            "<- knee" if t.batch_size == report.knee.knee_batch_size else "",
        ]
        if t.error is None
        else [str(t.batch_size), "-", "-", "-", "-", f"raised {t.error}"]
        for t in report.sweep
    ]
    mem = "peak CUDA MiB" if report.memory_kind == "cuda" else "peak RSS +MiB"
    header = ["batch", "median ms", "p90 ms", "items/s", mem, ""]
    return ["1. Throughput, latency, memory", *_table(header, rows)]


def _verdict_lines(report: DoctorReport) -> list[str]:
    lines = [f"knee: {report.knee.knee_batch_size or 'none'} ({report.knee.reason})"]
    if report.memory is not None:
        m = report.memory
        lines.append(
            f"max batch under {(m.budget_bytes or 0) / _MIB:.0f} MiB: "
            f"{m.max_batch_size or 'n/a'} ({m.method}; {m.reason})"
        )
    return lines


def _invariance_lines(report: DoctorReport) -> list[str]:
    inv = report.invariance
    verdict = "PASS" if inv.is_passed else "FAIL"
    rows = [
        [
            d.output,
            d.kind,
            f"{d.max_abs:.2e}",
            f"{d.max_rel:.2e}",
            f"{d.rtol:.0e}",
            "FLAG" if d.is_flagged else "ok",
        ]
        for d in inv.deviations
    ]
    header = ["output", "neighbours", "max abs", "max rel", "rtol", ""]
    lines = [f"2. Batch invariance: {verdict} ({inv.num_calls} calls)", *_table(header, rows)]
    lines += [f"  ! {reason}" for reason in inv.reasons]
    return lines


def _length_lines(report: DoctorReport) -> list[str]:
    lengths = report.lengths
    if lengths is None:
        return ["3. Input variance: fixed shape (give --shape -1,... --lengths ... to measure)"]
    rows = [[str(t.length), f"{t.median_s * 1e3:.3f}", f"{t.cv:.0%}"] for t in lengths.timings]
    header = ["length", "median ms", "CV"]
    return [
        f"3. Input variance (batch {lengths.batch_size})",
        *_table(header, rows),
        lengths.reason,
        f"suggested bucket edges: {', '.join(map(str, lengths.bucket_edges))}",
    ]


def _kernel_lines(kernels: dict[str, Any], model_linear: str | None) -> list[str]:
    if not kernels:
        return []
    linear = ", ".join(f"{dtype} {name}" for dtype, name in kernels["linear"].items())
    this_model = f"; this model's Linear layers: {model_linear}" if model_linear else ""
    return [
        f"kernels: ATen {kernels['aten_cpu_capability']}, BLAS {kernels['blas']}, "
        f"carpool Linear: {linear}{this_model}"
    ]


def render_text(report: DoctorReport) -> str:
    """The human-readable report: header, the four parts, the verdicts."""
    o = report.options
    m = report.machine
    shape = ",".join(map(str, o.shape))
    head = [
        f"carpool doctor: {report.source or '<object>'}  item shape ({shape}) {o.dtype}, "
        f"device {o.device}, max batch {o.max_batch}",
        f"machine: {m.get('cpu_model')}, {m.get('num_cpus')} CPUs "
        f"(affinity {m.get('cpu_affinity', '?')}), Python {m.get('python')}, "
        f"torch {m.get('torch')} ({m.get('torch_num_threads', '-')} threads)",
        f"cpu flags: {' '.join(m.get('cpu_flags', [])) or '-'}",
        *_kernel_lines(m.get("kernels") or {}, m.get("model_linear")),
        f"{o.warmup} warm-up + {o.repeats} timed calls per batch size, seed {o.seed}",
        "",
    ]
    parts = [
        *_sweep_lines(report),
        *_verdict_lines(report),
        "",
        *_invariance_lines(report),
        "",
        *_length_lines(report),
    ]
    return "\n".join(head + parts)
