"""Sample tensors for the KServe codec's tests: a deterministic array of each datatype,
and ``tritonclient.http`` inputs that carry them as JSON or binary data."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from carpool.server.kserve.tensors import DATATYPES

NUMERIC = ["UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"]
NUMERIC += ["FP16", "FP32", "FP64"]


def sample(datatype: str, shape: tuple[int, ...] = (2, 3)) -> npt.NDArray[Any]:
    """A deterministic array of ``datatype`` that uses the type's range."""
    size = int(np.prod(shape))
    if datatype == "BOOL":
        return (np.arange(size) % 3 == 0).reshape(shape)
    if datatype == "BYTES":
        words = [b"", "héllo".encode(), b"x" * 300, "日本".encode(), b"a", b"\x00z"]
        return np.array([words[i % len(words)] for i in range(size)], dtype=object).reshape(shape)
    dtype = DATATYPES[datatype]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = [info.min, info.max, 0, 1, info.max - 1, info.min + 1]
        return np.array([values[i % len(values)] for i in range(size)], dtype=dtype).reshape(shape)
    return (np.linspace(-3.25, 1e3, size) / 7).astype(dtype).reshape(shape)


def triton_input(
    name: str, array: npt.NDArray[Any], datatype: str, *, binary: bool
) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    if datatype == "BF16" and array.dtype == ml_dtypes.bfloat16:
        # tritonclient releases differ: some take ml_dtypes.bfloat16 arrays for BF16,
        # others float32 arrays that they truncate themselves. The bytes are the same.
        try:
            tensor.set_data_from_numpy(array, binary_data=binary)
        except InferenceServerException:
            tensor.set_data_from_numpy(array.astype(np.float32), binary_data=binary)
        return tensor
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor
