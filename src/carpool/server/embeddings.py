"""A text-embedding model served two ways: OpenAI's ``/v1/embeddings`` and KServe v2.

Every text is its own request to the batcher, so texts of one call spread over batches
and texts of many calls share them. Texts are tokenized off the event loop; the token
arrays reach the model packed (no padding, ``collate="packed"``)::

    "a cat" ─tokenize─▶ [101 1037 4937 102] ─submit─▶ batcher ─Packed─▶ encoder ─▶ row

KServe face (:meth:`ServedModel.of_embeddings`): input ``TEXT`` (BYTES, one UTF-8 text
per row), output ``EMBEDDING`` (FP32, ``dimensions`` per row).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from carpool.core.batcher import Batcher
from carpool.core.buffer_pool import DEFAULT_BUFFER_POOL_MB
from carpool.core.layout import Packed
from carpool.core.policy import BatchPolicy
from carpool.errors import ConfigError, InvalidInput

logger = logging.getLogger(__name__)

DEFAULT_MAX_INPUTS = 2048  # texts per call, as OpenAI's API allows

# The tokenizers library's own thread pool spins on the cores the model computes on; in a
# server, tokenization is one short text per request, off the loop on a plain thread
# (measured: served/offline tokens/s 0.80 with it, 0.86 without, one core).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True, slots=True)
class Embedded:
    """One call's embeddings [n, dimensions] and the tokens they took."""

    vectors: np.ndarray
    num_tokens: int


class EmbeddingService:
    """Tokenizes, submits one request per text, gathers the rows.

    The encoder loaded here (on the CPU) validates the folder before serving starts,
    tokenizes, and is the first CPU replica's model; other replicas load their own.

    The encoder runs on its replica's thread even on one CPU (``DEFAULT_EXECUTOR``): texts
    are tokenized on worker threads whose results the event loop must take in while a
    batch computes, and a batch of 4096 tokens computes for about half a second. On the
    loop's thread it held them up: p99 4930 ms instead of 2170 ms at c=128 on one core.
    """

    DEFAULT_EXECUTOR = "thread"

    def __init__(
        self,
        name: str,
        folder: str | Path,
        policy: BatchPolicy,
        *,
        devices: list[str] | None = None,
        dtype: str = "float32",
        quantization: str | None = None,
        max_inputs: int = DEFAULT_MAX_INPUTS,
        executor: str = DEFAULT_EXECUTOR,
        buffer_pool: bool = True,
        buffer_pool_mb: float = DEFAULT_BUFFER_POOL_MB,
    ) -> None:
        from carpool.models.embeddings import TextEncoder

        self.name = name
        self.folder = Path(folder)
        self.dtype = dtype
        self.quantization = quantization
        self.max_inputs = max_inputs
        self._encoder_cls = TextEncoder
        self.encoder = TextEncoder.from_folder(self.folder, dtype=dtype, quantization=quantization)
        logger.debug("%s: Linear layers run %s", name, self.encoder.linear_kernel)
        self._shared_taken = False
        self.batcher = Batcher(
            fn_factory=self._replica,
            policy=policy,
            name=name,
            devices=devices or ["cpu"],
            collate="packed",
            executor=executor,
            policy_check=self._check_policy,  # at startup and on every policy update
            buffer_pool=buffer_pool,
            buffer_pool_mb=buffer_pool_mb,
        )

    def _check_policy(self, policy: BatchPolicy) -> None:
        budget = policy.max_batch_tokens
        if budget is not None and budget < self.encoder.max_length:
            raise ConfigError(  # else a long text could never join a batch
                "max_batch_tokens",
                budget,
                f"at least {self.encoder.max_length} (the most tokens one text of "
                f"{self.name!r} takes)",
            )

    @property
    def dimensions(self) -> int:
        return int(self.encoder.dimensions)

    @property
    def max_length(self) -> int:
        return int(self.encoder.max_length)

    def _replica(self, device: str) -> Any:
        encoder = self.encoder
        if device != "cpu" or self._shared_taken:
            encoder = self._encoder_cls.from_folder(
                self.folder, device=device, dtype=self.dtype, quantization=self.quantization
            )
        self._shared_taken = True

        def embed(batch: Packed) -> np.ndarray:
            return encoder.embed_packed(batch.data, batch.lengths)

        return embed

    async def embed_texts(self, texts: Sequence[str], **options: Any) -> Embedded:
        """Embeddings of ``texts`` (each truncated to ``max_length`` tokens)."""
        self._check_count(len(texts), options.get("priority"))
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(None, self.encoder.tokenize, list(texts))
        return await self._run(ids, options)

    async def embed_tokens(self, token_lists: Sequence[Any], **options: Any) -> Embedded:
        """Embeddings of texts given as token ids (used as given, special tokens included)."""
        self._check_count(len(token_lists), options.get("priority"))
        ids = []
        for i, tokens in enumerate(token_lists):
            try:
                ids.append(self.encoder.check_token_ids(np.asarray(tokens)))
            except InvalidInput as error:
                raise InvalidInput(f"input[{i}]: {error}") from None
        return await self._run(ids, options)

    def _check_count(self, count: int, priority: Any) -> None:
        if count == 0:
            raise InvalidInput("input is empty: expected at least one text")
        if count > self.max_inputs:
            raise InvalidInput(
                f"input holds {count} texts, more than this model's limit of {self.max_inputs} "
                "per request; split it into several requests"
            )
        # Each text is its own queued request: past a queue bound the call could never be
        # admitted, and QueueFull (429, retry later) would have clients retry it for ever.
        bound = self.batcher.policy.max_queued(priority if isinstance(priority, str) else None)
        if bound is not None and count > bound:
            raise InvalidInput(
                f"input holds {count} texts, more than the {bound} this model's queue holds "
                "(max_queue_size; each text waits as one request); split it into several "
                "requests"
            )

    async def _run(self, ids: list[np.ndarray], options: dict[str, Any]) -> Embedded:
        submit = self.batcher.submit
        tasks = [asyncio.ensure_future(submit(one, **options)) for one in ids]
        try:
            rows = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()  # the call failed as a whole: drop its texts still queued
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return Embedded(np.stack(rows), sum(len(a) for a in ids))

    async def infer(self, payload: dict[str, np.ndarray], options: dict[str, Any]) -> Any:
        """The KServe face: ``TEXT`` (BYTES rows) in, ``EMBEDDING`` out."""
        texts = []
        for i, value in enumerate(payload["TEXT"].reshape(-1)):
            try:
                texts.append(value.decode("utf-8") if isinstance(value, bytes) else str(value))
            except UnicodeDecodeError as error:
                raise InvalidInput(
                    f"input 'TEXT' row {i} is not valid UTF-8 ({error.reason} at byte "
                    f"{error.start}); expected UTF-8 text"
                ) from None
        embedded = await self.embed_texts(texts, **options)
        return {"EMBEDDING": embedded.vectors}
