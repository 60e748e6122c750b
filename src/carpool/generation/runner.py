"""The model runner: owns the paged KV cache and runs one engine step on a packed batch.

One step packs every chunk's tokens into one [T] batch; embeddings, Linear layers and MLPs
run on the [T, hidden] matrix. Attention is the only place that knows the sequences::

    chunks      seq 7: prefill 3 tokens from 0    seq 9: decode 1 token at 5
    input_ids   [ a a a | b ]                      [T] int64
    positions   [ 0 1 2 | 5 ]                      start_pos + offset in the chunk
    slot        block_table[p // block_size] * block_size + p % block_size

    kv_cache    [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]
                viewed per layer as [num_blocks * block_size, kv_heads, head_dim] slots

Each layer first writes the step's new K/V into their slots (one ``index_copy_`` for all T
tokens), then attends over each sequence's cached K/V ``[0, start_pos + len)`` gathered
through its block table. Decode chunks (one token) are attended together in one SDPA call
over a [n, L_max] gather with a key-padding mask, their query heads folded per KV head
(grouped-query attention without copying K/V); longer chunks loop, one SDPA call each,
causal on their own tokens. Logits are computed only at the last token of each chunk that
``needs_logits``.
"""

from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from carpool.generation.sampling import Sampler
from carpool.generation.types import SeqChunk, StepInput, StepOutput
from carpool.models import onednn

logger = logging.getLogger(__name__)


class FastLinear(nn.Linear):
    """``nn.Linear`` with an optional oneDNN fast path (weights reordered once by ``prepack``;
    see :mod:`carpool.models.onednn` for where it applies)."""

    packed: torch.Tensor | None = None

    def prepack(self) -> None:
        self.packed = onednn.reorder_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
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

    def prepack(self, enabled: bool = True) -> bool:
        """Switches every ``FastLinear`` to oneDNN's prepacked kernel where this CPU and dtype
        support it (see :mod:`carpool.models.onednn`); returns whether it did
        (``enabled=False`` drops any prepacked weights). Call again
        after a move to another device or dtype."""
        linears = [m for m in self.modules() if isinstance(m, FastLinear)]
        weight = linears[0].weight if linears else None
        usable = enabled and weight is not None and onednn.can_prepack(weight.dtype, weight.device)
        for linear in linears:
            if usable:
                linear.prepack()
            else:
                linear.packed = None
        logger.debug("%s Linear layers: %s", type(self).__name__, onednn.kernel_name(usable))
        return usable


@dataclass(frozen=True, slots=True)
class _Span:
    """One multi-token chunk: its rows [start, end) of the packed batch and its context."""

    start: int
    end: int
    context_slots: torch.Tensor  # [L] cache slots of positions 0 .. L-1
    mask: torch.Tensor | None  # [q_len, L] True where a query may look; None: plain causal


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    """All one-token chunks, attended in one SDPA call."""

    rows: torch.Tensor | None  # [n] their rows in the packed batch; None: every row
    block_ids: torch.Tensor  # [n, ceil(L_max / block_size)] (padding points at a valid block)
    max_len: int  # L_max: the longest context among them
    mask: torch.Tensor | None  # [n, 1, 1, L_max] key padding mask; None: equal lengths


