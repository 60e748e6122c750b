"""Every benchmark script imports: a helper moved or renamed breaks them, and nothing else
runs them (they need wrk, a peers' environment or a GPU, and minutes). They are imported in
a child process, as `python benchmarks/bench_x.py` would: some set environment variables
(HF_HUB_OFFLINE) when imported, which must not leak into the other tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py"))

IMPORT_ALL = """
import importlib, json, sys, traceback
failed = {}
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
        if name.startswith("bench_") and not callable(getattr(module, "main", None)):
            failed[name] = "no main()"
    except BaseException:
        failed[name] = traceback.format_exc(limit=3)
print(json.dumps(failed))
"""


def test_every_script_imports() -> None:
    assert len(SCRIPTS) > 10
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, *SCRIPTS],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert failed == {}, "\n".join(f"{name}:\n{why}" for name, why in failed.items())
