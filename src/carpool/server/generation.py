"""A text-generation model served over OpenAI's ``/v1/completions`` and
``/v1/chat/completions`` (``server/completions.py``) and a KServe v2 face.

Built from a Hugging Face folder (``config.json`` with ``model_type`` llama or gpt2,
``model.safetensors``, ``tokenizer.json``) or, for ``carpool serve`` without a config, a
small random-weight Llama with the byte tokenizer::

    GenerationService ── engine: GenerationEngine ── scheduler (adapted) ── KV-cache manager
                      │                           └─ runner (ModelRunner: model + KV cache)
                      └─ tokenizer, chat template, max_model_len

A served model has a batcher slot that the repository starts, stops and reads telemetry
from. A generation model fills it with :class:`EngineBatcher`: an idle core batcher (the
KServe face does not use it) whose ``start``/``stop`` also start and drain the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from carpool.core.batcher import Batcher
from carpool.core.policy import DEFAULT_CLASSES, BatchPolicy
from carpool.errors import ConfigError, InvalidInput
from carpool.generation.engine import GenerationEngine, SchedulerStats, SeqUpdate
from carpool.generation.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from carpool.generation.types import SamplingParams, StepInput, StepOutput
from carpool.server.repository import EngineScheduling, ModelRepository, ServedModel, TensorSpec

if TYPE_CHECKING:
    from carpool.generation.scheduler import Scheduler

RANDOM_WEIGHTS_LABEL = "carpool (random weights, byte tokenizer: output is noise)"
# The built-in random-weight model: ~0.3M parameters, fast on one CPU core.
TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
KSERVE_MAX_TOKENS = 16  # what a KServe request generates (OpenAI's default for completions)
PRIORITY_CLASSES = tuple(c.name for c in DEFAULT_CLASSES)  # SchedulerConfig's default


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


class SchedulerAdapter:
    """The real :class:`~carpool.generation.scheduler.Scheduler` as the engine's
    :class:`~carpool.generation.engine.StepScheduler`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def add(
        self,
        seq_id: int,
        prompt_ids: tuple[int, ...],
        sampling: SamplingParams,
        priority: str | None,
    ) -> None:
        self._scheduler.add_request(seq_id, prompt_ids, sampling, class_name=priority)

    def schedule(self) -> StepInput:
        return self._scheduler.schedule().step_input

    def update(self, step: StepInput, output: StepOutput) -> Sequence[SeqUpdate]:
        return [
            SeqUpdate(e.request_id, e.new_token_ids, e.finish_reason)
            for e in self._scheduler.update(step, output)
        ]

    def abort(self, seq_id: int) -> None:
        self._scheduler.abort(seq_id)

    def has_work(self) -> bool:
        return self._scheduler.has_unfinished()

    def stats(self) -> SchedulerStats:
        s = self._scheduler.stats()
        return SchedulerStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_usage,
            num_prefix_cache_queries=s.num_prefix_queried_tokens,
            num_prefix_cache_hits=s.num_prefix_hit_tokens,
            num_preemptions=s.num_preemptions,
        )


