"""A KServe REST inference request from body to answer, planned per JSON header.

:func:`prepare_infer` decodes a body and checks it against its model; :func:`infer_response`
encodes the model's outputs as (status, body, headers).

Binary requests (what ``tritonclient`` sends by default) carry their tensors after a JSON
header that a client repeats byte for byte for every request of one shape. So everything
that depends only on that header is worked out once per model and header and kept in an
:class:`InferPlan`: the header's parse and checks, the model's input checks, the batcher
options, the outputs asked for, and the JSON header of the answer for each output shape.
A request then costs the decoding of its tensor bytes, its place in a batch and the copy
of its outputs. JSON requests are planned the same way by their document without its
``data`` lists. :class:`InferPlans` is the one cache of plans.

A plan's batcher options (the priority class a level names, a deadline the class caps)
were resolved under one version of the model's batch policy; a request whose plan was
made under an older version (``Batcher.policy_version``) resolves them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from carpool.errors import InvalidInput
from carpool.server.classification import class_counts
from carpool.server.kserve.requested import answer_tensors, wanted_outputs
from carpool.server.kserve.rest_decode import (
    BinaryLayout,
    InferHeader,
    binary_layout,
    binary_payload,
    decode_json_with_header,
    decode_with_header,
    header_of,
    json_payload,
    json_shape_key,
    parse_json_document,
    split_infer_body,
)
from carpool.server.kserve.rest_encode import (
    encode_infer_response,
    fill_json_answer,
    json_answer_parts,
)
from carpool.server.kserve.tensors import InferRequest, tensor_bytes
from carpool.server.repository import ServedModel, TensorSpec

__all__ = [
    "JSON_HEADERS",
    "Answer",
    "Headers",
    "InferCall",
    "InferPlan",
    "InferPlans",
    "infer_response",
    "prepare_infer",
]

Headers = tuple[tuple[bytes, bytes], ...]
Answer = tuple[int, bytes, Headers]

JSON_HEADERS: Headers = ((b"content-type", b"application/json"),)
_BINARY_TYPE = (b"content-type", b"application/octet-stream")
_HEADER_LENGTH = b"inference-header-content-length"
PLANS_PER_MODEL = 64
ANSWER_HEADERS_PER_PLAN = 16


@dataclass(slots=True)
class InferPlan:
    """What every request sending one JSON header asks of one model, checked once.

    ``answers`` keeps the answer's JSON header by the output shapes (only when every
    output goes back as fixed-size binary data, whose header then depends on nothing else).
    ``classes`` names the outputs asked as their top classes (Triton's classification
    extension) and how many, None when there is none.
    """

    header: InferHeader
    options: dict[str, Any]
    wanted: list[TensorSpec]
    binary: set[str]
    policy_version: int  # the model's batch policy ``options`` were resolved under
    answers: dict[tuple[tuple[int, ...], ...], bytes] | None = field(default_factory=dict)
    # Answers all in JSON: the answer cut where each output's data goes, by output shapes.
    json_answers: dict[tuple[tuple[int, ...], ...], tuple[bytes, ...]] | None = None
    classes: dict[str, int] | None = None
    # Where a binary header's inputs lie in the body: its requests' payloads are read
    # straight from their bytes (None: JSON, BYTES or BF16 inputs, decoded in full).
    layout: BinaryLayout | None = None


@dataclass(slots=True)  # not frozen: a frozen dataclass is slower to make, per request
class InferCall:
    """A decoded, checked KServe inference request, ready for its model (not to be
    changed once made)."""

    request_id: str | None
    payload: dict[str, np.ndarray]
    plan: InferPlan

    @property
    def options(self) -> dict[str, Any]:
        """Batcher keywords (priority, timeout) from the request parameters."""
        return self.plan.options


class InferPlans:
    """Plans by model and key: a binary request's header bytes, or a JSON request's
    document without its data (kept apart, so that no binary header can meet a JSON
    plan). Bounded per model, the oldest plan goes first; keys longer than
    ``MAX_KEY_BYTES`` are not kept."""

    MAX_KEY_BYTES = 4096

    def __init__(self) -> None:
        self._by_model: dict[tuple[str, bool], dict[bytes, InferPlan]] = {}

    def get(self, model: ServedModel, key: bytes, *, is_json: bool = False) -> InferPlan | None:
        plans = self._by_model.get((model.name, is_json))
        return None if plans is None else plans.get(key)

    def put(
        self, model: ServedModel, key: bytes, plan: InferPlan, *, is_json: bool = False
    ) -> None:
        if len(key) > self.MAX_KEY_BYTES:
            return
        plans = self._by_model.setdefault((model.name, is_json), {})
        if len(plans) >= PLANS_PER_MODEL:
            del plans[next(iter(plans))]
        plans[key] = plan


def prepare_infer(
    model: ServedModel, body: bytes, header_length: bytes | None, plans: InferPlans
) -> InferCall:
    """Decode and check an infer body; ``header_length`` is the value of the
    Inference-Header-Content-Length HTTP header (None: the whole body is JSON).

    Raises:
        InvalidInput: naming what was wrong and what was expected.
    """
    length = None
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            raise InvalidInput(
                f"header Inference-Header-Content-Length={header_length!r}: expected a byte count"
            ) from None
    header_bytes, binary = split_infer_body(body, length)
    if length is None:
        return _prepare_json(model, header_bytes, plans)
    plan = plans.get(model, header_bytes)
    if plan is not None:  # the same header as an earlier request: checked then
        layout = plan.layout
        if layout is not None and plan.policy_version == model.policy_version:
            return InferCall(plan.header.request_id, binary_payload(layout, binary), plan)
        request = decode_with_header(plan.header, binary)
        return _planned_call(model, plan, request)
    header = header_of(parse_json_document(header_bytes)[0])
    call = _first_call(model, header, decode_with_header(header, binary))
    if header.is_cacheable:
        call.plan.layout = binary_layout(header)
        plans.put(model, header_bytes, call.plan)
    return call


def _prepare_json(model: ServedModel, body: bytes, plans: InferPlans) -> InferCall:
    """A JSON request: planned by its document without the tensor data, so requests that
    differ only in their numbers share the checks."""
    document, is_strict = parse_json_document(body)
    # A document with NaN or Infinity is not planned: its key would write them as null.
    key = json_shape_key(document) if is_strict else None
    plan = plans.get(model, key, is_json=True) if key is not None else None
    if plan is not None:
        if plan.policy_version == model.policy_version:  # no request objects needed
            return InferCall(plan.header.request_id, json_payload(plan.header, document), plan)
        request = decode_json_with_header(plan.header, document)
        return _planned_call(model, plan, request)
    header = header_of(document)
    call = _first_call(model, header, decode_with_header(header, memoryview(b"")))
    if key is not None:  # kept without this request's data: later ones bring their own
        specs = tuple(replace(spec, data=[]) for spec in header.specs)
        call.plan.header = replace(header, specs=specs)
        plans.put(model, key, call.plan, is_json=True)
    return call


def _planned_call(model: ServedModel, plan: InferPlan, request: InferRequest) -> InferCall:
    """A request of a known plan; its options are resolved again if the model's batch
    policy (and with it the priority classes) changed since."""
    version = model.policy_version
    if plan.policy_version != version:
        plan.options, plan.policy_version = model.submit_options(request), version
    return InferCall(request.request_id, {t.name: t.array for t in request.inputs}, plan)


def _first_call(model: ServedModel, header: InferHeader, request: InferRequest) -> InferCall:
    """The call and its new plan: the model's checks of the request's inputs and outputs."""
    payload = model.payload(request)
    wanted = wanted_outputs(model, request.outputs)
    classes = class_counts(request.outputs, wanted)
    version = model.policy_version
    options = model.submit_options(request)
    plan = InferPlan(header, options, wanted, _binary(request, wanted), version, classes=classes)
    if (
        classes is not None
        or plan.binary != {spec.name for spec in wanted}
        or any(spec.datatype == "BYTES" for spec in wanted)
    ):
        plan.answers = None  # JSON or variable-size outputs: encoded in full each time
        if classes is None and not plan.binary and _has_fixed_size_numbers(wanted):
            plan.json_answers = {}  # all JSON numbers: cut where each output's data goes
    return InferCall(request.request_id, payload, plan)


def infer_response(model: ServedModel, call: InferCall, result: dict[str, Any]) -> Answer:
    """(status, body, headers) answering ``call`` with the model's ``result``."""
    plan = call.plan
    answers = plan.answers
    if answers is not None:
        arrays = [result[spec.name] for spec in plan.wanted]
        shapes = tuple([array.shape for array in arrays])
        json_header = answers.get(shapes)
        if json_header is not None:
            chunks = [tensor_bytes(s.datatype, a) for s, a in zip(plan.wanted, arrays, strict=True)]
            return 200, b"".join([json_header, *chunks]), _binary_headers(len(json_header))
    if plan.json_answers is not None:
        body = _planned_json_answer(model, call, result)
        if body is not None:
            return 200, body, JSON_HEADERS
    outputs = answer_tensors(plan.wanted, result, plan.classes)
    data, json_length = encode_infer_response(
        model.name, model.version, call.request_id, outputs, plan.binary
    )
    if json_length is None:
        return 200, data, JSON_HEADERS
    if answers is not None and len(answers) < ANSWER_HEADERS_PER_PLAN:
        answers[tuple(o.array.shape for o in outputs)] = data[:json_length]
    return 200, data, _binary_headers(json_length)


