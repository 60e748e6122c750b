"""Attention over the paged KV cache: decode grouped by context length (the groups, and
each sequence's output equal to attending over its own context alone), and a prefill chunk
over its cached prefix and itself."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from carpool.generation import attention
from carpool.generation.attention import PagedAttention, group_by_length, plan_attention

lengths_lists = st.lists(st.integers(1, 2000), min_size=1, max_size=64)


@given(lengths_lists, st.integers(0, 512))
def test_every_sequence_is_in_exactly_one_group_shortest_first(
    lengths: list[int], cost_keys: int
) -> None:
    groups = group_by_length(lengths, cost_keys)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat)


@given(lengths_lists)
def test_with_no_cost_for_a_call_each_distinct_length_is_a_group(lengths: list[int]) -> None:
    groups = group_by_length(lengths, 0, max_keys=1 << 30)
    assert len(groups) == len(set(lengths))
    assert all(len({lengths[i] for i in g}) == 1 for g in groups)


@given(lengths_lists, st.integers(0, 512))
def test_a_group_grows_only_while_the_padding_it_adds_costs_less_than_a_call(
    lengths: list[int], cost_keys: int
) -> None:
    for group in group_by_length(lengths, cost_keys):
        members = [lengths[i] for i in group]
        for k in range(1, len(members)):
            assert k * (members[k] - members[k - 1]) <= cost_keys


@given(lengths_lists, st.integers(1, 4096))
def test_a_group_holds_at_most_max_keys_unless_it_is_one_sequence(
    lengths: list[int], max_keys: int
) -> None:
    for group in group_by_length(lengths, 1 << 30, max_keys):
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= max_keys


def test_equal_lengths_share_one_call_without_a_mask() -> None:
    table = torch.arange(12).view(3, 4)
    plan = plan_attention(table, [1, 1, 1], [6, 6, 6], block_size=2)
    assert len(plan.groups) == 1
    assert plan.groups[0].rows is None and plan.groups[0].mask is None


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query [heads, D] over its own keys [L, kv_heads, D], written out by hand."""
    repeat = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(repeat, dim=1)  # [L, heads, D]
    v = values.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("hd,lhd->hl", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


def test_each_decode_attends_over_its_own_context_only() -> None:
    block_size, kv_heads, heads, dim = 4, 2, 4, 8
    starts = [3, 40, 41, 200, 7]  # positions of the step's decode tokens
    num_blocks = sum(-(-(s + 1) // block_size) for s in starts)
    generator = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(1, 2, num_blocks + 1, block_size, kv_heads, dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for s in starts:
        n = -(-(s + 1) // block_size)
        tables.append(order[used : used + n] + [num_blocks] * (60 - n))
        used += n
    table = torch.tensor(tables)
    plan = plan_attention(table, [1] * len(starts), starts, block_size)
    assert len(plan.groups) > 1
    slots = torch.tensor([tables[i][s // block_size] * block_size + s % block_size
                          for i, s in enumerate(starts)])  # fmt: skip
    q = torch.randn(len(starts), heads, dim, generator=generator)
    k = torch.randn(len(starts), kv_heads, dim, generator=generator)
    v = torch.randn(len(starts), kv_heads, dim, generator=generator)
    out = PagedAttention(kv_cache, slots, plan)(0, q, k, v)
    for i, s in enumerate(starts):
        blocks = torch.tensor(tables[i][: -(-(s + 1) // block_size)])
        keys = kv_cache[0, 0, blocks].reshape(-1, kv_heads, dim)[: s + 1]
        values = kv_cache[0, 1, blocks].reshape(-1, kv_heads, dim)[: s + 1]
        torch.testing.assert_close(out[i], _reference(q[i], keys, values))


def _chunk_after_prefix(
    num_cached: int, n: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """A cache holding ``num_cached`` positions of one sequence in shuffled blocks, and the
    query/K/V of its next ``n`` tokens; returns (kv_cache, table, [q, k, v], slots)."""
    block_size, kv_heads, heads, dim = 4, 2, 6, 8
    num_blocks = -(-(num_cached + n) // block_size)
    generator = torch.Generator().manual_seed(num_cached + n)
    kv_cache = torch.randn(1, 2, num_blocks, block_size, kv_heads, dim, generator=generator)
    table = torch.randperm(num_blocks, generator=generator)
    positions = torch.arange(num_cached, num_cached + n)
    slots = table[positions // block_size] * block_size + positions % block_size
    q = torch.randn(n, heads, dim, generator=generator)
    k = torch.randn(n, kv_heads, dim, generator=generator)
    v = torch.randn(n, kv_heads, dim, generator=generator)
    return kv_cache, table, [q, k, v], slots


def _causal_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_cached: int
) -> torch.Tensor:
    """Queries at positions num_cached.. over keys [L, kv_heads, D], by hand."""
    return torch.stack(
        [_reference(q[i], keys[: num_cached + i + 1], values[: num_cached + i + 1])
         for i in range(q.shape[0])]
    )  # fmt: skip


@pytest.mark.parametrize(("num_cached", "n"), [(0, 9), (1, 5), (13, 7), (40, 12)])
def test_a_chunk_attends_causally_over_its_cached_prefix_and_itself(
    num_cached: int, n: int
) -> None:
    kv_cache, table, (q, k, v), slots = _chunk_after_prefix(num_cached, n)
    plan = plan_attention(table[None], [n], [num_cached], block_size=4)
    out = PagedAttention(kv_cache, slots, plan)(0, q, k, v)
    # The step wrote its own K/V into the cache: the whole context is there now.
    keys = kv_cache[0, 0, table].reshape(-1, 2, 8)
    values = kv_cache[0, 1, table].reshape(-1, 2, 8)
    torch.testing.assert_close(out, _causal_reference(q, keys, values, num_cached))


def test_a_chunk_after_a_prefix_is_planned_without_a_mask() -> None:
    # The prefix is attended apart from the chunk (no [chunk, context] mask to build and
    # add to every score), then merged by log-sum-exp.
    table = torch.arange(8)[None]
    (span,) = plan_attention(table, [5], [20], block_size=4).spans
    assert span.mask is None and span.num_cached == 20


def test_without_the_log_sum_exp_kernel_a_chunk_runs_one_masked_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(attention, "_FLASH_CPU", None)
    kv_cache, table, (q, k, v), slots = _chunk_after_prefix(13, 7)
    plan = plan_attention(table[None], [7], [13], block_size=4)
    assert plan.spans[0].mask is not None
    out = PagedAttention(kv_cache, slots, plan)(0, q, k, v)
    keys = kv_cache[0, 0, table].reshape(-1, 2, 8)
    values = kv_cache[0, 1, table].reshape(-1, 2, 8)
    torch.testing.assert_close(out, _causal_reference(q, keys, values, 13))
