"""A text-generation model served over OpenAI's ``/v1/completions`` and
``/v1/chat/completions`` (``server/completions.py``) and a KServe v2 face.

Built from a Hugging Face folder (``config.json`` with ``model_type`` llama or gpt2,
``model.safetensors``, ``tokenizer.json``) or, for ``carpool serve`` without a config, a
small random-weight Llama with the byte tokenizer::

    GenerationService ── engine: GenerationEngine (carpool.generation.build)
                      └─ tokenizer, chat template, max_model_len, settings

The engine schedules its requests itself: :meth:`ServedModel.of_generation` serves the
service with no core batcher, and the repository starts and drains the engine.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from carpool.core.policy import DEFAULT_CLASSES
from carpool.errors import ConfigError, InvalidInput
from carpool.generation.build import GenerationSettings, build_engine, resolve_settings
from carpool.generation.engine import GenerationEngine
from carpool.generation.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from carpool.generation.types import SamplingParams
from carpool.server.errors import GenerationTimedOut

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
        self.settings = settings  # as the engine was built from them (resolve_settings)
        self.classes = classes  # the scheduler's priority classes, highest first
        self.tokenizer: Tokenizer = engine.tokenizer
        self.owned_by = owned_by

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
        resolved = resolve_settings(model, settings)
        return cls(name, build_engine(name, model, tokenizer, resolved), settings=resolved)

    @classmethod
    def tiny_random(
        cls, name: str, settings: GenerationSettings | None = None
    ) -> GenerationService:
        """A small Llama with random weights (seed 0) and the byte tokenizer: it runs the
        whole path (paged KV cache, continuous batching, streaming), its text is noise."""
        from carpool.generation.weights import random_llama

        tokenizer = ByteTokenizer()
        model = random_llama({**TINY_LLAMA, "vocab_size": tokenizer.vocab_size}, seed=0)
        resolved = resolve_settings(
            model, settings or GenerationSettings(num_blocks=512, max_model_len=1024)
        )
        engine = build_engine(name, model, tokenizer, resolved)
        return cls(name, engine, owned_by=RANDOM_WEIGHTS_LABEL, settings=resolved)

    async def infer(self, payload: dict[str, np.ndarray], options: dict[str, Any]) -> Any:
        """The KServe face: ``TEXT`` rows in, each row's greedy continuation
        (``KSERVE_MAX_TOKENS`` tokens) out as ``TEXT``. With a ``timeout`` (``timeout_s``
        here) the rows not done when it runs out are stopped, and the request fails with
        :class:`~carpool.server.errors.GenerationTimedOut` (503, UNAVAILABLE)."""
        rows = []
        for i, value in enumerate(payload["TEXT"].reshape(-1)):
            try:
                rows.append(value.decode("utf-8") if isinstance(value, bytes) else str(value))
            except UnicodeDecodeError as error:
                raise InvalidInput(f"input 'TEXT' row {i} is not valid UTF-8 ({error})") from None
        priority, timeout_s = options.get("priority"), options.get("timeout_s")
        started_s = time.monotonic()
        rows_running = [asyncio.ensure_future(self._greedy(text, priority)) for text in rows]
        deadline = asyncio.timeout(timeout_s)  # None: no deadline of its own
        try:
            async with deadline:
                texts = await asyncio.gather(*rows_running)
        except TimeoutError:
            if timeout_s is None or not deadline.expired():
                raise
            raise GenerationTimedOut(timeout_s, time.monotonic() - started_s) from None
        finally:  # a row refused, or the deadline: the others' text is for nobody
            for row in rows_running:
                row.cancel()
        return {"TEXT": np.array([t.encode("utf-8") for t in texts], dtype=object)}

    async def _greedy(self, text: str, priority: str | None) -> str:
        prompt = self.tokenizer.encode(text)
        room = self.max_model_len - len(prompt)
        sampling = SamplingParams(temperature=0.0, max_tokens=max(1, min(KSERVE_MAX_TOKENS, room)))
        parts = [e.text async for e in self.engine.generate(prompt, sampling, priority)]
        return "".join(parts)

    def engine_settings(self) -> dict[str, int | str]:
        """The engine settings that stand in for a batch policy (``/config``,
        ``/policy``), by their config keys."""
        s = self.settings
        return {
            "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "block_size": s.block_size,
            "num_blocks": s.num_blocks or 0,  # resolved: never None here
            "max_model_len": self.max_model_len,
            "device": s.device,
        }

    def kernels(self) -> dict[str, str]:
        """The kernels the engine's forward pass runs (``/config``'s ``parameters``)."""
        return self.engine.kernels()

    def no_batch_policy(self) -> ConfigError:
        """What ``GET`` and ``POST .../policy`` answer for this model (a 400)."""
        named = ", ".join(f"{k}={v}" for k, v in self.engine_settings().items())
        return ConfigError(
            "policy",
            self.name,
            f"a batched model: a generation model has no batch policy; its engine schedules "
            f"by its engine settings ({named}), set in its config entry",
        )
