"""prepare_infer and infer_response: the per-header plan and the cached answer headers."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool import Batcher, ClassPolicy
from carpool.errors import InvalidInput
from carpool.server import infer
from carpool.server.decode import decode_infer_request
from carpool.server.infer import InferPlans, infer_response, prepare_infer
from carpool.server.repository import ServedModel, TensorSpec
from carpool.server.tensors import DATATYPES, WIRE_DTYPES


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
    monkeypatch.setattr(infer, "PLANS_PER_MODEL", 3)
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
