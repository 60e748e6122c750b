"""prepare_infer and infer_response: the per-header plan and the cached answer headers.

The tests after "Edges" each failed before their fix; the docstring says what happened
("Was:") and why.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import orjson
import pytest
import rapidjson  # what tritonclient.http parses answers with
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool import Batcher, BatchPolicy, ClassPolicy
from carpool.errors import InvalidInput
from carpool.server.infer import error_response
from carpool.server.kserve import rest
from carpool.server.kserve.rest import InferPlans, infer_response, prepare_infer
from carpool.server.kserve.rest_decode import decode_infer_request, json_shape_key
from carpool.server.kserve.tensors import DATATYPES, WIRE_DTYPES
from carpool.server.repository import ServedModel, TensorSpec


def _model() -> ServedModel:
    return ServedModel(
        "m",
        "1",
        "python",
        (TensorSpec("x", "FP32", (2,)),),
        (TensorSpec("y", "FP32", (-1,)), TensorSpec("z", "INT64", (1,))),
        Batcher(lambda inputs: inputs),
    )


def _body(rows: np.ndarray, *, binary_outputs: bool = True, request_id: str | None = None):
    data = rows.astype(np.float32).tobytes()
    document: dict[str, Any] = {
        "inputs": [
            {
                "name": "x",
                "shape": list(rows.shape),
                "datatype": "FP32",
                "parameters": {"binary_data_size": len(data)},
            }
        ],
        "parameters": {"binary_data_output": binary_outputs, "priority": 1},
    }
    if request_id is not None:
        document["id"] = request_id
    header = orjson.dumps(document)
    return header + data, str(len(header)).encode()


def _decode(answer: tuple[int, bytes, Any]) -> dict[str, Any]:
    status, body, headers = answer
    assert status == 200
    found = dict(headers)
    if b"inference-header-content-length" not in found:
        document = orjson.loads(body)
        return {o["name"]: np.reshape(o["data"], o["shape"]) for o in document["outputs"]}
    length = int(found[b"inference-header-content-length"])
    document, offset, outputs = orjson.loads(body[:length]), length, {}
    for output in document["outputs"]:
        size = output["parameters"]["binary_data_size"]
        dtype = {"FP32": np.float32, "INT64": np.int64}[output["datatype"]]
        chunk = body[offset : offset + size]
        outputs[output["name"]] = np.frombuffer(chunk, dtype).reshape(output["shape"])
        offset += size
    assert offset == len(body)
    return outputs


def test_a_repeated_header_reuses_its_plan_and_decodes_each_body() -> None:
    model, plans = _model(), InferPlans()
    first = prepare_infer(model, *_body(np.array([[1.0, 2.0]])), plans)
    second = prepare_infer(model, *_body(np.array([[3.0, 4.0]])), plans)
    assert second.plan is first.plan
    assert first.options == {"priority": model.batcher.policy.classes[0].name}
    np.testing.assert_array_equal(first.payload["x"], [[1, 2]])
    np.testing.assert_array_equal(second.payload["x"], [[3, 4]])


def test_answers_are_right_for_each_output_shape_with_cached_headers() -> None:
    model, plans = _model(), InferPlans()
    for width in (3, 5, 3, 5, 1):
        call = prepare_infer(model, *_body(np.zeros((1, 2))), plans)
        y = np.arange(width, dtype=np.float32)[None] + width
        z = np.array([[width]])
        outputs = _decode(infer_response(model, call, {"y": y, "z": z}))
        np.testing.assert_array_equal(outputs["y"], y)
        np.testing.assert_array_equal(outputs["z"], z)
    assert call.plan.answers is not None and len(call.plan.answers) == 3


def test_json_outputs_are_encoded_in_full() -> None:
    model, plans = _model(), InferPlans()
    call = prepare_infer(model, *_body(np.zeros((1, 2)), binary_outputs=False), plans)
    assert call.plan.answers is None
    outputs = _decode(infer_response(model, call, {"y": np.ones((1, 2)), "z": np.ones((1, 1))}))
    np.testing.assert_array_equal(outputs["y"], [[1, 1]])


def test_request_ids_get_their_own_plans_and_answers() -> None:
    model, plans = _model(), InferPlans()
    for request_id in ("a", "b", "a"):
        call = prepare_infer(model, *_body(np.zeros((1, 2)), request_id=request_id), plans)
        _, body, headers = infer_response(model, call, {"y": np.ones((1, 2)), "z": np.ones((1, 1))})
        length = int(dict(headers)[b"inference-header-content-length"])
        assert orjson.loads(body[:length])["id"] == request_id


def test_a_bad_header_length_is_refused_and_nothing_is_cached() -> None:
    model, plans = _model(), InferPlans()
    body, _ = _body(np.zeros((1, 2)))
    with pytest.raises(InvalidInput, match="Inference-Header-Content-Length"):
        prepare_infer(model, body, b"twelve", plans)
    with pytest.raises(InvalidInput, match="shape \\[1, 3\\], expected \\[-1, 2\\]"):
        prepare_infer(model, *_body(np.zeros((1, 3))), plans)
    assert plans.get(model, body) is None


def test_plans_are_bounded_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rest, "PLANS_PER_MODEL", 3)
    model, plans = _model(), InferPlans()
    for request_id in "abcde":
        prepare_infer(model, *_body(np.zeros((1, 2)), request_id=request_id), plans)
    assert len(plans._by_model[("m", False)]) == 3


def _json_body(values: list[Any], shape: list[int], request_id: str | None = None) -> bytes:
    document: dict[str, Any] = {
        "inputs": [{"name": "x", "shape": shape, "datatype": "FP32", "data": values}]
    }
    if request_id is not None:
        document["id"] = request_id
    return orjson.dumps(document)


def test_json_requests_differing_only_in_data_share_a_plan() -> None:
    model, plans = _model(), InferPlans()
    first = prepare_infer(model, _json_body([1, 2], [1, 2]), None, plans)
    second = prepare_infer(model, _json_body([3.5, 4], [1, 2]), None, plans)
    other_shape = prepare_infer(model, _json_body([1, 2, 3, 4], [2, 2]), None, plans)
    assert second.plan is first.plan
    assert other_shape.plan is not first.plan
    np.testing.assert_array_equal(second.payload["x"], [[3.5, 4]])
    np.testing.assert_array_equal(other_shape.payload["x"], [[1, 2], [3, 4]])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1, 2, 3], "shape \\[1, 2\\] has 2 elements but data has 3"),
        (["1.5", 2], "FP32 data must be numbers"),
        ([[1], [2, 3]], "ragged"),
    ],
)
def test_a_planned_json_shape_still_checks_each_requests_data(
    values: list[Any], message: str
) -> None:
    model, plans = _model(), InferPlans()
    prepare_infer(model, _json_body([1, 2], [1, 2]), None, plans)
    with pytest.raises(InvalidInput, match=message):
        prepare_infer(model, _json_body(values, [1, 2]), None, plans)


def test_json_request_ids_are_part_of_the_plan() -> None:
    model, plans = _model(), InferPlans()
    for request_id in ("a", "b"):
        call = prepare_infer(model, _json_body([1, 2], [1, 2], request_id), None, plans)
        assert call.request_id == request_id


_NUMERIC = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"]
_NUMERIC += ["FP16", "FP32", "FP64"]


@st.composite
def _binary_requests(draw: st.DrawFn) -> tuple[ServedModel, list[tuple[str, str, np.ndarray]]]:
    """A model of 1-3 numeric inputs and two requests' arrays for them (same shapes)."""
    count = draw(st.integers(1, 3))
    rows = draw(st.integers(1, 4))
    inputs = []
    specs = []
    for index in range(count):
        datatype = draw(st.sampled_from(_NUMERIC))
        dims = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=2)))
        dtype = np.dtype(DATATYPES[datatype])
        size = rows * int(np.prod(dims, dtype=np.int64))
        raw = draw(st.binary(min_size=size, max_size=size))
        values = np.frombuffer(raw, np.uint8).astype(dtype).reshape((rows, *dims))
        inputs.append((f"in{index}", datatype, values))
        specs.append(TensorSpec(f"in{index}", datatype, tuple(-1 if d == 2 else d for d in dims)))
    model = ServedModel(
        "m", "1", "python", tuple(specs), (TensorSpec("y", "FP32", (-1,)),), Batcher(lambda x: x)
    )
    return model, inputs