class GenerationService:
    """One generation model: its engine, tokenizer and OpenAI/KServe faces."""

    def __init__(
        self,
        name: str,
        engine: GenerationEngine,
        *,
        settings: GenerationSettings,
        owned_by: str = "carpool",
        classes: tuple[str, ...] = PRIORITY_CLASSES,
    ) -> None:
        self.name = name
        self.engine = engine
        self.settings = settings  # as the engine was built from them (see _resolve)
        self.classes = classes  # the scheduler's priority classes, highest first
        self.tokenizer: Tokenizer = engine.tokenizer
        self.owned_by = owned_by
        self.batcher = EngineBatcher(self)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @classmethod
    def from_folder(
        cls, name: str, folder: str | Path, settings: GenerationSettings
    ) -> GenerationService:
        """Load a Hugging Face folder's weights and tokenizer.

        Raises:
            ConfigError: naming ``source`` when the folder cannot be served.
        """
        from carpool.generation.weights import load_model

        path = Path(folder)
        tokenizer = HFTokenizer.from_folder(path)
        try:
            model = load_model(path)
        except (OSError, ValueError, KeyError) as error:
            raise ConfigError(
                "source", str(path), f"a llama or gpt2 model folder ({error})"
            ) from None
        resolved = _resolve(model, settings)
        return cls(name, _engine(name, model, tokenizer, resolved), settings=resolved)

    @classmethod
    def tiny_random(
        cls, name: str, settings: GenerationSettings | None = None
    ) -> GenerationService:
        """A small Llama with random weights (seed 0) and the byte tokenizer: it runs the
        whole path (paged KV cache, continuous batching, streaming), its text is noise."""
        from carpool.generation.weights import random_llama

        tokenizer = ByteTokenizer()
        model = random_llama({**TINY_LLAMA, "vocab_size": tokenizer.vocab_size}, seed=0)
        resolved = _resolve(
            model, settings or GenerationSettings(num_blocks=512, max_model_len=1024)
        )
        engine = _engine(name, model, tokenizer, resolved)
        return cls(name, engine, owned_by=RANDOM_WEIGHTS_LABEL, settings=resolved)

    async def infer(self, payload: dict[str, np.ndarray], options: dict[str, Any]) -> Any:
        """The KServe face: ``TEXT`` rows in, each row's greedy continuation
        (``KSERVE_MAX_TOKENS`` tokens) out as ``TEXT``."""
        rows = []
        for i, value in enumerate(payload["TEXT"].reshape(-1)):
            try:
                rows.append(value.decode("utf-8") if isinstance(value, bytes) else str(value))
            except UnicodeDecodeError as error:
                raise InvalidInput(f"input 'TEXT' row {i} is not valid UTF-8 ({error})") from None
        priority = options.get("priority")
        rows_running = [asyncio.ensure_future(self._greedy(text, priority)) for text in rows]
        try:
            texts = await asyncio.gather(*rows_running)
        finally:  # a row refused fails the request: the others' text is for nobody
            for row in rows_running:
                row.cancel()
        return {"TEXT": np.array([t.encode("utf-8") for t in texts], dtype=object)}

    async def _greedy(self, text: str, priority: str | None) -> str:
        prompt = self.tokenizer.encode(text)
        room = self.max_model_len - len(prompt)
        sampling = SamplingParams(temperature=0.0, max_tokens=max(1, min(KSERVE_MAX_TOKENS, room)))
        parts = [e.text async for e in self.engine.generate(prompt, sampling, priority)]
        return "".join(parts)

    def served_model(self) -> ServedModel:
        return ServedModel(
            name=self.name,
            version="1",
            platform="pytorch",
            inputs=(TensorSpec("TEXT", "BYTES", ()),),
            outputs=(TensorSpec("TEXT", "BYTES", ()),),
            batcher=self.batcher,
            infer=self.infer,
            engine=self.scheduling(),
        )

    def scheduling(self) -> EngineScheduling:
        """The engine settings that stand in for a batch policy (``/config``, ``/policy``)."""
        s = self.settings
        return EngineScheduling(
            {
                "max_num_seqs": s.max_num_seqs,
                "max_num_batched_tokens": s.max_num_batched_tokens,
                "block_size": s.block_size,
                "num_blocks": s.num_blocks or 0,  # resolved: never None here
                "max_model_len": self.max_model_len,
                "device": s.device,
            }
        )


def _never_called(batch: Any) -> Any:
    raise AssertionError("a generation model's batcher gets no requests")


class EngineBatcher(Batcher):
    """Fills a generation model's batcher slot: starts and drains the engine with it."""

    def __init__(self, service: GenerationService) -> None:
        super().__init__(_never_called, BatchPolicy(), name=service.name, collate="list")
        self.service = service

    async def start(self) -> None:
        await super().start()
        await self.service.engine.start()

    async def stop(self, drain: bool = True, *, timeout_s: float | None = None) -> None:
        await self.service.engine.stop(drain=drain)
        await super().stop(drain=drain, timeout_s=timeout_s)

    def set_policy(self, policy: BatchPolicy) -> None:
        """Refused: the engine schedules by its own settings, so a batch policy set here
        would be answered as applied and change nothing (``POST .../policy`` is a 400,
        and ``carpool tune`` is told so instead of measuring noise)."""
        raise self.service.scheduling().no_batch_policy(self.service.name)


def generation_models(repository: ModelRepository) -> dict[str, GenerationService]:
    """The repository's generation models by name."""
    return {m.name: m.batcher.service for m in repository if isinstance(m.batcher, EngineBatcher)}


def _resolve(model: Any, settings: GenerationSettings) -> GenerationSettings:
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


def _engine(
    name: str, model: Any, tokenizer: Tokenizer, settings: GenerationSettings
) -> GenerationEngine:
    """The engine for ``settings`` as :func:`_resolve` gives them."""
    import torch

    from carpool.generation.block_pool import BlockPool
    from carpool.generation.kv_cache import KVCacheManager
    from carpool.generation.runner import ModelRunner
    from carpool.generation.scheduler import Scheduler, SchedulerConfig

    assert settings.num_blocks is not None and settings.max_model_len is not None, "resolved"
    dtype = getattr(torch, settings.dtype)
    num_blocks, max_model_len = settings.num_blocks, settings.max_model_len
    runner = ModelRunner(
        model, num_blocks, settings.block_size, settings.device, dtype, seed=settings.seed
    )
    pool = BlockPool(num_blocks, settings.block_size)
    eos = tokenizer.eos_token_ids
    limits = SchedulerConfig(
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        eos_token_id=eos[0] if eos else None,
    )
    # No detokenize: the engine matches stop strings on the text it streams anyway.
    scheduler = SchedulerAdapter(Scheduler(limits, KVCacheManager(pool)))
    return GenerationEngine(scheduler, runner, tokenizer, name=name, max_model_len=max_model_len)
