"""The KServe tensors under their former name: they live in :mod:`carpool.server.kserve.tensors`
(REST's answers in :mod:`carpool.server.kserve.rest_encode`). Kept for the modules and tests
outside the codec that import them from here; new code imports from ``carpool.server.kserve``.
"""

from __future__ import annotations

from carpool.server.kserve.rest_encode import encode_infer_response
from carpool.server.kserve.tensors import (
    DATATYPE_NAMES,
    DATATYPES,
    UNSUPPORTED_OUTPUT_PARAMETERS,
    WIRE_DTYPES,
    InferRequest,
    InputTensor,
    OutputTensor,
    RequestedOutput,
    check_empty_shape,
    datatype_of,
    deserialize_bytes_tensor,
    serialize_bytes_tensor,
    tensor_bytes,
    unsupported_output_parameter,
)

__all__ = [
    "DATATYPES",
    "DATATYPE_NAMES",
    "UNSUPPORTED_OUTPUT_PARAMETERS",
    "WIRE_DTYPES",
    "InferRequest",
    "InputTensor",
    "OutputTensor",
    "RequestedOutput",
    "check_empty_shape",
    "datatype_of",
    "deserialize_bytes_tensor",
    "encode_infer_response",
    "serialize_bytes_tensor",
    "tensor_bytes",
    "unsupported_output_parameter",
]
