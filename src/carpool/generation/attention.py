"""Attention over the paged KV cache, each sequence over its own context only.

One step's chunks attend in two kinds of calls, planned once per step by
:func:`plan_attention` and run by every layer:

* decode chunks (one token) are grouped by context length; each group gathers its K/V
  blocks up to *its* longest context and runs one SDPA call with a key-padding mask::

      contexts (sorted)   40  41  44 | 300 310 | 1010
      groups              [  pad 44 ] [ pad 310] [1010]   keys read: 3*44 + 2*310 + 1010

  rather than every sequence padded to the step's longest (6 * 1010 keys here). A new
  group starts where the padding it saves outweighs the cost of one more call
  (``GROUP_COST_KEYS``), or where the group would outgrow ``MAX_GROUP_KEYS`` keys (a
  gathered group that stays near the caches attends many times faster); sequences of
  equal length share a call with no mask.
* a multi-token chunk (prefill) attends in two parts, merged by their log-sum-exp (as
  FlashAttention's split-KV and vLLM's prefix-prefill kernels do)::

      keys         [ cached prefix: 0 .. start ) [ the chunk's own: start .. end )
      queries      every query sees all of them   causal: the query at p sees up to p
      call         no mask; the heads sharing a   causal SDPA on the step's own K/V,
                   KV head folded into the query  no gather
                   length: each K/V read once

      out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse),  lse = logaddexp(lse_a, lse_b)

  One call over prefix and chunk would need an explicit [chunk, context] mask (PyTorch's
  ``is_causal`` aligns the diagonal top-left), which the CPU kernel converts and adds to
  every score and which stops it from skipping the blocks above the diagonal. A chunk
  with no cached prefix is one causal call on its own K/V. The log-sum-exp comes from
  the CPU flash-attention kernel's ATen op (``F.scaled_dot_product_attention`` does not
  return it); on another device, or where the op is missing, a chunk with a prefix runs
  the one masked call.

Where the C++ kernels are in use (``use_kernel``, :mod:`carpool.generation.paged_decode`),
every decode chunk is one :class:`KernelDecode` instead of length groups: the kernel walks
each sequence's block table and reads its K/V in place (no gather, no padding), one call for
all of them. Each multi-token chunk is then one call of the prefill kernel, which reads the
prefix and the chunk's own K/V in place alike, causally, instead of the two SDPA calls and
their merge (docs/generation.md, "Prefill attention").

K/V are gathered a whole block at a time (a block is contiguous), not slot by slot, with
``index_select`` (a row copy per block). The
query heads that share a KV head are folded into the query length (grouped-query attention
without copying K/V).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from carpool.generation.paged_decode import paged_decode, paged_prefill

# PyTorch's CPU flash-attention kernel, which also returns each query's log-sum-exp.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

# One more SDPA call per layer costs about as much as reading this many padded keys (CPU,
# one thread, head_dim 64; see docs/generation.md, "Decode attention").
GROUP_COST_KEYS = 64
# A group's gathered K/V (members x longest context) stays near the CPU's caches, where SDPA
# runs many times faster than over one big gather (docs/generation.md, "Decode attention").
MAX_GROUP_KEYS = 2048


@dataclass(frozen=True, slots=True)
class Span:
    """One multi-token chunk: rows [start, end) of the packed batch, after ``num_cached``
    positions already in the cache."""

    start: int
    end: int
    num_cached: int
    block_ids: torch.Tensor  # [ceil((num_cached + end - start) / block_size)]
    # Only where the prefix cannot be split off (see the module docstring): [q_len,
    # context_len], True where a query may look. None: the chunk attends in two parts.
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """One-token chunks of similar context length, attended in one SDPA call."""

    rows: torch.Tensor | None  # [n] their rows in the packed batch; None: every row, in order
    block_ids: torch.Tensor  # [n, ceil(max_len / block_size)]
    max_len: int  # the longest context in the group
    mask: torch.Tensor | None  # [n, 1, 1, max_len] key padding mask; None: equal lengths


@dataclass(frozen=True, slots=True)
class KernelDecode:
    """Every one-token chunk of the step, attended by the C++ kernel in place."""

    rows: torch.Tensor | None  # [n] their rows in the packed batch; None: every row, in order
    block_table: torch.Tensor  # [n, columns] each one's block ids
    context_lens: torch.Tensor  # [n] int64: each one's keys, its own token included


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    spans: tuple[Span, ...]
    groups: tuple[DecodeGroup, ...]
    kernel_decode: KernelDecode | None = None  # instead of groups, with use_kernel
    kernel_prefill: bool = False  # the spans run the prefill kernel (use_kernel)


def group_by_length(
    lengths: Sequence[int], cost_keys: int = GROUP_COST_KEYS, max_keys: int = MAX_GROUP_KEYS
) -> list[list[int]]:
    """Indices into ``lengths`` in groups of similar length, shortest first.

    Walking the lengths in ascending order, the next one joins the current group unless
    the padding it adds (every member padded up to it) exceeds ``cost_keys``, or the group
    would then hold more than ``max_keys`` keys (members x its longest length)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[list[int]] = []
    group_max = 0
    for i in order:
        length = lengths[i]
        if (
            groups
            and len(groups[-1]) * (length - group_max) <= cost_keys
            and (len(groups[-1]) + 1) * length <= max_keys
        ):
            groups[-1].append(i)
        else:
            groups.append([i])
        group_max = length
    return groups