def _binary_body(inputs: list[tuple[str, str, np.ndarray]], shift: int) -> tuple[bytes, bytes]:
    chunks, entries = [], []
    for name, datatype, values in inputs:
        data = (
            (values + shift if datatype != "BOOL" else values)
            .astype(WIRE_DTYPES[datatype])
            .tobytes()
        )
        chunks.append(data)
        entries.append(
            {
                "name": name,
                "shape": list(values.shape),
                "datatype": datatype,
                "parameters": {"binary_data_size": len(data)},
            }
        )
    header = orjson.dumps({"inputs": entries, "id": "r"})
    return header + b"".join(chunks), str(len(header)).encode()


@settings(max_examples=150, deadline=None)
@given(request=_binary_requests(), shift=st.integers(0, 3))
def test_a_planned_binary_request_reads_what_a_full_decode_reads(
    request: tuple[ServedModel, list[tuple[str, str, np.ndarray]]], shift: int
) -> None:
    """Planned binary requests read their payload straight from the body's bytes (no
    request objects); every numeric datatype and shape gives the arrays, dtypes and
    request id that decoding the whole request gives, and a body of the wrong size the
    same 400."""
    model, inputs = request
    plans = InferPlans()
    prepare_infer(model, *_binary_body(inputs, 0), plans)  # makes the plan
    body, length = _binary_body(inputs, shift)
    call = prepare_infer(model, body, length, plans)
    assert call.plan.layout is not None
    full = decode_infer_request(body, int(length))
    assert call.request_id == full.request_id == "r"
    assert list(call.payload) == [t.name for t in full.inputs]
    for tensor in full.inputs:
        got = call.payload[tensor.name]
        assert got.dtype == tensor.array.dtype and got.shape == tensor.array.shape
        np.testing.assert_array_equal(got, tensor.array)
        assert got.flags.writeable  # a copy: a view of the (immutable) body is read-only
    for bad in (body[:-1], body + b"\0"):
        with pytest.raises(InvalidInput) as planned:
            prepare_infer(model, bad, length, plans)
        with pytest.raises(InvalidInput) as decoded:
            decode_infer_request(bad, int(length))
        assert str(planned.value) == str(decoded.value)


