"""A model the Ray integration tests serve (``executor: ray``): it runs in Ray actors,
whose processes are started by the test's cluster and see its environment."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

SLOW_MARK = 7.0  # a batch holding this value computes for SLOW_S
SLOW_S = 1.5
HANG_MARK = -1.0  # ... this value, for ever (far longer than a test waits)
HANG_S = 120.0
BATCH_S = 0.01  # every batch: so that concurrent requests keep both replicas busy


def double_with_pid(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """``OUTPUT0 = 2 * INPUT0``, and ``PID``, the process that computed it. A slow or hung
    batch first writes its process id to ``$CARPOOL_TEST_RAY_DIR/running-<pid>``."""
    x = inputs["INPUT0"]
    pid = os.getpid()
    if np.any(x == SLOW_MARK) or np.any(x == HANG_MARK):
        (Path(os.environ["CARPOOL_TEST_RAY_DIR"]) / f"running-{pid}").write_text(str(pid))
    if np.any(x == HANG_MARK):
        time.sleep(HANG_S)
    time.sleep(SLOW_S if np.any(x == SLOW_MARK) else BATCH_S)
    return {"OUTPUT0": x * 2, "PID": np.full((len(x), 1), pid, dtype=np.int64)}