class PagedAttention:
    """One step's attention over the paged KV cache; called by each layer with its index."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        spans: list[_Span],
        decode: _DecodeGroup | None,
    ) -> None:
        self.kv_cache = kv_cache
        self.slot_mapping = slot_mapping
        self.spans = spans
        self.decode = decode

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [T, heads, D], k and v [T, kv_heads, D] -> attention output [T, heads, D]."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache = self.kv_cache[layer, 0].view(-1, num_kv_heads, head_dim)
        v_cache = self.kv_cache[layer, 1].view(-1, num_kv_heads, head_dim)
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        k_blocks, v_blocks = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        if self.decode is not None and self.decode.rows is None and not self.spans:
            return self._attend_decode(self.decode, q, k_blocks, v_blocks)
        out = torch.empty_like(q)
        if self.decode is not None:
            assert self.decode.rows is not None
            out.index_copy_(
                0, self.decode.rows, self._attend_decode(self.decode, q, k_blocks, v_blocks)
            )
        for span in self.spans:
            keys = k_cache[span.context_slots].transpose(0, 1)[None]  # [1, kv_heads, L, D]
            values = v_cache[span.context_slots].transpose(0, 1)[None]
            query = q[span.start : span.end].transpose(0, 1)[None]  # [1, heads, q_len, D]
            context = F.scaled_dot_product_attention(
                query,
                keys,
                values,
                attn_mask=span.mask,
                is_causal=span.mask is None,
                enable_gqa=True,
            )
            out[span.start : span.end] = context[0].transpose(0, 1)
        return out

    @staticmethod
    def _attend_decode(
        group: _DecodeGroup, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor
    ) -> torch.Tensor:
        """``k_blocks``/``v_blocks``: one layer's cache [num_blocks, block_size, kv_heads, D].

        K/V are gathered a whole block at a time (a block is contiguous), not slot by slot:
        per-slot gathering was half of a 32-sequence decode step on the CPU."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_blocks.shape[2]
        query = q if group.rows is None else q[group.rows]  # [n, heads, D]
        n = query.shape[0]
        # The heads sharing a KV head are adjacent: fold them into the query length.
        query = query.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        length = group.max_len
        keys = k_blocks[group.block_ids].view(n, -1, num_kv_heads, head_dim)[:, :length]
        values = v_blocks[group.block_ids].view(n, -1, num_kv_heads, head_dim)[:, :length]
        context = F.scaled_dot_product_attention(
            query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.mask
        )
        return context.reshape(n, num_heads, head_dim)


@dataclass(frozen=True, slots=True)
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    logit_rows: torch.Tensor
    attention: PagedAttention


