"""The model runner: owns the paged KV cache and runs one engine step on a packed batch.

One step packs every chunk's tokens into one [T] batch; embeddings, Linear layers and MLPs
run on the [T, hidden] matrix. Attention is the only place that knows the sequences::

    chunks      seq 7: prefill 3 tokens from 0    seq 9: decode 1 token at 5
    input_ids   [ a a a | b ]                      [T] int64
    positions   [ 0 1 2 | 5 ]                      start_pos + offset in the chunk
    slot        block_table[p // block_size] * block_size + p % block_size

    kv_cache    [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]
                viewed per layer as [num_blocks * block_size, kv_heads, head_dim] slots

The block tables live in the runner (``block_table.BlockTables``: one row per running
sequence, updated with each step's new blocks); positions and the slot mapping are tensor
ops over the step's rows. Each layer first writes the step's new K/V into their slots (one
``index_copy_`` for all T tokens), then attends over each sequence's own cached K/V
``[0, start_pos + len)``, read through its block table (``attention.py``: decode chunks
by the C++ kernel in place, or grouped by context length, one SDPA call per group; a
longer chunk over its cached prefix and, causally, itself, merged by log-sum-exp). Logits
are computed only at the last token of each chunk that ``needs_logits``.
"""

from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from carpool.generation import huge_pages
from carpool.generation.attention import PagedAttention, plan_attention
from carpool.generation.block_table import BlockTables
from carpool.generation.paged_decode import (
    FUSED_OPS,
    PACKED_LINEAR,
    UNFUSED_OPS,
    use_decode_kernel,
    use_fused_ops,
    use_linear_kernel,
)
from carpool.generation.prompt_logprobs import PromptScorer, num_scored_rows
from carpool.generation.sampling import Sampler
from carpool.generation.types import SeqChunk, StepInput, StepOutput, TokenLogprobs
from carpool.models import onednn

logger = logging.getLogger(__name__)


