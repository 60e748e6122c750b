"""Edges of the KServe v2 request path (plans, decoding, responses) found in review.

Each test failed before its fix; the docstring says what happened ("Was:") and why.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
import rapidjson  # what tritonclient.http parses answers with

from carpool import ClassPolicy
from carpool.errors import InvalidInput
from carpool.server.decode import decode_infer_request, json_shape_key
from carpool.server.grpc import decode_infer_request as decode_grpc_request
from carpool.server.grpc import wanted_outputs as grpc_wanted_outputs
from carpool.server.infer import InferPlans, error_response, infer_response, prepare_infer
from carpool.server.proto import grpc_service_pb2 as pb

from .test_infer import _model


def _json_document(data: list[Any], **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": data}], **extra}


# --- 1. A binary request can hit a JSON request's plan ---------------------------------


def test_a_binary_header_equal_to_a_json_plan_key_is_not_served_from_that_plan() -> None:
    """Was: JSON and binary plans shared one dict and the binary path looks a header up
    before parsing it, so a binary request whose header equalled a JSON plan's key got
    that plan, whose header still held the first JSON request's ``data``: it was answered
    with another client's inputs. JSON plans are now kept apart (and without data)."""
    model, plans = _model(), InferPlans()
    secret = _json_document([7.0, 8.0])
    prepare_infer(model, orjson.dumps(secret), None, plans)  # someone else's request
    key = json_shape_key(secret)
    assert key is not None
    with pytest.raises(InvalidInput, match="input 'x'"):  # it has no data of its own
        call = prepare_infer(model, key, str(len(key)).encode(), plans)
        pytest.fail(f"served from the JSON plan; payload is {call.payload}")


# --- 2. A JSON plan keeps its first request's data alive ---------------------------------


def test_a_json_plan_does_not_keep_the_first_requests_data() -> None:
    """Was: the JSON plan's header was ``header_of(document)`` of the first request, whose input
    specs hold that request's whole ``data`` list. Up to PLANS_PER_MODEL (64) plans per
    model each pin a full request body as Python objects (every distinct ``id`` makes a
    new plan), and it is what test 1 leaks."""
    model, plans = _model(), InferPlans()
    call = prepare_infer(model, orjson.dumps(_json_document([7.0, 8.0])), None, plans)
    assert all(not spec.data for spec in call.plan.header.specs), (
        f"plan retains request data: {[spec.data for spec in call.plan.header.specs]}"
    )


# --- 3. "outputs": [] means no outputs over REST, all outputs over gRPC ------------------


def test_an_empty_outputs_list_means_the_same_over_rest_and_grpc() -> None:
    model = _model()
    rest = prepare_infer(
        model, orjson.dumps(_json_document([1, 2], outputs=[])), None, InferPlans()
    )
    request = pb.ModelInferRequest(model_name="m")  # a proto cannot tell [] from absent
    request.inputs.add(name="x", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend(
        [1, 2]
    )
    grpc_wanted = grpc_wanted_outputs(model, decode_grpc_request(request))
    assert [s.name for s in grpc_wanted] == ["y", "z"]
    assert [s.name for s in rest.plan.wanted] == ["y", "z"], (
        "REST 'outputs': [] returns no outputs at all while gRPC returns every output"
    )


# --- 4. A deeply nested (but valid) JSON body is a 500 -----------------------------------


def test_a_deeply_nested_json_body_is_a_400_not_a_500() -> None:
    """Was: orjson.loads accepts 1024 levels, orjson.dumps only 255: json_shape_key's dumps
    raises orjson.JSONEncodeError (a TypeError) which error_response maps to 500."""
    depth = 300
    nested = b'{"a":' * depth + b"1" + b"}" * depth
    body = (
        b'{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1,2]}],'
        b'"parameters":{"extra":' + nested + b"}}"
    )
    try:
        prepare_infer(_model(), body, None, InferPlans())
    except Exception as exc:
        status = error_response(exc)[0]
        assert status == 400, f"{type(exc).__name__}: {exc} answered with {status}"


# --- 5. NaN and infinities, which Triton and tritonclient.http carry in JSON -------------


def test_json_float_outputs_keep_infinities_as_tritonclient_reads_them() -> None:
    """Was: orjson wrote NaN/inf as null; tritonclient.http's as_numpy then gives NaN for
    +inf and -inf. Triton (server PR #3870) writes NaN/Infinity and tritonclient parses
    them with python-rapidjson."""
    model, plans = _model(), InferPlans()
    call = prepare_infer(model, orjson.dumps(_json_document([1, 2])), None, plans)
    y = np.array([[np.inf, -np.inf]], dtype=np.float32)
    _, body, _ = infer_response(model, call, {"y": y, "z": np.ones((1, 1), np.int64)})
    document = rapidjson.loads(body)
    as_numpy = np.array(document["outputs"][0]["data"], dtype=np.float32)  # as tritonclient
    np.testing.assert_array_equal(as_numpy, [np.inf, -np.inf])


def test_json_float_inputs_may_carry_nan_and_infinity_as_tritonclient_sends_them() -> None:
    """Was: tritonclient.http (binary_data=False) serializes with python-rapidjson, which
    writes NaN/Infinity; orjson refuses them, so the request is a 400 'not valid JSON'."""
    body = rapidjson.dumps(_json_document([float("nan"), float("inf")])).encode()
    assert b"NaN" in body and b"Infinity" in body
    request = decode_infer_request(body, None)
    array = request.inputs[0].array
    assert np.isnan(array[0, 0]) and array[0, 1] == np.inf


# --- 6. Flat and nested JSON data decode the same number differently ---------------------


def test_flat_and_nested_json_data_give_the_same_fp32_values() -> None:
    """Was: the struct fast path (flat lists) rounded int -> float64 -> float32 while the general
    path (nested lists) casts int64 -> float32 directly; for integers above 2**53 the two
    differ by one float32 ulp."""
    n = 2**53 + 2**29 + 1

    def decode(data: list[Any]) -> np.ndarray:
        document = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": data}]}
        return decode_infer_request(orjson.dumps(document), None).inputs[0].array

    flat, nested = decode([n]), decode([[n]])
    assert flat.tolist() == nested.tolist(), f"flat {flat.tolist()} vs nested {nested.tolist()}"


# --- 7. A cached plan keeps a priority class the policy no longer has --------------------


def test_a_cached_plan_follows_a_policy_change_of_priority_classes() -> None:
    """Was: submit_options mapped the integer ``priority`` to a class name once per plan; after
    Batcher.update_policy/set_policy replaces the classes, requests with the same header
    still carry the old name (the batcher then refuses it as an unknown priority)."""
    model, plans = _model(), InferPlans()
    body = orjson.dumps(_json_document([1, 2], parameters={"priority": 1}))
    assert prepare_infer(model, body, None, plans).options == {"priority": "interactive"}
    model.batcher.update_policy(
        classes=(ClassPolicy("gold"), ClassPolicy("silver")), default_class="gold"
    )
    assert prepare_infer(model, body, None, InferPlans()).options == {"priority": "gold"}
    assert prepare_infer(model, body, None, plans).options == {"priority": "gold"}
