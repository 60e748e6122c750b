"""The KV-cache manager: where each request's K/V lives.

Each request has a block table: the physical blocks that hold its positions, in order.
With ``block_size = 4`` a sequence of 10 tokens whose first block is shared::

    positions   0  1  2  3 | 4  5  6  7 | 8  9  .  .
    table       [ 12       ,  3         ,  7        ]
                  ^ shared prefix hit (ref_count 2), cached
                               ^ full: cached once its K/V is computed
                                            ^ partial: never cached

On admission :meth:`find_cached_prefix` walks the prompt's chain of block hashes through
the pool's cache and stops at the first miss; :meth:`allocate` then shares those blocks
(``incref``) and appends fresh ones. Full blocks are cached by :meth:`cache_full_blocks`
only once their K/V has been computed (after the step ran), so a hit never points at
slots still being written. :meth:`free` returns a request's blocks tail-first, so its
prefix survives longest in the LRU free queue.

Prefix-cache counters here count *tokens*: queried = the tokens of each admitted sequence,
hit = the tokens its cached prefix covered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from carpool.generation.block_pool import NO_PARENT_HASH, BlockPool, hash_block_tokens


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """The longest cached prefix of a sequence: full blocks only, never the whole sequence."""

    block_ids: tuple[int, ...] = ()
    block_hashes: tuple[int, ...] = ()
    num_tokens: int = 0  # len(block_ids) * block_size
    num_queried_tokens: int = 0  # the sequence's length when it was looked up


@dataclass(slots=True)
class _RequestBlocks:
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the first len() blocks, cached


class KVCacheManager:
    """Per-request block tables over one :class:`BlockPool`."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._requests: dict[int, _RequestBlocks] = {}
        self.num_queried_tokens = 0  # prefix cache, in tokens
        self.num_hit_tokens = 0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` positions occupy."""
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix:
        """The longest run of cached full blocks at the start of ``token_ids``.

        At most ``len(token_ids) - 1`` tokens are covered: the last token is always
        computed so its logits exist. Holds nothing; pass the result to :meth:`allocate`.
        """
        size = self.block_size
        max_blocks = (len(token_ids) - 1) // size
        block_ids: list[int] = []
        block_hashes: list[int] = []
        parent_hash = NO_PARENT_HASH
        for i in range(max_blocks if self.pool.enable_prefix_caching else 0):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            block_hash = hash_block_tokens(parent_hash, tokens)
            block_id = self.pool.lookup(block_hash, tokens)
            if block_id is None:
                break
            block_ids.append(block_id)
            block_hashes.append(block_hash)
            parent_hash = block_hash
        return CachedPrefix(
            tuple(block_ids), tuple(block_hashes), len(block_ids) * size, len(token_ids)
        )

    def allocate(
        self,
        request_id: int,
        num_total_tokens: int,
        prefix: CachedPrefix | None = None,
        *,
        counts: bool = True,
    ) -> bool:
        """Grow ``request_id``'s table to cover ``num_total_tokens`` positions.

        Args:
            request_id: the request; its table is created on first call.
            num_total_tokens: computed tokens plus the tokens about to be computed.
            prefix: on admission only, the cached prefix to share (from
                :meth:`find_cached_prefix`, with no pool change in between).
            counts: whether ``prefix``'s lookup counts in the prefix cache's queries and
                hits: not for a preempted request admitted again (its own blocks found
                again, its outputs looked up too), as vLLM keeps those apart.

        Returns:
            True when the blocks fit; False (and nothing changed) when they do not.
        """
        entry = self._requests.get(request_id)
        num_held = len(entry.block_ids) if entry is not None else 0
        prefix = prefix if prefix is not None else CachedPrefix()
        assert not (prefix.block_ids and num_held), "a prefix is shared on admission only"
        num_new = self.num_blocks_for(num_total_tokens) - num_held - len(prefix.block_ids)
        # Reviving a free cached prefix block uses up one free block, just as a new one does.
        num_revived = sum(self.pool.ref_count(b) == 0 for b in prefix.block_ids)
        if max(num_new, 0) + num_revived > self.pool.num_free:
            return False
        if entry is None:
            entry = self._requests[request_id] = _RequestBlocks()
        if prefix.block_ids:
            self.pool.incref(prefix.block_ids)  # before allocate, so they are not evicted
            entry.block_ids.extend(prefix.block_ids)
            entry.block_hashes.extend(prefix.block_hashes)
            if counts:
                self.num_hit_tokens += prefix.num_tokens
        if counts:
            self.num_queried_tokens += prefix.num_queried_tokens
        if num_new > 0:
            entry.block_ids.extend(self.pool.allocate(num_new))
        return True

    def cache_full_blocks(
        self, request_id: int, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Cache the request's blocks that are full of computed K/V and not cached yet."""
        if not self.pool.enable_prefix_caching:
            return
        entry = self._requests[request_id]
        size = self.block_size
        parent_hash = entry.block_hashes[-1] if entry.block_hashes else NO_PARENT_HASH
        for i in range(len(entry.block_hashes), num_computed_tokens // size):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            block_hash = hash_block_tokens(parent_hash, tokens)
            self.pool.cache_full_block(entry.block_ids[i], block_hash, tokens)
            entry.block_hashes.append(block_hash)
            parent_hash = block_hash

    def free(self, request_id: int) -> None:
        """Drop ``request_id``'s table; its blocks go back to the pool, last block first."""
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self.pool.free(reversed(entry.block_ids))

    def block_table(self, request_id: int) -> tuple[int, ...]:
        entry = self._requests.get(request_id)
        return tuple(entry.block_ids) if entry is not None else ()

    def request_ids(self) -> tuple[int, ...]:
        """Requests that hold a block table."""
        return tuple(self._requests)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def check_invariants(self) -> None:
        """Raise AssertionError when a ref count differs from the tables holding the block."""
        self.pool.check_invariants()
        holders = [0] * self.pool.num_blocks
        for entry in self._requests.values():
            assert len(set(entry.block_ids)) == len(entry.block_ids), "a block twice in a table"
            assert len(entry.block_hashes) <= len(entry.block_ids)
            for block_id in entry.block_ids:
                holders[block_id] += 1
        for block_id, num_holders in enumerate(holders):
            assert self.pool.ref_count(block_id) == num_holders, (
                f"block {block_id}: ref_count={self.pool.ref_count(block_id)}, "
                f"held by {num_holders} tables"
            )
