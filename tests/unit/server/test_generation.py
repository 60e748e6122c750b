"""The generation service: KV-pool sizing from settings, the batcher slot that starts and
drains the engine, the KServe face."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from carpool.config import ModelConfig, parse_config
from carpool.errors import ConfigError, InvalidInput
from carpool.generation.build import GenerationSettings
from carpool.server.builder import generation_settings
from carpool.server.generation import RANDOM_WEIGHTS_LABEL, GenerationService, generation_models
from carpool.server.repository import ModelRepository


def _tiny(**settings) -> GenerationService:
    return GenerationService.tiny_random("tiny", GenerationSettings(**settings))


def test_pool_holds_max_num_seqs_full_sequences_by_default():
    service = _tiny(block_size=16, max_num_seqs=4, max_model_len=100)
    assert service.max_model_len == 100
    assert service.engine._runner.num_blocks == 4 * 7  # type: ignore[attr-defined]


def test_pool_sized_from_a_memory_budget():
    service = _tiny(block_size=8, kv_cache_memory_mb=1, max_model_len=64)
    # 2 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes = 512 bytes a token
    assert service.engine._runner.num_blocks == 2**20 // (512 * 8)  # type: ignore[attr-defined]


def test_pool_too_small_for_one_sequence_is_a_config_error():
    with pytest.raises(ConfigError, match="at least 8 blocks"):
        _tiny(block_size=16, num_blocks=4, max_model_len=128)


def test_max_model_len_is_capped_by_the_model():
    assert _tiny(num_blocks=128, max_model_len=100_000).max_model_len == 1024


async def test_batcher_slot_starts_and_drains_the_engine():
    service = _tiny(num_blocks=64, max_model_len=256)
    served = service.served_model()
    assert generation_models(ModelRepository([served])) == {"tiny": service}
    assert service.owned_by == RANDOM_WEIGHTS_LABEL
    await served.batcher.start()
    assert served.batcher.is_running and service.engine.is_running
    await served.batcher.stop()
    assert not served.batcher.is_running and not service.engine.is_running


async def test_kserve_face_continues_each_row_greedily():
    service = _tiny(num_blocks=64, max_model_len=256)
    served = service.served_model()
    await served.batcher.start()
    try:
        payload = {"TEXT": np.array([b"ab", b"ab", b"zz"], dtype=object)}
        out = await served.run(payload, {})
        texts = list(out["TEXT"])
        assert len(texts) == 3 and texts[0] == texts[1]
        with pytest.raises(InvalidInput, match="row 0 is not valid UTF-8"):
            await served.run({"TEXT": np.array([b"\xff"], dtype=object)}, {})
    finally:
        await served.batcher.stop()


async def test_kserve_row_refused_stops_the_other_rows_of_its_request():
    """One row past the context fails the request (a 400); the other rows' generation is
    then for nobody and is aborted, not run to its end."""
    service = _tiny(num_blocks=64, max_model_len=64)
    served = service.served_model()
    await served.batcher.start()
    try:
        rows = np.array([b"ok", b"x" * 200], dtype=object)
        with pytest.raises(InvalidInput):
            await served.run({"TEXT": rows}, {})
        for _ in range(500):  # until "ok" left the engine, aborted or run to its end
            snapshot = service.engine.snapshot(quantiles=False)
            if snapshot.scheduler.num_running == snapshot.scheduler.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        assert snapshot.finished.get("length", 0) == 0, snapshot.finished  # not its 16 tokens
        assert snapshot.finished.get("abort", 0) == 1, snapshot.finished
    finally:
        await served.batcher.stop()


def test_config_keys_become_settings():
    model = ModelConfig.model_validate(
        {
            "name": "g",
            "kind": "generation",
            "source": "/x",
            "block_size": 8,
            "max_num_seqs": 2,
            "dtype": "bfloat16",
            "device": "cpu",
        }
    )
    settings = generation_settings(model)
    assert (settings.block_size, settings.max_num_seqs, settings.dtype) == (8, 2, "bfloat16")
    assert settings.max_num_batched_tokens == GenerationSettings().max_num_batched_tokens


def test_generation_keys_on_other_kinds_are_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    python = {
        "name": "p",
        "kind": "python",
        "source": "m:f",
        "num_blocks": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
    }
    with pytest.raises(ConfigError, match=r"models\[0\]\.num_blocks=4"):
        parse_config({"models": [python]})
    generation = {
        "name": "g",
        "kind": "generation",
        "source": str(tmp_path),
        "devices": ["cpu", "cpu"],
    }
    with pytest.raises(ConfigError, match="one device"):
        parse_config({"models": [generation]})


def test_a_generation_model_refuses_a_batch_policy_it_would_ignore():
    """The engine schedules by its own settings: a policy accepted here would be reported
    as applied and change nothing (``carpool tune`` would measure noise)."""
    batcher = _tiny(num_blocks=64, max_model_len=64).served_model().batcher
    before = batcher.policy
    with pytest.raises(ConfigError, match="engine settings"):
        batcher.update_policy(max_batch_size=4)
    assert batcher.policy is before
