"""Review of repeated heads (`carpool.server.heads`) and JSON answer cuts: the same bytes,
cut into the same reads, get what the parser's path gives them."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import pytest

from carpool import Batcher
from carpool.server.fasthttp import MAX_HEAD_BYTES
from carpool.server.infer import InferPlans, infer_response, prepare_infer
from carpool.server.repository import ServedModel, TensorSpec
from carpool.server.tensors import OutputTensor, encode_infer_response

from .test_fasthttp import (
    FakeTransport,
    Responses,
    Server,
    _binary_request,
    _until,
    serving,
)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with serving() as served:
        yield served


async def _answers(transport: FakeTransport, count: int) -> list[Any]:
    await _until(lambda: len(Responses(bytes(transport.data)).items) >= count)
    items = Responses(bytes(transport.data)).items
    assert len(items) == count
    return items


def _statuses(transport: FakeTransport) -> list[int]:
    """The status of each answer written, read leniently (an answer may follow one that
    closed the connection)."""
    return [int(status) for status in re.findall(rb"HTTP/1.1 (\d{3}) ", bytes(transport.data))]


async def test_a_head_after_repeats_counts_its_bytes_as_after_a_parsed_message(
    server: Server,
) -> None:
    """Was: a read of whole repeats then part of another head left the parser no progress
    to see, so that part counted towards MAX_HEAD_BYTES; fed to the parser, the message
    before it was progress and it did not count. A head arriving over three reads was then
    refused (431) after a repeat, and taken after the same bytes parsed."""
    _, connect, _ = server
    half = MAX_HEAD_BYTES * 5 // 8
    get = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nX-Big: %s\r\n\r\n" % (b"a" * 2 * half)
    reads = [_binary_request(2.0) + get[:half], get[half : 2 * half], get[2 * half :]]
    statuses = []
    for is_kept in (False, True):
        protocol, transport = connect()
        protocol.data_received(_binary_request(1.0))
        await _answers(transport, 1)
        assert protocol._repeat is not None
        if not is_kept:
            protocol._repeat = None  # the parser's path
        for read in reads:
            protocol.data_received(read)
        await _until(lambda: len(_statuses(transport)) >= 3 or transport.closed)  # noqa: B023
        await asyncio.sleep(0.01)
        statuses.append(_statuses(transport))
    assert statuses == [[200, 200, 200], [200, 200, 200]]


async def test_a_repeat_is_answered_in_the_encoding_its_head_asked_for(server: Server) -> None:
    """Accept-Encoding is in the head a repeat takes again: each answer is compressed as
    the first was."""
    _, connect, _ = server
    protocol, transport = connect()
    for value in range(3):
        raw = _binary_request(float(value), rows=200, extra=b"Accept-Encoding: gzip\r\n")
        protocol.data_received(raw)
        await _answers(transport, value + 1)
        assert protocol._repeat is not None and raw.startswith(protocol._repeat.head)
    items = Responses(bytes(transport.data)).items
    assert [item[1].get(b"content-encoding") for item in items] == [b"gzip"] * 3


def test_a_json_plan_answers_each_output_shape_as_the_full_encoder_does() -> None:
    """The answers of one JSON plan, cut once per output shape: each one byte for byte
    what encode_infer_response writes, shapes with no elements, values of another dtype
    and NaN included."""
    outputs = (TensorSpec("y", "FP32", (-1,)), TensorSpec("ok", "BOOL", (-1,)))
    model = ServedModel(
        "m", "1", "python", (TensorSpec("x", "FP32", (2,)),), outputs, Batcher(lambda x: x)
    )
    document = {
        "id": '"data":[]',
        "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}],
    }
    plans = InferPlans()
    results: list[dict[str, Any]] = [
        {"y": np.arange(3, dtype=np.float32)[None], "ok": np.array([[True, False]])},
        {"y": np.zeros((1, 0), dtype=np.float32), "ok": np.array([[1, 0, 2]])},
        {"y": np.arange(4, dtype=np.float64)[None] / 3, "ok": np.array([[False, True]])},
        {"y": np.array([[np.nan, 1.0]], dtype=np.float32), "ok": np.array([[True]])},
        {"y": np.array([[5.5, 6, 7]], dtype=np.float32), "ok": np.array([[False, True]])},
    ]
    plan = None
    for result in results:
        call = prepare_infer(model, orjson.dumps(document), None, plans)
        assert plan is None or call.plan is plan
        plan = call.plan
        status, body, _ = infer_response(model, call, result)
        tensors = [OutputTensor(s.name, result[s.name], s.datatype) for s in outputs]
        full, _ = encode_infer_response("m", "1", '"data":[]', tensors, set())
        assert (status, body) == (200, full)
    assert plan is not None and plan.json_answers is not None and len(plan.json_answers) == 4
