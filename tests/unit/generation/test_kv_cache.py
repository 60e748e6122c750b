"""The KV-cache manager: block tables, prefix sharing, freeing, and LRU reuse."""

from __future__ import annotations

from carpool.generation.block_pool import BlockPool
from carpool.generation.kv_cache import KVCacheManager

BLOCK_SIZE = 4


def make_manager(num_blocks: int = 16, *, enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        BlockPool(num_blocks, BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
    )


def run_prefill(kv: KVCacheManager, request_id: int, token_ids: list[int]) -> int:
    """Admit a sequence, compute all of it, cache its full blocks; the cached tokens."""
    prefix = kv.find_cached_prefix(token_ids)
    assert kv.allocate(request_id, len(token_ids), prefix)
    kv.cache_full_blocks(request_id, token_ids, len(token_ids))
    kv.check_invariants()
    return prefix.num_tokens


def test_table_covers_the_tokens_in_whole_blocks() -> None:
    kv = make_manager()
    assert kv.allocate(1, 5)
    assert len(kv.block_table(1)) == 2
    assert kv.allocate(1, 8)  # still two blocks
    assert len(kv.block_table(1)) == 2
    assert kv.allocate(1, 9)
    assert len(kv.block_table(1)) == 3
    kv.check_invariants()


def test_allocate_that_does_not_fit_changes_nothing() -> None:
    kv = make_manager(num_blocks=2)
    assert not kv.allocate(1, 9)
    assert kv.block_table(1) == ()
    assert kv.pool.num_free == 2
    kv.check_invariants()


def test_common_prefix_of_two_and_a_half_blocks_shares_exactly_two() -> None:
    kv = make_manager()
    common = list(range(100, 110))  # 2.5 blocks of 4
    run_prefill(kv, 1, [*common, 1, 2, 3])
    num_cached = run_prefill(kv, 2, [*common, 7, 8, 9])
    assert num_cached == 2 * BLOCK_SIZE
    first, second = kv.block_table(1), kv.block_table(2)
    assert first[:2] == second[:2]
    assert set(first[2:]).isdisjoint(second[2:])
    assert [kv.pool.ref_count(b) for b in second] == [2, 2, 1, 1]
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (26, 8)


def test_whole_prompt_cached_still_computes_the_last_token() -> None:
    kv = make_manager()
    prompt = list(range(8))  # exactly two full blocks
    run_prefill(kv, 1, prompt)
    kv.free(1)
    prefix = kv.find_cached_prefix(prompt)
    assert prefix.num_tokens == BLOCK_SIZE  # not 8: the last token's logits are needed
    assert kv.find_cached_prefix([*prompt, 99]).num_tokens == 2 * BLOCK_SIZE


def test_freed_blocks_keep_their_hashes_for_reuse() -> None:
    kv = make_manager()
    prompt = list(range(12))
    run_prefill(kv, 1, prompt)
    table = kv.block_table(1)
    kv.free(1)
    assert kv.pool.num_free == kv.pool.num_blocks
    assert run_prefill(kv, 2, [*prompt, 50]) == 12
    assert kv.block_table(2)[:3] == table


def test_free_returns_blocks_tail_first_so_prefixes_are_evicted_last() -> None:
    kv = make_manager(num_blocks=4)
    run_prefill(kv, 1, list(range(12)))
    a, b, c = kv.block_table(1)
    kv.free(1)
    assert kv.pool.free_block_ids() == (3, c, b, a)


def test_lru_evicts_the_least_recently_freed_cached_blocks_first() -> None:
    kv = make_manager(num_blocks=4)
    old, new = [1, 1, 1, 1, 0], [2, 2, 2, 2, 0]
    run_prefill(kv, 1, old)
    kv.free(1)
    run_prefill(kv, 2, new)
    kv.free(2)
    # Two fresh blocks come from the head: request 1's, freed longest ago.
    assert kv.allocate(3, 2 * BLOCK_SIZE)
    assert kv.find_cached_prefix(new).num_tokens == BLOCK_SIZE
    assert kv.find_cached_prefix(old).num_tokens == 0
    kv.check_invariants()


def test_hit_on_a_free_cached_block_counts_against_free_capacity() -> None:
    kv = make_manager(num_blocks=2)
    prompt = [1, 2, 3, 4, 5]
    run_prefill(kv, 1, prompt)
    kv.free(1)
    prefix = kv.find_cached_prefix(prompt)
    assert prefix.num_tokens == BLOCK_SIZE
    # One revived block + one new block fill the pool; three blocks do not fit.
    assert not kv.allocate(2, 3 * BLOCK_SIZE, prefix)
    assert kv.pool.ref_count(prefix.block_ids[0]) == 0
    assert kv.allocate(2, len(prompt), prefix)
    assert kv.block_table(2)[0] == prefix.block_ids[0]
    kv.check_invariants()


def test_blocks_are_cached_only_once_computed() -> None:
    kv = make_manager()
    token_ids = list(range(10))
    assert kv.allocate(1, 10)
    kv.cache_full_blocks(1, token_ids, 6)  # one full computed block
    assert kv.find_cached_prefix([*token_ids, 0]).num_tokens == BLOCK_SIZE
    kv.cache_full_blocks(1, token_ids, 10)
    assert kv.find_cached_prefix([*token_ids, 0]).num_tokens == 2 * BLOCK_SIZE


def test_no_sharing_when_prefix_caching_is_off() -> None:
    kv = make_manager(enable_prefix_caching=False)
    run_prefill(kv, 1, list(range(9)))
    assert run_prefill(kv, 2, list(range(9))) == 0
    assert set(kv.block_table(1)).isdisjoint(kv.block_table(2))