class ModelRunner:
    """Runs a ``PagedDecoder`` on engine steps over a KV cache it owns.

    ``ModelRunner(model, num_blocks, block_size, device, dtype)`` moves the model to
    ``device``/``dtype`` (eval mode), allocates ``kv_cache`` (zeros, see the module
    docstring) and, with ``prepack=True``, switches its Linear layers to oneDNN's prepacked
    kernels where they apply. ``seed`` seeds the generator shared by requests without a seed.
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
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.is_prepacked = self.model.prepack(enabled=prepack)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache = torch.zeros(
            (model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim),
            device=self.device,
            dtype=dtype,
        )
        self.sampler = Sampler(seed)

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
        return self._forward(self._prepare(step.chunks))

    def execute(self, step: StepInput) -> StepOutput:
        """Runs one step and samples one token per chunk that ``needs_logits`` (else None).
        ``model_time_s`` is the model's share: forward and logits, not the batch set-up
        or sampling."""
        self.sampler.forget(step.finished_seq_ids)
        if not step.chunks:
            return StepOutput(sampled=())
        batch = self._prepare(step.chunks)
        started = time.perf_counter()
        logits = self._forward(batch)
        model_time_s = time.perf_counter() - started
        chosen = [c for c in step.chunks if c.needs_logits]
        picked, picked_logprobs = self.sampler.sample_chunks(logits, chosen)
        tokens, logprobs = iter(picked), iter(picked_logprobs)
        sampled = tuple(next(tokens) if c.needs_logits else None for c in step.chunks)
        if not any(picked_logprobs):
            return StepOutput(sampled=sampled, model_time_s=model_time_s)
        found = tuple(next(logprobs) if c.needs_logits else None for c in step.chunks)
        return StepOutput(sampled=sampled, model_time_s=model_time_s, logprobs=found)

    @torch.inference_mode()
    def _forward(self, batch: _Batch) -> torch.Tensor:
        hidden = self.model(batch.input_ids, batch.positions, batch.attention)
        return self.model.compute_logits(hidden[batch.logit_rows]).float()

    def _prepare(self, chunks: tuple[SeqChunk, ...]) -> _Batch:
        bs = self.block_size
        ids: list[int] = []
        lengths: list[int] = []
        starts: list[int] = []
        logit_rows: list[int] = []
        num_blocks = max(len(c.block_table) for c in chunks)
        tables: list[tuple[int, ...]] = []
        for chunk in chunks:
            n = len(chunk.token_ids)
            if n == 0 or (chunk.start_pos + n + bs - 1) // bs > len(chunk.block_table):
                raise ValueError(
                    f"seq {chunk.seq_id}: {n} tokens from position {chunk.start_pos} need "
                    f"{(chunk.start_pos + n + bs - 1) // bs} blocks of {bs}, "
                    f"block_table has {len(chunk.block_table)}"
                )
            ids.extend(chunk.token_ids)
            lengths.append(n)
            starts.append(chunk.start_pos)
            if chunk.needs_logits:
                logit_rows.append(len(ids) - 1)
            pad = num_blocks - len(chunk.block_table)
            tables.append(chunk.block_table + (0,) * pad if pad else chunk.block_table)
        device = self.device
        table = torch.tensor(tables, dtype=torch.long, device=device)  # [n, max_blocks]
        meta = torch.tensor([lengths, starts], dtype=torch.long, device=device)
        num_tokens = len(ids)
        if num_tokens == len(chunks):  # every chunk decodes one token
            positions = meta[1]
            seq_index = None
        else:
            seq_index = torch.repeat_interleave(
                torch.arange(len(chunks), device=device), meta[0], output_size=num_tokens
            )
            first_row = torch.cumsum(meta[0], 0) - meta[0]
            positions = torch.arange(num_tokens, device=device) + (meta[1] - first_row)[seq_index]
        rows = table if seq_index is None else table[seq_index]
        slot_mapping = rows.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        spans, decode = self._plan_attention(chunks, table, meta)
        return _Batch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=positions,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
            attention=PagedAttention(self.kv_cache, slot_mapping, spans, decode),
        )

    def _plan_attention(
        self, chunks: tuple[SeqChunk, ...], table: torch.Tensor, meta: torch.Tensor
    ) -> tuple[list[_Span], _DecodeGroup | None]:
        bs, device = self.block_size, self.device
        spans: list[_Span] = []
        decode_index: list[int] = []
        decode_rows: list[int] = []
        row = 0
        for i, chunk in enumerate(chunks):
            n = len(chunk.token_ids)
            if n == 1:
                decode_index.append(i)
                decode_rows.append(row)
            else:
                context = torch.arange(chunk.start_pos + n, device=device)
                slots = table[i, context // bs] * bs + context % bs
                mask = None
                if chunk.start_pos:
                    query = torch.arange(chunk.start_pos, chunk.start_pos + n, device=device)
                    mask = context[None, :] <= query[:, None]
                spans.append(_Span(row, row + n, slots, mask))
            row += n
        if not decode_index:
            return spans, None
        lengths = meta[1] + 1  # a decode chunk's context ends at its own token
        max_len = max(chunks[i].start_pos for i in decode_index) + 1
        grid = torch.arange(max_len, device=device)
        all_decode = len(decode_index) == len(chunks)
        if not all_decode:
            index = torch.tensor(decode_index, dtype=torch.long, device=device)
            table, lengths = table[index], lengths[index]
        block_ids = table[:, : -(-max_len // bs)]
        mask = None
        if any(chunks[i].start_pos + 1 != max_len for i in decode_index):
            mask = (grid[None, :] < lengths[:, None])[:, None, None, :]
        rows = None if all_decode else torch.tensor(decode_rows, dtype=torch.long, device=device)
        return spans, _DecodeGroup(rows, block_ids, max_len, mask)
