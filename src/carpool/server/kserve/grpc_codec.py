"""KServe v2 over gRPC: a ``ModelInferRequest`` into the typed request REST decodes to, and
a model's outputs into a ``ModelInferResponse``.

Input data comes either raw or typed::

    raw_input_contents = [ bytes of input 0 ][ bytes of input 1 ] ...   one entry per input
    inputs[i].contents = InferTensorContents{ <type>_contents: [v0, v1, ...] }

Raw bytes are read as REST's binary data is
(:func:`~carpool.server.kserve.tensors.array_from_raw`). Outputs always go back raw, in
``raw_output_contents``, as Triton answers ``tritonclient``, written as REST writes its
binary outputs (:func:`~carpool.server.kserve.tensors.tensor_bytes`), so both wires send
identical bytes. The outputs asked for are read by the same parser as REST's
(:func:`~carpool.server.kserve.requested.requested_outputs`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from carpool.errors import InvalidInput
from carpool.server.classification import class_count_of
from carpool.server.kserve.requested import answer_tensors, requested_outputs
from carpool.server.kserve.tensors import (
    DATATYPES,
    WIRE_DTYPES,
    InferRequest,
    InputTensor,
    RequestedOutput,
    array_from_raw,
    check_empty_shape,
    check_num_dims,
    tensor_bytes,
)
from carpool.server.proto import grpc_service_pb2 as pb

if TYPE_CHECKING:
    from carpool.server.repository import ServedModel, TensorSpec

__all__ = ["decode_infer_request", "encode_infer_response"]

_KNOWN = ", ".join(DATATYPES)
# The InferTensorContents field of each datatype; FP16 and BF16 have none (raw only).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def decode_infer_request(request: pb.ModelInferRequest) -> InferRequest:
    """Decode a gRPC inference request into the server's wire-neutral form.

    Raises:
        InvalidInput: the request is malformed; the message names the input and field.
    """
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"raw_input_contents has {len(raw)} entries but the request has "
            f"{len(request.inputs)} inputs; send one per input, in input order, or none"
        )
    tensors: list[InputTensor] = []
    seen: set[str] = set()
    for index, tensor in enumerate(request.inputs):
        if tensor.name in seen:
            raise InvalidInput(f"input {tensor.name!r}: name appears more than once in 'inputs'")
        seen.add(tensor.name)
        tensors.append(_decode_input(tensor, raw[index] if raw else None))
    return InferRequest(
        request_id=request.id or None,
        inputs=tuple(tensors),
        outputs=_requested_outputs(request) if request.outputs else None,
        parameters=_parameters(request.parameters),
        is_binary_output_default=True,
    )


def _decode_input(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> InputTensor:
    where = f"input {tensor.name!r}"
    if tensor.datatype not in DATATYPES:
        raise InvalidInput(f"{where}: datatype {tensor.datatype!r} is not one of {_KNOWN}")
    if "shared_memory_region" in tensor.parameters:
        raise InvalidInput(f"{where}: shared memory is not supported; send the data inline")
    shape = tuple(tensor.shape)
    if any(dim < 0 for dim in shape):
        raise InvalidInput(f"{where}: shape must be integers >= 0, got {list(shape)}")
    check_num_dims(where, shape)
    num_elements = math.prod(shape)
    if not num_elements:
        check_empty_shape(where, tensor.datatype, shape)
    if raw is None:
        flat = _from_contents(where, tensor.datatype, num_elements, tensor.contents)
    else:
        if tensor.HasField("contents"):
            raise InvalidInput(f"{where}: has both typed contents and raw_input_contents")
        if tensor.datatype != "BYTES":
            expected = num_elements * WIRE_DTYPES[tensor.datatype].itemsize
            if len(raw) != expected:
                raise InvalidInput(
                    f"{where}: raw_input_contents has {len(raw)} bytes but {num_elements} "
                    f"elements of {tensor.datatype} need {expected}"
                )
        flat = array_from_raw(raw, tensor.datatype, num_elements, name=tensor.name, source="raw")
    return InputTensor(tensor.name, tensor.datatype, shape, flat.reshape(shape))


def _from_contents(
    where: str, datatype: str, num_elements: int, contents: pb.InferTensorContents
) -> npt.NDArray[Any]:
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidInput(f"{where}: {datatype} data must be sent as raw_input_contents")
    others = [f.name for f, _ in contents.ListFields() if f.name != field]
    if others:
        raise InvalidInput(f"{where}: {datatype} data belongs in {field}, not {others[0]}")
    values = getattr(contents, field)
    if len(values) != num_elements:
        raise InvalidInput(
            f"{where}: shape has {num_elements} elements but {field} has {len(values)}"
        )
    if datatype == "BYTES":
        array = np.empty(num_elements, dtype=object)
        array[:] = list(values)
        return array
    dtype = DATATYPES[datatype]
    if dtype.kind in "iu" and dtype.itemsize < 4 and num_elements:
        wide = np.array(values, dtype=np.int64)
        limits = np.iinfo(dtype)
        if wide.min() < limits.min or wide.max() > limits.max:
            raise InvalidInput(
                f"{where}: {datatype} data must be integers in [{limits.min}, {limits.max}]"
            )
        return wide.astype(dtype)
    return np.array(values, dtype=dtype)


def _parameter(value: pb.InferParameter) -> Any:
    choice = value.WhichOneof("parameter_choice")
    return None if choice is None else getattr(value, choice)


def _parameters(parameters: Any) -> dict[str, Any]:
    return {key: _parameter(value) for key, value in parameters.items()}


def _requested_outputs(request: pb.ModelInferRequest) -> tuple[RequestedOutput, ...]:
    return requested_outputs(
        ((output.name, output) for output in request.outputs),
        is_binary_default=True,
        parameters_of=_output_parameters,
        class_count_of=_class_count,
    )


def _output_parameters(
    where: str, output: pb.ModelInferRequest.InferRequestedOutputTensor
) -> dict[str, Any]:
    """An output's parameters as Python values, but ``classification``, which keeps its
    ``InferParameter`` (Triton reads only an ``int64_param``), and ``binary_data``, which
    is HTTP's: outputs always go back raw."""
    parameters = {}
    for key, value in output.parameters.items():
        if key == "classification":
            parameters[key] = value
        elif key != "binary_data":
            parameters[key] = _parameter(value)
    return parameters


