"""The outputs a request asks for: one parser for REST and gRPC, one resolver against the
model's declared outputs, and the tensors an answer carries."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from carpool.errors import InvalidInput
from carpool.server.kserve.grpc_codec import decode_infer_request as decode_grpc_request
from carpool.server.kserve.requested import answer_tensors, wanted_outputs
from carpool.server.kserve.rest import InferPlans, prepare_infer
from carpool.server.kserve.rest_decode import decode_infer_request as decode_rest_request
from carpool.server.kserve.tensors import OutputTensor, RequestedOutput
from carpool.server.proto import grpc_service_pb2 as pb
from carpool.server.repository import TensorSpec

from .test_rest import _json_document, _model


def _rest_outputs(outputs: list[dict[str, Any]]) -> tuple[RequestedOutput, ...] | None:
    """The outputs REST reads, asked for as binary data where they say nothing."""
    document = {"inputs": [], "outputs": outputs, "parameters": {"binary_data_output": True}}
    return decode_rest_request(orjson.dumps(document), None).outputs


def _grpc_outputs(outputs: list[dict[str, Any]]) -> tuple[RequestedOutput, ...] | None:
    request = pb.ModelInferRequest(model_name="m")
    for output in outputs:
        entry = request.outputs.add(name=output["name"])
        for key, value in output.get("parameters", {}).items():
            if isinstance(value, bool):
                entry.parameters[key].bool_param = value
            elif isinstance(value, int):
                entry.parameters[key].int64_param = value
            else:
                entry.parameters[key].string_param = value
    return decode_grpc_request(request).outputs


@pytest.mark.parametrize(
    "outputs",
    [
        [{"name": "y"}],
        [{"name": "y"}, {"name": "z", "parameters": {"classification": 3}}],
        [{"name": "z", "parameters": {"classification": 1, "tag": "kept aside"}}],
    ],
)
def test_both_wires_read_the_same_outputs(outputs: list[dict[str, Any]]) -> None:
    assert _rest_outputs(outputs) == _grpc_outputs(outputs)


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        ([{"name": "y"}, {"name": "y"}], "output 'y': name appears more than once in 'outputs'"),
        (
            [{"name": "y", "parameters": {"shared_memory_region": "r"}}],
            "output 'y': parameters.shared_memory_region is not supported",
        ),
        (
            [{"name": "y", "parameters": {"classification": -2}}],
            "output 'y': parameters.classification=-2 (tritonclient's class_count)",
        ),
    ],
)
def test_both_wires_refuse_the_same_outputs_with_the_same_message(
    outputs: list[dict[str, Any]], message: str
) -> None:
    for read in (_rest_outputs, _grpc_outputs):
        with pytest.raises(InvalidInput) as refused:
            read(outputs)
        assert str(refused.value).startswith(message), read.__name__


def test_each_wire_reads_classification_and_binary_data_as_its_triton_endpoint() -> None:
    """REST takes 0 as the tensor itself and reads binary_data; gRPC wants an
    int64_param >= 1 and always answers raw."""
    zero = [{"name": "y", "parameters": {"classification": 0, "binary_data": False}}]
    assert _rest_outputs(zero) == (RequestedOutput("y", False, 0),)
    with pytest.raises(InvalidInput, match="expected an integer >= 1"):
        _grpc_outputs(zero)
    as_text = [{"name": "y", "parameters": {"classification": "3"}}]
    with pytest.raises(InvalidInput, match="is string_param '3'; expected an int64_param"):
        _grpc_outputs(as_text)
    binary_off = [{"name": "y", "parameters": {"binary_data": False}}]
    assert _grpc_outputs(binary_off) == (RequestedOutput("y", True, 0),)


def test_wanted_outputs_are_the_declared_ones_in_the_order_asked() -> None:
    model = _model()
    assert [s.name for s in wanted_outputs(model, None)] == ["y", "z"]
    asked = (RequestedOutput("z", True), RequestedOutput("y", False))
    assert [s.name for s in wanted_outputs(model, asked)] == ["z", "y"]
    with pytest.raises(InvalidInput, match=r"unknown output 'w' for model 'm'; expected \['y'"):
        wanted_outputs(model, (RequestedOutput("y", True), RequestedOutput("w", True)))


def test_an_empty_outputs_list_means_the_same_over_rest_and_grpc() -> None:
    model = _model()
    rest = prepare_infer(
        model, orjson.dumps(_json_document([1, 2], outputs=[])), None, InferPlans()
    )
    request = pb.ModelInferRequest(model_name="m")  # a proto cannot tell [] from absent
    request.inputs.add(name="x", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend(
        [1, 2]
    )
    grpc_wanted = wanted_outputs(model, decode_grpc_request(request).outputs)
    assert [s.name for s in grpc_wanted] == ["y", "z"]
    assert [s.name for s in rest.plan.wanted] == ["y", "z"], (
        "REST 'outputs': [] returns no outputs at all while gRPC returns every output"
    )


def test_answer_tensors_carry_declared_datatypes_and_classes_as_bytes() -> None:
    wanted = [TensorSpec("y", "FP32", (-1,)), TensorSpec("z", "INT64", (3,))]
    result = {"y": np.ones((1, 2)), "z": np.array([[5, 9, 7]])}
    plain = answer_tensors(wanted, result, None)
    assert [(o.name, o.datatype) for o in plain] == [("y", "FP32"), ("z", "INT64")]
    assert plain[0].array is result["y"]
    y, z = answer_tensors(wanted, result, {"z": 2})
    assert y == OutputTensor("y", result["y"], "FP32")
    assert (z.datatype, z.array.tolist()) == ("BYTES", [[b"9:1", b"7:2"]])