def plan_attention(
    table: torch.Tensor,
    num_tokens: Sequence[int],
    starts: Sequence[int],
    block_size: int,
    *,
    use_kernel: bool = False,
) -> AttentionPlan:
    """The step's attention calls. ``table`` [n, columns]: each chunk's block table row;
    ``num_tokens`` and ``starts``: each chunk's token count and first position;
    ``use_kernel``: decode chunks run the C++ kernel (its build loaded) rather than
    length groups, and multi-token chunks the prefill kernel."""
    device = table.device
    can_split = use_kernel or (_FLASH_CPU is not None and device.type == "cpu")
    spans: list[Span] = []
    decode: list[int] = []  # chunk indices
    rows: list[int] = []  # and their rows in the packed batch
    row = 0
    for i, (n, start) in enumerate(zip(num_tokens, starts, strict=True)):
        if n == 1:
            decode.append(i)
            rows.append(row)
        else:
            context_len = start + n
            mask = None
            if start and not can_split:
                query = torch.arange(start, context_len, device=device)
                mask = torch.arange(context_len, device=device)[None, :] <= query[:, None]
            block_ids = table[i, : -(-context_len // block_size)]
            spans.append(Span(row, row + n, start, block_ids, mask))
        row += n
    if not decode:
        return AttentionPlan(tuple(spans), (), kernel_prefill=use_kernel)
    lengths = [starts[i] + 1 for i in decode]  # a decode chunk's context ends at its token
    if use_kernel:
        kernel = _kernel_decode(table, decode, rows, lengths)
        return AttentionPlan(tuple(spans), (), kernel, kernel_prefill=True)
    groups = group_by_length(lengths)
    is_all = len(groups) == 1 and len(decode) == len(num_tokens)
    if is_all:  # one call over every row, in step order
        groups = [list(range(len(decode)))]
    planned = []
    for members in groups:
        member_lengths = [lengths[m] for m in members]
        max_len = max(member_lengths)
        index = torch.tensor([decode[m] for m in members], dtype=torch.long, device=device)
        mask = None
        if min(member_lengths) != max_len:
            grid = torch.arange(max_len, device=device)
            length_t = torch.tensor(member_lengths, dtype=torch.long, device=device)
            mask = (grid[None, :] < length_t[:, None])[:, None, None, :]
        group_rows = torch.tensor([rows[m] for m in members], dtype=torch.long, device=device)
        block_ids = table[index, : -(-max_len // block_size)]
        planned.append(DecodeGroup(None if is_all else group_rows, block_ids, max_len, mask))
    return AttentionPlan(tuple(spans), tuple(planned))


def _kernel_decode(
    table: torch.Tensor, decode: list[int], rows: list[int], lengths: list[int]
) -> KernelDecode:
    """The decode chunks ``decode`` (chunk indices), at ``rows`` of the packed batch."""
    device = table.device
    context_lens = torch.tensor(lengths, dtype=torch.long, device=device)
    if len(decode) == table.shape[0]:  # every chunk decodes: the rows are 0 .. n-1
        return KernelDecode(None, table, context_lens)
    index = torch.tensor(decode, dtype=torch.long, device=device)
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    return KernelDecode(row_index, table[index], context_lens)


class PagedAttention:
    """One step's attention over the paged KV cache; called by each layer with its index."""

    def __init__(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, plan: AttentionPlan):
        self.kv_cache = kv_cache
        self.slot_mapping = slot_mapping
        self.plan = plan

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [T, heads, D], k and v [T, kv_heads, D] -> attention output [T, heads, D]."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_blocks, v_blocks = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        k_blocks.view(-1, num_kv_heads, head_dim).index_copy_(0, self.slot_mapping, k)
        v_blocks.view(-1, num_kv_heads, head_dim).index_copy_(0, self.slot_mapping, v)
        groups, spans, kernel = self.plan.groups, self.plan.spans, self.plan.kernel_decode
        if len(groups) == 1 and groups[0].rows is None:
            return _attend_decode(groups[0], q, k_blocks, v_blocks)
        if kernel is not None and kernel.rows is None:
            return _attend_kernel(kernel, q, k_blocks, v_blocks)
        out = torch.empty_like(q)
        if kernel is not None:
            assert kernel.rows is not None
            out.index_copy_(
                0, kernel.rows, _attend_kernel(kernel, q[kernel.rows], k_blocks, v_blocks)
            )
        for group in groups:
            assert group.rows is not None
            context = _attend_decode(group, q[group.rows], k_blocks, v_blocks)
            out.index_copy_(0, group.rows, context)
        for span in spans:
            rows = slice(span.start, span.end)
            if self.plan.kernel_prefill:
                scale = head_dim**-0.5  # SDPA's default, as the other paths use
                out[rows] = paged_prefill(
                    q[rows], k_blocks, v_blocks, span.block_ids, span.num_cached, scale
                )
                continue
            if span.mask is not None:
                out[rows] = _attend_masked(span, q[rows], k_blocks, v_blocks)
                continue
            own = _heads_first(q[rows]), _heads_first(k[rows]), _heads_first(v[rows])
            if not span.num_cached:
                context = F.scaled_dot_product_attention(*own, is_causal=True, enable_gqa=True)
                out[rows] = context[0].transpose(0, 1)
                continue
            num_blocks = -(-span.num_cached // k_blocks.shape[1])
            prefix_ids = span.block_ids[:num_blocks]
            past = [
                _gather(blocks, prefix_ids).view(-1, num_kv_heads, head_dim)[: span.num_cached]
                for blocks in (k_blocks, v_blocks)
            ]
            out[rows] = _attend_prefix_and_own(q[rows], own[1], own[2], past[0], past[1])
        return out


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, D] -> [1, heads, tokens, D] (a view)."""
    return x.transpose(0, 1)[None]


def _attend_prefix_and_own(
    query: torch.Tensor,
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
) -> torch.Tensor:
    """A chunk's ``query`` [n, heads, D] over its cached prefix ``past_k``/``past_v`` [P,
    kv_heads, D] and, causally, over its own ``own_k``/``own_v`` [1, kv_heads, n, D]; the two
    parts merged by their log-sum-exp (the module docstring) -> [n, heads, D]."""
    assert _FLASH_CPU is not None, "plan_attention splits a prefix off only where it exists"
    n, num_heads, head_dim = query.shape
    num_kv_heads = own_k.shape[1]
    group = num_heads // num_kv_heads
    # Its own tokens: causal, each KV head repeated for its query heads (n rows only).
    own, own_lse = _FLASH_CPU(
        _heads_first(query),
        own_k.repeat_interleave(group, dim=1),
        own_v.repeat_interleave(group, dim=1),
        is_causal=True,
    )
    # The prefix: no mask, so the query heads sharing a KV head fold into the query length.
    folded = query.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    past, past_lse = _FLASH_CPU(
        folded.reshape(1, num_kv_heads, group * n, head_dim),
        _heads_first(past_k),
        _heads_first(past_v),
    )
    past = past.reshape(1, num_heads, n, head_dim)
    past_lse = past_lse.reshape(1, num_heads, n)
    lse = torch.logaddexp(own_lse, past_lse)
    context = (own_lse - lse).exp()[..., None] * own + (past_lse - lse).exp()[..., None] * past
    merged: torch.Tensor = context[0].transpose(0, 1).to(query.dtype)
    return merged


def _attend_masked(
    span: Span, query: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor
) -> torch.Tensor:
    """A chunk over its whole context in one SDPA call with ``span.mask``: [n, heads, D]."""
    num_kv_heads, head_dim = k_blocks.shape[2], k_blocks.shape[3]
    length = span.num_cached + query.shape[0]
    keys = _gather(k_blocks, span.block_ids).view(-1, num_kv_heads, head_dim)[:length]
    values = _gather(v_blocks, span.block_ids).view(-1, num_kv_heads, head_dim)[:length]
    context = F.scaled_dot_product_attention(
        _heads_first(query),
        _heads_first(keys),
        _heads_first(values),
        attn_mask=span.mask,
        enable_gqa=True,
    )
    return context[0].transpose(0, 1)


def _attend_decode(
    group: DecodeGroup, query: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor
) -> torch.Tensor:
    """``query`` [n, heads, D] (the group's rows); ``k_blocks``/``v_blocks``: one layer's
    cache [num_blocks, block_size, kv_heads, D] -> [n, heads, D]."""
    n, num_heads, head_dim = query.shape
    num_kv_heads = k_blocks.shape[2]
    # The heads sharing a KV head are adjacent: fold them into the query length.
    folded = query.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    length = group.max_len
    keys = _gather(k_blocks, group.block_ids).view(n, -1, num_kv_heads, head_dim)[:, :length]
    values = _gather(v_blocks, group.block_ids).view(n, -1, num_kv_heads, head_dim)[:, :length]
    context = F.scaled_dot_product_attention(
        folded, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.mask
    )
    return context.reshape(n, num_heads, head_dim)


def _attend_kernel(
    decode: KernelDecode, query: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor
) -> torch.Tensor:
    """``query`` [n, heads, D] (the decode rows) over their contexts, read in place by the
    C++ kernel -> [n, heads, D]."""
    scale = query.shape[-1] ** -0.5  # SDPA's default, as the gather path uses
    return paged_decode(query, k_blocks, v_blocks, decode.block_table, decode.context_lens, scale)


def _gather(blocks: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Whole blocks, copied row by row: ``index_select`` on the blocks viewed as rows copies
    a block at a time, where advanced indexing copies element by element (slower on the CPU,
    see docs/generation.md)."""
    return blocks.view(blocks.shape[0], -1).index_select(0, block_ids.reshape(-1))
