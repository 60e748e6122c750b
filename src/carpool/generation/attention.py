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
* multi-token chunks (prefill, or a chunk of one) gather their own blocks and run one SDPA
  call each, causal on their own tokens.

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

# One more SDPA call per layer costs about as much as reading this many padded keys (CPU,
# one thread, head_dim 64; see docs/generation.md, "Decode attention").
GROUP_COST_KEYS = 64
# A group's gathered K/V (members x longest context) stays near the CPU's caches, where SDPA
# runs many times faster than over one big gather (docs/generation.md, "Decode attention").
MAX_GROUP_KEYS = 2048


@dataclass(frozen=True, slots=True)
class Span:
    """One multi-token chunk: rows [start, end) of the packed batch and its context."""

    start: int
    end: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)]
    context_len: int
    mask: torch.Tensor | None  # [q_len, context_len] True where a query may look; None: causal


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """One-token chunks of similar context length, attended in one SDPA call."""

    rows: torch.Tensor | None  # [n] their rows in the packed batch; None: every row, in order
    block_ids: torch.Tensor  # [n, ceil(max_len / block_size)]
    max_len: int  # the longest context in the group
    mask: torch.Tensor | None  # [n, 1, 1, max_len] key padding mask; None: equal lengths


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    spans: tuple[Span, ...]
    groups: tuple[DecodeGroup, ...]


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
    table: torch.Tensor, num_tokens: Sequence[int], starts: Sequence[int], block_size: int
) -> AttentionPlan:
    """The step's attention calls. ``table`` [n, columns]: each chunk's block table row;
    ``num_tokens`` and ``starts``: each chunk's token count and first position."""
    device = table.device
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
            if start:
                query = torch.arange(start, context_len, device=device)
                mask = torch.arange(context_len, device=device)[None, :] <= query[:, None]
            block_ids = table[i, : -(-context_len // block_size)]
            spans.append(Span(row, row + n, block_ids, context_len, mask))
        row += n
    if not decode:
        return AttentionPlan(tuple(spans), ())
    lengths = [starts[i] + 1 for i in decode]  # a decode chunk's context ends at its token
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
        groups, spans = self.plan.groups, self.plan.spans
        if len(groups) == 1 and groups[0].rows is None:
            return _attend_decode(groups[0], q, k_blocks, v_blocks)
        out = torch.empty_like(q)
        for group in groups:
            assert group.rows is not None
            context = _attend_decode(group, q[group.rows], k_blocks, v_blocks)
            out.index_copy_(0, group.rows, context)
        for span in spans:
            length = span.context_len
            keys = _gather(k_blocks, span.block_ids).view(-1, num_kv_heads, head_dim)[:length]
            values = _gather(v_blocks, span.block_ids).view(-1, num_kv_heads, head_dim)[:length]
            query = q[span.start : span.end].transpose(0, 1)[None]  # [1, heads, q_len, D]
            context = F.scaled_dot_product_attention(
                query,
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=span.mask,
                is_causal=span.mask is None,
                enable_gqa=True,
            )
            out[span.start : span.end] = context[0].transpose(0, 1)
        return out


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


def _gather(blocks: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Whole blocks, copied row by row: ``index_select`` on the blocks viewed as rows copies
    a block at a time, where advanced indexing copies element by element (slower on the CPU,
    see docs/generation.md)."""
    return blocks.view(blocks.shape[0], -1).index_select(0, block_ids.reshape(-1))
