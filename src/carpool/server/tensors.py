"""The KServe tensors under their former name: they live in :mod:`carpool.server.kserve.tensors`
(REST's answers in :mod:`carpool.server.kserve.rest_encode`). Kept for the modules and tests
outside the codec that import these names from here; new code imports from
``carpool.server.kserve``.
"""

from __future__ import annotations

from carpool.server.kserve.rest_encode import encode_infer_response
from carpool.server.kserve.tensors import (
    DATATYPES,
    InferRequest,
    InputTensor,
    OutputTensor,
    RequestedOutput,
)

__all__ = [
    "DATATYPES",
    "InferRequest",
    "InputTensor",
    "OutputTensor",
    "RequestedOutput",
    "encode_infer_response",
]
