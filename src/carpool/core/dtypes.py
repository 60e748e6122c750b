"""NumPy dtype facts shared by the model runners and the server's output check."""

from __future__ import annotations

from typing import Any

import numpy as np


def integers_fit(array: np.ndarray, dtype: np.dtype[Any]) -> bool:
    """Whether every value of the integer (or boolean) ``array`` is one ``dtype``, an
    integer dtype, holds: casting would otherwise wrap it (3e9 as INT32 is -1294967296,
    -1 as UINT8 is 255)."""
    if np.can_cast(array.dtype, dtype) or array.size == 0:
        return True
    info = np.iinfo(dtype)
    return int(array.min()) >= info.min and int(array.max()) <= info.max
