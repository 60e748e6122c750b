"""The block pool: budgets, LRU order, the prefix cache, and a state machine over all of it."""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from carpool.errors import ConfigError
from carpool.generation.block_pool import NO_PARENT_HASH, BlockPool, hash_block_tokens

BLOCK_SIZE = 2


def test_num_blocks_for_budget_counts_whole_blocks() -> None:
    # 16 tokens/block x 100 bytes/token = 1600 bytes/block; 10_000 bytes hold 6 blocks.
    assert BlockPool.num_blocks_for_budget(10_000, bytes_per_token=100, block_size=16) == 6
    pool = BlockPool.from_memory_budget(10_000, bytes_per_token=100, block_size=16)
    assert (pool.num_blocks, pool.block_size, pool.num_free) == (6, 16, 6)


def test_budget_below_one_block_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="memory_budget_bytes"):
        BlockPool.num_blocks_for_budget(1_000, bytes_per_token=100, block_size=16)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (4, 0), (True, 16)])
def test_rejects_sizes_below_one(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ConfigError):
        BlockPool(num_blocks, block_size)


def test_allocate_takes_from_head_and_free_appends_to_tail() -> None:
    pool = BlockPool(4, BLOCK_SIZE)
    assert pool.allocate(2) == [0, 1]
    pool.free([1, 0])
    assert pool.free_block_ids() == (2, 3, 1, 0)
    assert pool.allocate(3) == [2, 3, 1]
    assert pool.usage == 0.75


def test_allocating_more_than_free_raises() -> None:
    pool = BlockPool(2, BLOCK_SIZE)
    assert not pool.can_allocate(3)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.allocate(3)


def test_cached_free_block_is_revived_by_a_hit() -> None:
    pool = BlockPool(3, BLOCK_SIZE)
    [block_id] = pool.allocate(1)
    h = hash_block_tokens(NO_PARENT_HASH, (5, 6))
    assert pool.cache_full_block(block_id, h, (5, 6))
    pool.free([block_id])
    assert pool.lookup(h, (5, 6)) == block_id
    pool.incref([block_id])
    assert pool.ref_count(block_id) == 1
    assert block_id not in pool.free_block_ids()
    assert (pool.num_queried_blocks, pool.num_hit_blocks) == (1, 1)


def test_reallocating_a_cached_block_drops_its_hash() -> None:
    pool = BlockPool(1, BLOCK_SIZE)
    [block_id] = pool.allocate(1)
    h = hash_block_tokens(NO_PARENT_HASH, (5, 6))
    pool.cache_full_block(block_id, h, (5, 6))
    pool.free([block_id])
    assert pool.allocate(1) == [block_id]
    assert pool.block_hash(block_id) is None
    assert pool.lookup(h, (5, 6)) is None
    assert pool.num_cached == 0


def test_hash_collision_with_other_tokens_misses() -> None:
    pool = BlockPool(2, BLOCK_SIZE)
    [block_id] = pool.allocate(1)
    pool.cache_full_block(block_id, 42, (1, 2))
    assert pool.lookup(42, (1, 3)) is None
    assert pool.lookup(42, (1, 2)) == block_id


def test_second_block_with_same_hash_is_not_cached() -> None:
    pool = BlockPool(2, BLOCK_SIZE)
    a, b = pool.allocate(2)
    assert pool.cache_full_block(a, 7, (1, 2))
    assert not pool.cache_full_block(b, 7, (1, 2))
    assert pool.block_hash(b) is None
    pool.check_invariants()


def test_chained_hash_depends_on_parent() -> None:
    first = hash_block_tokens(NO_PARENT_HASH, (1, 2))
    assert hash_block_tokens(first, (3, 4)) != hash_block_tokens(NO_PARENT_HASH, (3, 4))
    assert hash_block_tokens(first, (3, 4)) == hash_block_tokens(first, (3, 4))


def test_lookup_misses_when_prefix_caching_is_off() -> None:
    pool = BlockPool(2, BLOCK_SIZE, enable_prefix_caching=False)
    [block_id] = pool.allocate(1)
    assert not pool.cache_full_block(block_id, 1, (1, 2))
    assert pool.lookup(1, (1, 2)) is None