def test_a_planned_binary_request_follows_a_policy_change() -> None:
    model, plans = _model(), InferPlans()
    body, length = _body(np.ones((1, 2)))
    assert prepare_infer(model, body, length, plans).plan.options == {"priority": "interactive"}
    model.batcher.update_policy(classes=(ClassPolicy("gold"),), default_class="gold")
    call = prepare_infer(model, body, length, plans)
    assert call.plan.options == {"priority": "gold"} and call.plan.layout is not None
    np.testing.assert_array_equal(call.payload["x"], np.ones((1, 2), np.float32))


def test_a_plan_is_resolved_again_once_the_policy_version_moves() -> None:
    """Staleness is the batcher's policy version, not which policy object it holds: a
    policy set again (even the same object) makes the plan resolve its options anew."""
    model, plans = _model(), InferPlans()
    body, length = _body(np.ones((1, 2)))
    first = prepare_infer(model, body, length, plans)
    assert first.plan.policy_version == model.batcher.policy_version == 0
    model.batcher.set_policy(model.batcher.policy)
    call = prepare_infer(model, body, length, plans)
    assert call.plan is first.plan and call.plan.policy_version == 1
    assert call.options == {"priority": "interactive"}


@pytest.mark.parametrize(
    "values", [[3.5, 4], [[3.5, 4]], [1e39, -2], [True, 0]], ids=["flat", "nested", "big", "bool"]
)
def test_a_planned_json_request_reads_what_a_full_decode_reads(values: list[Any]) -> None:
    """Planned JSON requests build their payload without the request's objects; the
    arrays (or the 400) are those a full decode gives, also after a policy change."""
    model, plans = _model(), InferPlans()
    prepare_infer(model, _json_body([1, 2], [1, 2], "a"), None, plans)
    body = _json_body(values, [1, 2], "a")
    try:
        full = decode_infer_request(body, None)
    except InvalidInput as exc:
        with pytest.raises(InvalidInput, match=re.escape(str(exc))):
            prepare_infer(model, body, None, plans)
        return
    for _ in range(2):
        call = prepare_infer(model, body, None, plans)
        assert call.request_id == "a"
        np.testing.assert_array_equal(call.payload["x"], full.inputs[0].array)
        assert call.payload["x"].dtype == np.float32
        model.batcher.update_policy(max_delay_s=0.001)  # the second time: a new policy