def _class_count(where: str, value: pb.InferParameter) -> int:
    """A ``classification`` parameter: an int64_param >= 1, as Triton reads it."""
    choice = value.WhichOneof("parameter_choice")
    if choice != "int64_param":
        given = "no value" if choice is None else f"{choice} {_parameter(value)!r}"
        raise InvalidInput(
            f"{where}: parameters.classification is {given}; expected an int64_param >= 1 "
            "(tritonclient's class_count), the number of top classes to return"
        )
    return class_count_of(where, value.int64_param)


def encode_infer_response(
    model: ServedModel,
    request_id: str | None,
    wanted: list[TensorSpec],
    result: dict[str, Any],
    classes: dict[str, int] | None = None,
) -> pb.ModelInferResponse:
    """The response carrying ``wanted`` outputs of ``result`` as raw contents; those named
    in ``classes`` as their top classes (BYTES, see :mod:`carpool.server.classification`)."""
    response = pb.ModelInferResponse(
        model_name=model.name, model_version=model.version, id=request_id or ""
    )
    for output in answer_tensors(wanted, result, classes):
        array = np.asarray(output.array)
        datatype = output.datatype
        assert datatype is not None  # answer_tensors gives each its declared datatype
        response.outputs.add(name=output.name, datatype=datatype, shape=array.shape)
        response.raw_output_contents.append(tensor_bytes(datatype, array))
    return response