class FastLinear(nn.Linear):
    """``nn.Linear`` on weights packed once by ``prepack``: into carpool's panels
    (``carpool-packed``, float32 on the CPU: ``csrc/packed_linear.cpp``) or oneDNN's
    layout (``onednn-prepacked``, see :mod:`carpool.models.onednn` for where it applies);
    plain ``F.linear`` when neither was packed."""

    packed: torch.Tensor | None = None
    kernel: str = onednn.kernel_name(False)

    def prepack(self, kernel: str) -> None:
        """Pack the weight for ``kernel`` (``PACKED_LINEAR`` or oneDNN's)."""
        if kernel == PACKED_LINEAR:
            # on huge pages where Linux has them: every decode step streams it whole
            self.packed = huge_pages.copy_of(torch.ops.carpool.pack_linear(self.weight.detach()))
        else:
            self.packed = onednn.reorder_weight(self.weight)
        self.kernel = kernel

    def unpack(self) -> None:
        self.packed = None
        self.kernel = onednn.kernel_name(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.kernel == PACKED_LINEAR:
            flat = x.reshape(-1, x.shape[-1])
            y: torch.Tensor = torch.ops.carpool.packed_linear(
                flat, self.packed, self.bias, self.out_features
            )
            return y.view(*x.shape[:-1], self.out_features)
        return onednn.linear(x, self.packed, self.bias)


class PagedDecoder(nn.Module, abc.ABC):
    """A decoder-only model that reads and writes K/V through ``PagedAttention``; Llama and
    GPT-2 implement the two abstract methods."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @abc.abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: PagedAttention
    ) -> torch.Tensor:
        """``input_ids`` and ``positions`` [T] -> last hidden states [T, hidden]."""

    @abc.abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on some rows of the last hidden states: [n, hidden] -> [n, V]."""

    def fuse(self, enabled: bool) -> bool:
        """Runs the elementwise steps on the extension's fused ops (``FUSED_OPS``) where
        ``enabled`` and the model has such a path; returns whether it does. A model
        without one keeps its torch ops (the default)."""
        return False

    def prepack(self, enabled: bool = True) -> str:
        """Packs every ``FastLinear``'s weight once for the fastest kernel this CPU, build
        and dtype have: carpool's packed kernel (float32 on the CPU, where the extension
        builds), else oneDNN's prepacked one (see :mod:`carpool.models.onednn`), else none.
        Returns the kernel's name (``enabled=False`` drops any packed weights: plain
        ``F.linear``). Call again after a move to another device or dtype."""
        linears = [m for m in self.modules() if isinstance(m, FastLinear)]
        weight = linears[0].weight if linears else None
        kernel = onednn.kernel_name(False)
        if enabled and weight is not None:
            if use_linear_kernel(weight.device, weight.dtype):
                kernel = PACKED_LINEAR
            elif onednn.can_prepack(weight.dtype, weight.device):
                kernel = onednn.kernel_name(True)
        for linear in linears:
            if kernel == onednn.kernel_name(False):
                linear.unpack()
            else:
                linear.prepack(kernel)
        logger.debug("%s Linear layers: %s", type(self).__name__, kernel)
        return kernel


@dataclass(frozen=True, slots=True)
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    logit_rows: torch.Tensor
    attention: PagedAttention
    prompt_rows: torch.Tensor | None = None  # rows scoring prompt tokens (prompt_logprobs)


class ModelRunner:
    """Runs a ``PagedDecoder`` on engine steps over a KV cache it owns.

    ``ModelRunner(model, num_blocks, block_size, device, dtype)`` moves the model to
    ``device``/``dtype`` (eval mode), allocates ``kv_cache`` (zeros, see the module
    docstring) and, with ``prepack=True``, packs its Linear layers' weights once for the
    fastest kernel that applies (``PagedDecoder.prepack``; ``linear_path`` names it) and
    runs its elementwise steps on the fused ops where they apply (``PagedDecoder.fuse``;
    ``elementwise_path``: ``carpool-fused`` or ``torch``; ``prepack=False``: torch).
    ``seed`` seeds the generator shared by requests without a seed.
    ``decode_attention`` (``auto | kernel | torch``) picks the decode attention path
    (:func:`carpool.generation.paged_decode.use_decode_kernel`); ``decode_attention_path``
    says which one runs: ``kernel`` or ``torch``.
    """

    def __init__(
        self,
        model: PagedDecoder,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        prepack: bool = True,
        seed: int | None = None,
        decode_attention: str = "auto",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.linear_path = self.model.prepack(enabled=prepack)  # how its Linears run
        fused = self.model.fuse(prepack and use_fused_ops(self.device, dtype))
        self.elementwise_path = FUSED_OPS if fused else UNFUSED_OPS  # norms, rotary, SwiGLU
        self.is_prepacked = self.linear_path != onednn.kernel_name(False)
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        if self.device.type == "cpu":  # on huge pages where Linux has them (huge_pages.py)
            self.kv_cache, self.huge_pages = huge_pages.placed_zeros(shape, dtype)
        else:
            self.kv_cache = torch.zeros(shape, device=self.device, dtype=dtype)
            self.huge_pages = f"off: {self.device.type} memory"
        self.use_decode_kernel = use_decode_kernel(decode_attention, self.device, dtype)
        self.decode_attention_path = "kernel" if self.use_decode_kernel else "torch"
        self.sampler = Sampler(seed)
        self.block_tables = BlockTables(self.device)
        self.prompt_scorer = PromptScorer()

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes one token takes over all layers (K and V)."""
        return int(self.kv_cache[:, :, 0, 0].numel() * self.kv_cache.element_size())

    @staticmethod
    def bytes_per_token_of(model: PagedDecoder, dtype: torch.dtype) -> int:
        """``bytes_per_token`` before a runner exists: size the pool from a memory budget."""
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * model.num_layers * model.num_kv_heads * model.head_dim * item

    def compute_logits(self, step: StepInput) -> torch.Tensor:
        """Runs the model on ``step``; float32 logits [n, V] at the last token of each chunk
        that ``needs_logits``, in chunk order. Writes the step's K/V into the cache."""
        return self._forward(self._prepare(step.chunks))[0]

    def execute(self, step: StepInput) -> StepOutput:
        """Runs one step and samples one token per chunk that ``needs_logits`` (else None).
        ``model_time_s`` is the model's share: forward and logits, not the batch set-up
        or sampling."""
        self.sampler.forget(step.finished_seq_ids)
        self.block_tables.forget(step.finished_seq_ids)
        self.prompt_scorer.forget(step.finished_seq_ids)
        if not step.chunks:
            return StepOutput(sampled=())
        batch = self._prepare(step.chunks)
        started = time.perf_counter()
        logits, prompt_logits = self._forward(batch)
        if self.device.type == "cuda":  # the kernels launched, not done: wait for them
            torch.cuda.synchronize(self.device)
        model_time_s = time.perf_counter() - started
        prompt_found: tuple[tuple[TokenLogprobs, ...], ...] = ()
        if batch.prompt_rows is not None:
            prompt_found = self.prompt_scorer.score(step.chunks, prompt_logits)
        chosen = [c for c in step.chunks if c.needs_logits]
        picked, picked_logprobs = self.sampler.sample_chunks(logits, chosen)
        tokens, logprobs = iter(picked), iter(picked_logprobs)
        sampled = tuple(next(tokens) if c.needs_logits else None for c in step.chunks)
        found: tuple[TokenLogprobs | None, ...] = ()
        if any(picked_logprobs):
            found = tuple(next(logprobs) if c.needs_logits else None for c in step.chunks)
        return StepOutput(sampled, model_time_s, found, prompt_found)

    @torch.inference_mode()
    def _forward(self, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 logits at ``logit_rows``, and at ``prompt_rows`` (None without)."""
        hidden = self.model(batch.input_ids, batch.positions, batch.attention)
        logits = self.model.compute_logits(hidden[batch.logit_rows]).float()
        if batch.prompt_rows is None:
            return logits, None
        return logits, self.model.compute_logits(hidden[batch.prompt_rows]).float()

    def _prepare(self, chunks: tuple[SeqChunk, ...]) -> _Batch:
        bs = self.block_size
        ids: list[int] = []
        num_tokens: list[int] = []
        starts: list[int] = []
        logit_rows: list[int] = []
        prompt_rows: list[int] = []
        for chunk in chunks:
            n = len(chunk.token_ids)
            if n == 0 or (chunk.start_pos + n + bs - 1) // bs > len(chunk.block_table):
                raise ValueError(
                    f"seq {chunk.seq_id}: {n} tokens from position {chunk.start_pos} need "
                    f"{(chunk.start_pos + n + bs - 1) // bs} blocks of {bs}, "
                    f"block_table has {len(chunk.block_table)}"
                )
            prompt_rows.extend(range(len(ids), len(ids) + num_scored_rows(chunk)))
            ids.extend(chunk.token_ids)
            num_tokens.append(n)
            starts.append(chunk.start_pos)
            if chunk.needs_logits:
                logit_rows.append(len(ids) - 1)
        device = self.device
        rows = self.block_tables.update([c.seq_id for c in chunks], [c.block_table for c in chunks])
        table = self.block_tables.table[rows]  # [n, columns]
        meta = torch.tensor([num_tokens, starts], dtype=torch.long, device=device)
        total = len(ids)
        if total == len(chunks):  # every chunk decodes one token
            positions = meta[1]
            token_table = table
        else:
            seq_index = torch.repeat_interleave(
                torch.arange(len(chunks), device=device), meta[0], output_size=total
            )
            first_row = torch.cumsum(meta[0], 0) - meta[0]
            positions = torch.arange(total, device=device) + (meta[1] - first_row)[seq_index]
            token_table = table[seq_index]
        block = token_table.gather(1, (positions // bs)[:, None])[:, 0]
        slot_mapping = block * bs + positions % bs
        plan = plan_attention(table, num_tokens, starts, bs, use_kernel=self.use_decode_kernel)
        return _Batch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=positions,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
            attention=PagedAttention(self.kv_cache, slot_mapping, plan),
            prompt_rows=(
                torch.tensor(prompt_rows, dtype=torch.long, device=device)
                if any(c.sampling.prompt_logprobs is not None for c in chunks)
                else None
            ),
        )