# -- state machine ---------------------------------------------------------------------------

NUM_BLOCKS = 8
TOKENS = st.tuples(st.integers(0, 2), st.integers(0, 2))  # few values: hits are common
HASHES = st.integers(0, 3)  # few hashes: collisions with other tokens are common


class BlockPoolMachine(RuleBasedStateMachine):
    """Tables are modelled here; the pool must agree with them after every rule."""

    tables = Bundle("tables")
    keys = Bundle("keys")  # (hash, tokens) pairs once cached, to look up again

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
        self.held: dict[int, list[int]] = {}  # table id -> its blocks
        self.next_table_id = 0

    def _new_table(self, block_ids: list[int]) -> int:
        table_id = self.next_table_id
        self.next_table_id += 1
        self.held[table_id] = block_ids
        return table_id

    @rule(target=tables, num_blocks=st.integers(1, 4))
    def allocate(self, num_blocks: int) -> int:
        if not self.pool.can_allocate(num_blocks):
            with pytest.raises(ValueError):
                self.pool.allocate(num_blocks)
            return self._new_table([])
        block_ids = self.pool.allocate(num_blocks)
        assert all(self.pool.block_hash(b) is None for b in block_ids)
        return self._new_table(block_ids)

    @rule(table_id=consumes(tables))
    def free(self, table_id: int) -> None:
        self.pool.free(reversed(self.held.pop(table_id)))

    @rule(target=tables, table_id=tables)
    def share(self, table_id: int) -> int:
        block_ids = list(self.held[table_id])
        self.pool.incref(block_ids)
        return self._new_table(block_ids)

    @rule(target=keys, table_id=tables, index=st.integers(0, 3), block_hash=HASHES, tokens=TOKENS)
    def cache(
        self, table_id: int, index: int, block_hash: int, tokens: tuple[int, int]
    ) -> tuple[int, tuple[int, int]]:
        block_ids = self.held[table_id]
        if not block_ids:
            return block_hash, tokens
        block_id = block_ids[index % len(block_ids)]
        was_cached = self.pool.block_hash(block_id) is not None
        if self.pool.cache_full_block(block_id, block_hash, tokens):
            assert not was_cached
            assert self.pool.cached_token_ids(block_id) == tokens
        return block_hash, tokens

    @rule(target=tables, key=keys | st.tuples(HASHES, TOKENS))
    def lookup_and_share(self, key: tuple[int, tuple[int, int]]) -> int:
        block_hash, tokens = key
        block_id = self.pool.lookup(block_hash, tokens)
        if block_id is None:
            return self._new_table([])
        event("prefix hit")
        assert self.pool.cached_token_ids(block_id) == tokens
        assert self.pool.block_hash(block_id) == block_hash
        self.pool.incref([block_id])
        return self._new_table([block_id])

    @precondition(lambda self: any(self.held.values()))
    @rule()
    def drain(self) -> None:
        for table_id, block_ids in self.held.items():
            self.pool.free(reversed(block_ids))
            self.held[table_id] = []  # the bundle still names the table: keep it, empty
        assert self.pool.num_free == NUM_BLOCKS
        assert self.pool.usage == 0.0

    @invariant()
    def ref_counts_match_tables(self) -> None:
        holders = [0] * NUM_BLOCKS
        for block_ids in self.held.values():
            for block_id in block_ids:
                holders[block_id] += 1
        free = set(self.pool.free_block_ids())
        for block_id in range(NUM_BLOCKS):
            assert self.pool.ref_count(block_id) == holders[block_id] >= 0
            assert (block_id in free) == (holders[block_id] == 0)  # never free and in use
        assert self.pool.num_free + self.pool.num_used == NUM_BLOCKS
        self.pool.check_invariants()

    def teardown(self) -> None:
        for block_ids in self.held.values():
            self.pool.free(reversed(block_ids))
        assert self.pool.num_free == NUM_BLOCKS
        self.pool.check_invariants()


BlockPoolMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
test_block_pool_state_machine = BlockPoolMachine.TestCase
