"""A generation engine from a model, its tokenizer and :class:`GenerationSettings`::

    GenerationEngine ── Scheduler ── KVCacheManager ── BlockPool
                     ├─ ModelRunner (model + K/V tensors of num_blocks blocks)
                     └─ OutputProcessor (the tokenizer: text, EOS ids, stop strings)

Nothing here knows HTTP: ``carpool.server.generation`` serves the engine these build.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from carpool.errors import ConfigError
from carpool.generation.engine import GenerationEngine
from carpool.generation.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    """How a generation model is laid out and batched (``kind: generation`` keys).

    ``num_blocks`` wins over ``kv_cache_memory_mb``; with neither, the cache holds
    ``max_num_seqs`` full-length sequences. ``max_model_len`` None: the model's own limit.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_mb: float | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    seed: int | None = None
    decode_attention: str = "auto"  # auto | kernel | torch (carpool.generation.paged_decode)


def resolve_settings(model: Any, settings: GenerationSettings) -> GenerationSettings:
    """``settings`` as the engine runs them: ``max_model_len`` capped by the model,
    ``num_blocks`` sized, ``max_num_batched_tokens`` at least ``max_num_seqs``.

    Raises:
        ConfigError: naming ``num_blocks`` when the pool cannot hold one sequence.
    """
    import torch

    from carpool.generation.block_pool import BlockPool
    from carpool.generation.runner import ModelRunner

    dtype = getattr(torch, settings.dtype)
    config = model.config
    model_max = int(getattr(config, "max_position_embeddings", 0) or config.n_positions)
    max_model_len = min(settings.max_model_len or model_max, model_max)
    num_blocks = settings.num_blocks
    if num_blocks is None:
        if settings.kv_cache_memory_mb is not None:
            per_token = ModelRunner.bytes_per_token_of(model, dtype)
            budget = int(settings.kv_cache_memory_mb * 2**20)
            num_blocks = BlockPool.num_blocks_for_budget(budget, per_token, settings.block_size)
        else:
            per_seq = -(-max_model_len // settings.block_size)
            num_blocks = per_seq * settings.max_num_seqs
    if num_blocks * settings.block_size < max_model_len:
        raise ConfigError(
            "num_blocks",
            num_blocks,
            f"at least {-(-max_model_len // settings.block_size)} blocks of "
            f"{settings.block_size} tokens: one sequence of max_model_len={max_model_len}",
        )
    return replace(
        settings,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(settings.max_num_batched_tokens, settings.max_num_seqs),
    )


def build_engine(
    name: str, model: Any, tokenizer: Tokenizer, settings: GenerationSettings
) -> GenerationEngine:
    """The engine for ``settings`` as :func:`resolve_settings` gives them."""
    import torch

    from carpool.generation.block_pool import BlockPool
    from carpool.generation.kv_cache import KVCacheManager
    from carpool.generation.runner import ModelRunner
    from carpool.generation.scheduler import Scheduler, SchedulerConfig

    assert settings.num_blocks is not None and settings.max_model_len is not None, "resolved"
    dtype = getattr(torch, settings.dtype)
    num_blocks = settings.num_blocks
    runner = ModelRunner(
        model,
        num_blocks,
        settings.block_size,
        settings.device,
        dtype,
        seed=settings.seed,
        decode_attention=settings.decode_attention,
    )
    limits = SchedulerConfig(
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
    )
    scheduler = Scheduler(limits, KVCacheManager(BlockPool(num_blocks, settings.block_size)))
    return GenerationEngine(
        scheduler,
        runner,
        tokenizer,
        name=name,
        max_model_len=settings.max_model_len,
        model_vocab_size=model.vocab_size,
    )
