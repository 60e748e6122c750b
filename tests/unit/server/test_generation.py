"""The generation service: KV-pool sizing from settings, a served model with no batcher
whose repository starts and drains the engine, the KServe face, no batch policy."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from carpool.config import ModelConfig, parse_config
from carpool.core.batcher import Batcher
from carpool.errors import ConfigError, InvalidInput
from carpool.generation.build import GenerationSettings
from carpool.server.app import KServeApp
from carpool.server.builder import generation_settings
from carpool.server.generation import RANDOM_WEIGHTS_LABEL, GenerationService
from carpool.server.repository import ModelRepository, ServedModel

from .apps import call
from .http.fakes import until
from .test_completions import MODEL, tiny_generation_app


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


async def test_the_repository_starts_and_drains_the_engine_of_a_model_with_no_batcher():
    service = _tiny(num_blocks=64, max_model_len=256)
    served = ServedModel.of_generation(service)
    repository = ModelRepository([served])
    assert served.batcher is None and served.generation is service
    assert repository.generation_services() == {"tiny": service}
    assert repository.embedding_services() == {}
    assert service.owned_by == RANDOM_WEIGHTS_LABEL
    assert repository.index() == [
        {"name": "tiny", "version": "1", "state": "UNAVAILABLE", "reason": ""}
    ]
    await repository.start()
    assert served.is_ready and repository.is_ready and service.engine.is_running
    assert repository.index()[0]["state"] == "READY"
    await repository.stop()
    assert not served.is_ready and not service.engine.is_running
    assert repository.cut_off() == 0  # nothing of a generation model is cut off


async def test_kserve_face_continues_each_row_greedily():
    service = _tiny(num_blocks=64, max_model_len=256)
    served = ServedModel.of_generation(service)
    await served.start()
    try:
        payload = {"TEXT": np.array([b"ab", b"ab", b"zz"], dtype=object)}
        out = await served.run(payload, {})
        texts = list(out["TEXT"])
        assert len(texts) == 3 and texts[0] == texts[1]
        with pytest.raises(InvalidInput, match="row 0 is not valid UTF-8"):
            await served.run({"TEXT": np.array([b"\xff"], dtype=object)}, {})
    finally:
        await served.stop()


async def test_kserve_row_refused_stops_the_other_rows_of_its_request():
    """One row past the context fails the request (a 400); the other rows' generation is
    then for nobody and is aborted, not run to its end."""
    service = _tiny(num_blocks=64, max_model_len=64)
    served = ServedModel.of_generation(service)
    await served.start()
    try:
        rows = np.array([b"ok", b"x" * 200], dtype=object)
        with pytest.raises(InvalidInput):
            await served.run({"TEXT": rows}, {})

        def idle() -> bool:  # "ok" left the engine, aborted or run to its end
            scheduler = service.engine.snapshot(quantiles=False).scheduler
            return scheduler.num_running == scheduler.num_waiting == 0

        await until(idle)
        snapshot = service.engine.snapshot(quantiles=False)
        assert snapshot.finished.get("length", 0) == 0, snapshot.finished  # not its 16 tokens
        assert snapshot.finished.get("abort", 0) == 1, snapshot.finished
    finally:
        await served.stop()


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
    # The buffer pool is on by default for batched kinds; a generation model refuses it
    # only when asked for.
    single = {**generation, "devices": ["cpu"]}
    assert parse_config({"models": [single]}).models[0].kind == "generation"
    with pytest.raises(ConfigError, match=r"models\[0\]\.buffer_pool=True"):
        parse_config({"models": [{**single, "buffer_pool": True}]})


def test_a_generation_model_has_no_batch_policy_to_show_or_set():
    """The engine schedules by its own settings: a policy accepted here would be reported
    as applied and change nothing (``carpool tune`` would measure noise)."""
    served = ServedModel.of_generation(_tiny(num_blocks=64, max_model_len=64))
    assert served.batcher is None and served.policy is None
    with pytest.raises(ConfigError, match="engine settings"):
        served.require_batcher()
    assert served.class_names == ("interactive", "normal", "background")
    config = served.config()
    assert "dynamic_batching" not in config and config["max_batch_size"] == 64
    # The kernels its steps run, as Triton's string parameters.
    kernels = served.generation.kernels() if served.generation is not None else {}
    assert set(kernels) == {"decode_attention", "linear", "elementwise", "huge_pages"}
    assert kernels["decode_attention"] in ("kernel", "torch")
    assert kernels["elementwise"] in ("carpool-fused", "torch")
    assert kernels["huge_pages"] in ("madvise", "always") or kernels["huge_pages"].startswith("off")
    assert config["parameters"] == {k: {"string_value": v} for k, v in kernels.items()}


@pytest.fixture
async def app() -> AsyncIterator[KServeApp]:
    async with tiny_generation_app() as app:
        yield app


async def test_a_policy_post_to_a_generation_model_is_a_400_naming_its_settings(app):
    got = await call(app, f"/v2/models/{MODEL}/policy", max_batch_size=4)
    assert got.status == 400
    assert "max_num_seqs" in got.json()["error"]


def test_a_served_model_runs_on_a_batcher_or_an_engine_never_both_or_neither():
    service = _tiny(num_blocks=64, max_model_len=64)
    spec = ServedModel.of_generation(service).inputs
    with pytest.raises(ConfigError, match=r"'neither'.*a batcher or a generation engine"):
        ServedModel("g", "1", "pytorch", spec, spec, infer=service.infer)
    both = {"infer": service.infer, "generation": service}
    with pytest.raises(ConfigError, match=r"'both'.*a batcher or a generation engine"):
        ServedModel("g", "1", "pytorch", spec, spec, Batcher(lambda x: x), **both)
    with pytest.raises(ConfigError, match="its engine's KServe face"):
        ServedModel("g", "1", "pytorch", spec, spec, generation=service)
