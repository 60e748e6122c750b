"""The block pool: it owns every KV block, counts who holds each, and remembers full ones.

The KV cache is cut into ``num_blocks`` blocks of ``block_size`` token slots. A block is
either *in use* (``ref_count > 0``: one or more block tables hold it) or *free* (``ref_count
== 0``: it sits in the free queue). Free blocks form an LRU queue::

    head (evicted first)                                   tail (freed last)
      ▼                                                      ▼
    [ 7 ] ─ [ 2 ] ─ [ 9 #h3 ] ─ [ 4 #h1 ] ─ [ 5 ] ─ [ 0 #h2 ]

``allocate`` takes blocks from the head; ``free`` appends blocks that reach zero to the
tail. A *cached* block (``#h``) is a full block whose hash and tokens are remembered: it
stays reusable while free, and a prefix hit (``lookup`` then ``incref``) revives it from
anywhere in the queue. Only when ``allocate`` hands it out again is its hash dropped.

Block hashes chain: ``hash_block_tokens(parent_hash, tokens)`` covers the block's tokens and
(through the parent) every token before them, so equal hashes mean equal prefixes. The hash
is a 128-bit BLAKE2b digest, and ``lookup`` also compares the stored tokens, so a collision
never hands out another sequence's K/V.

Prefix-cache counters here count *blocks* (one query per ``lookup`` call); the KV-cache
manager counts the same thing in tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from carpool.errors import ConfigError

NO_PARENT_HASH = 0  # the parent hash of a sequence's first block


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """The chained hash of one full block: its parent's hash and its own token ids."""
    digest = hashlib.blake2b(parent_hash.to_bytes(16, "little"), digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block. ``block_hash is not None`` iff the pool's cache maps it here."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # the tokens of a cached block, checked on every hit


class BlockPool:
    """Fixed-size KV blocks with reference counts, an LRU free queue and a prefix cache.

    Args:
        num_blocks: blocks in the pool (see :meth:`from_memory_budget`).
        block_size: token slots per block.
        enable_prefix_caching: remember full blocks for reuse; off, ``lookup`` always misses.

    Raises:
        ConfigError: when ``num_blocks`` or ``block_size`` is below 1.
    """

    def __init__(
        self, num_blocks: int, block_size: int = 16, *, enable_prefix_caching: bool = True
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "an integer >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.num_queried_blocks = 0  # prefix-cache lookups, in blocks
        self.num_hit_blocks = 0

    @staticmethod
    def num_blocks_for_budget(
        memory_budget_bytes: int, bytes_per_token: int, block_size: int = 16
    ) -> int:
        """How many whole blocks fit ``memory_budget_bytes`` (K and V of all layers per token).

        Raises:
            ConfigError: when not even one block fits, or an argument is not positive.
        """
        if bytes_per_token < 1:
            raise ConfigError("bytes_per_token", bytes_per_token, "an integer >= 1")
        if block_size < 1:
            raise ConfigError("block_size", block_size, "an integer >= 1")
        num_blocks = memory_budget_bytes // (bytes_per_token * block_size)
        if num_blocks < 1:
            raise ConfigError(
                "memory_budget_bytes",
                memory_budget_bytes,
                f"at least one block ({bytes_per_token * block_size} bytes = "
                f"{bytes_per_token} bytes/token x {block_size} tokens); raise the budget",
            )
        return num_blocks

    @classmethod
    def from_memory_budget(
        cls,
        memory_budget_bytes: int,
        bytes_per_token: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
    ) -> BlockPool:
        """A pool with as many blocks as fit ``memory_budget_bytes`` (see above)."""
        num_blocks = cls.num_blocks_for_budget(memory_budget_bytes, bytes_per_token, block_size)
        return cls(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)

    # -- capacity -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks in the free queue, cached ones included (they can be evicted)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks whose hash is remembered, in use or free."""
        return len(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    # -- allocation -----------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` from the head of the free queue, evicting their cached hashes.

        Returns:
            The block ids, each with ``ref_count == 1``.

        Raises:
            ValueError: when fewer than ``num_blocks`` are free (check ``can_allocate``).
        """
        if num_blocks > len(self._free):
            raise ValueError(
                f"asked for {num_blocks} KV blocks but only {len(self._free)} are free; "
                "check can_allocate() first"
            )
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """One more holder for each block; a free (cached) block leaves the free queue."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """One holder fewer for each block; those reaching zero go to the free queue's tail.

        Pass a block table *reversed*, so a sequence's last blocks (the least shared) are
        evicted before its first ones. Cached blocks keep their hash while free.
        """
        for block_id in block_ids:
            block = self._blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than held"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    # -- prefix cache ---------------------------------------------------------------------

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block with this hash *and* these tokens, or None. Counts nothing held:
        ``incref`` the result to use it (which also revives it from the free queue)."""
        if not self.enable_prefix_caching:
            return None
        self.num_queried_blocks += 1
        block_id = self._cached.get(block_hash)
        if block_id is None or self._blocks[block_id].token_ids != token_ids:
            return None
        self.num_hit_blocks += 1
        return block_id

    def cache_full_block(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Remember a full, in-use block under ``block_hash`` so later prefixes can share it.

        Returns:
            True when cached; False when caching is off, the block is already cached, or
            another block already holds this hash (the first one stays the shared copy).
        """
        block = self._blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} cached while free"
        assert len(token_ids) == self.block_size, "only full blocks are cached"
        if not self.enable_prefix_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block_id
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()

    # -- inspection (tests, metrics) ------------------------------------------------------

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> int | None:
        return self._blocks[block_id].block_hash

    def cached_token_ids(self, block_id: int) -> tuple[int, ...] | None:
        block = self._blocks[block_id]
        return block.token_ids if block.block_hash is not None else None

    def free_block_ids(self) -> tuple[int, ...]:
        """The free queue, head (next to be allocated) first."""
        return tuple(self._free)

    def check_invariants(self) -> None:
        """Raise AssertionError when the pool's bookkeeping is inconsistent."""
        for block in self._blocks:
            assert block.ref_count >= 0, f"block {block.block_id}: negative ref count"
            is_free = block.block_id in self._free
            assert is_free == (block.ref_count == 0), (
                f"block {block.block_id}: ref_count={block.ref_count} but free={is_free}"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id
                assert len(block.token_ids) == self.block_size
        assert len(self._cached) == sum(b.block_hash is not None for b in self._blocks)
        assert self.num_free + self.num_used == self.num_blocks
