"""Python models that tests/integration/test_serve_config.py serves from a config file."""

from __future__ import annotations

from typing import Any

import numpy as np


def double(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """A batched callable: ``OUTPUT0 = 2 * INPUT0``."""
    return {"OUTPUT0": inputs["INPUT0"] * 2}
