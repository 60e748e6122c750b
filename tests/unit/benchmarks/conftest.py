"""The benchmark helpers import each other by plain name, as the scripts run them
(``python benchmarks/soak.py``): their folder goes on the import path for these tests."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