# ---------------------------------------------------------------------------------------
# Edges of the request path found in review


def _json_document(data: list[Any], **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": data}], **extra}


# --- A binary request can hit a JSON request's plan ------------------------------------


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


# --- A JSON plan keeps its first request's data alive ------------------------------------


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


# --- A deeply nested (but valid) JSON body is a 500 --------------------------------------


def test_a_deeply_nested_json_body_is_a_400_not_a_500() -> None:
    """A body nested past the levels orjson.loads reads (1024) is a 400. Was: one nested
    past what orjson.dumps writes (255), within what it reads, failed in json_shape_key's
    dumps with orjson.JSONEncodeError (a TypeError), which error_response maps to 500; it
    is read and served now."""

    def nested(depth: int) -> bytes:
        value = b'{"a":' * depth + b"1" + b"}" * depth
        return (
            b'{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1,2]}],'
            b'"parameters":{"extra":' + value + b"}}"
        )

    call = prepare_infer(_model(), nested(300), None, InferPlans())
    np.testing.assert_array_equal(call.payload["x"], [[1, 2]])
    with pytest.raises(InvalidInput, match="not valid JSON") as refused:
        prepare_infer(_model(), nested(1100), None, InferPlans())
    assert error_response(refused.value)[0] == 400


# --- NaN and infinities, which Triton and tritonclient.http carry in JSON ----------------


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


# --- A cached plan keeps a priority class the policy no longer has -----------------------


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


# KServe's timeout parameter capped by the deadline of the request's class, as cached
# plans resolve it: again after each policy update, for the default class and for a
# class named by priority.


def _timeout_model() -> ServedModel:
    batcher = Batcher(
        lambda inputs: {"y": inputs["x"]},
        BatchPolicy(
            max_batch_size=8,
            classes=(ClassPolicy("interactive", timeout_s=0.1), ClassPolicy("normal")),
            default_class="normal",
        ),
        collate="dict",
    )
    return ServedModel(
        name="m",
        version="1",
        platform="python",
        inputs=(TensorSpec("x", "FP32", (4,)),),
        outputs=(TensorSpec("y", "FP32", (4,)),),
        batcher=batcher,
    )


def _timeout_body(**parameters: object) -> bytes:
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
    return orjson.dumps({"inputs": [tensor], "parameters": parameters})


def test_a_cached_plans_timeout_follows_the_class_deadline_of_each_policy() -> None:
    """The HTTP plans cache a request's options per policy object: a policy update must
    resolve the cap again, for the default class and for a class named by priority."""
    model, plans = _timeout_model(), InferPlans()
    longer = _timeout_body(timeout=5_000_000)
    named = _timeout_body(priority="interactive", timeout=5_000_000)
    by_level = _timeout_body(priority=1, timeout=50_000)
    assert prepare_infer(model, longer, None, plans).options == {"timeout_s": 5.0}
    assert prepare_infer(model, named, None, plans).options == {"priority": "interactive"}
    assert prepare_infer(model, by_level, None, plans).options == pytest.approx(
        {"priority": "interactive", "timeout_s": 0.05}
    )
    model.batcher.update_policy(
        classes=(ClassPolicy("interactive", timeout_s=10.0), ClassPolicy("normal", timeout_s=1.0))
    )
    assert prepare_infer(model, longer, None, plans).options == {}  # capped at 1 s
    assert prepare_infer(model, named, None, plans).options == {
        "priority": "interactive",
        "timeout_s": 5.0,
    }
    model.batcher.update_policy(timeout_s=2.0, classes=(ClassPolicy("normal"),))
    assert prepare_infer(model, longer, None, plans).options == {}  # the model-wide 2 s