def _planned_json_answer(
    model: ServedModel, call: InferCall, result: dict[str, Any]
) -> bytes | None:
    """The answer of a plan answered all in JSON, filled into the parts kept for its
    output shapes; None when the full encoder must write it (outputs that are not arrays,
    NaN or infinities, more shapes than a plan keeps)."""
    plan = call.plan
    answers = plan.json_answers
    assert answers is not None
    arrays = [result[spec.name] for spec in plan.wanted]
    if not all(type(array) is np.ndarray for array in arrays):
        return None
    shapes = tuple(array.shape for array in arrays)
    parts = answers.get(shapes)
    if parts is None:
        if len(answers) >= ANSWER_HEADERS_PER_PLAN:
            return None
        described = [
            (s.name, s.datatype, a.shape) for s, a in zip(plan.wanted, arrays, strict=True)
        ]
        parts = json_answer_parts(model.name, model.version, call.request_id, described)
        if parts is None:
            return None
        answers[shapes] = parts
    return fill_json_answer(parts, [spec.datatype for spec in plan.wanted], arrays)


def _has_fixed_size_numbers(wanted: list[TensorSpec]) -> bool:
    """Whether every output is a number type JSON can carry (not BYTES, not BF16)."""
    return not any(spec.datatype in ("BYTES", "BF16") for spec in wanted)


_BINARY_HEADERS: dict[int, Headers] = {}  # by JSON header length: one tuple per length
_MAX_BINARY_HEADERS = 1024


def _binary_headers(json_length: int) -> Headers:
    headers = _BINARY_HEADERS.get(json_length)
    if headers is None:
        headers = (_BINARY_TYPE, (_HEADER_LENGTH, b"%d" % json_length))
        if len(_BINARY_HEADERS) < _MAX_BINARY_HEADERS:
            _BINARY_HEADERS[json_length] = headers
    return headers


def _binary(request: InferRequest, wanted: list[TensorSpec]) -> set[str]:
    if request.outputs is None:
        return {s.name for s in wanted} if request.is_binary_output_default else set()
    return {o.name for o in request.outputs if o.is_binary}
