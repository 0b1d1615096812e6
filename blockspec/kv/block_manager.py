"""Block allocation for the paged pool: free list, reference counts, and prefix caching of committed full blocks.

A block becomes cacheable once every one of its tokens is committed (target KV and draft context both written).
Its hash chains the parent block's hash with its own token ids, so a hit on block i implies blocks 0..i-1 match.
Freed cached blocks stay findable until they are reused for something else (evicted in free-list order)."""

from __future__ import annotations

from collections import OrderedDict

from blockspec.errors import BlockspecError


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_of: dict[int, int] = {}  # block -> hash (only full, committed blocks)
        self.block_of: dict[int, int] = {}  # hash -> block
        self.prefix_hits = 0  # blocks restored from the prefix cache
        self.prefix_queries = 0  # blocks looked up

    @property
    def num_free(self) -> int:
        return len(self.free)

    @staticmethod
    def chain_hash(parent: int | None, tokens: list[int]) -> int:
        return hash((parent, tuple(tokens)))

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.hash_of.pop(block, None)  # reusing a cached block evicts it from the prefix cache
        if old is not None and self.block_of.get(old) == block:
            del self.block_of[old]
        self.ref[block] = 1
        return block

    def blocks_needed(self, table: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(table))

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend `table` so it covers `num_tokens` positions."""
        need = self.blocks_needed(table, num_tokens)
        if need > len(self.free):
            raise BlockspecError(f"KV pool exhausted: need {need} blocks, {len(self.free)} free")
        table.extend(self._take_free() for _ in range(need))

    def release(self, table: list[int]) -> None:
        for block in table:
            if self.ref[block] <= 0:
                raise RuntimeError(f"block {block} freed twice")
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None
        table.clear()

    def match_prefix(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Cached blocks covering a prefix of `tokens` (at most `max_tokens` tokens); takes a reference on each."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = None
        for i in range(max_tokens // self.block_size):
            h = self.chain_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            self.prefix_queries += 1
            block = self.block_of.get(h)
            if block is None:
                break
            if self.ref[block] == 0:
                del self.free[block]
            self.ref[block] += 1
            hits.append(block)
            parent = h
        self.prefix_hits += len(hits)
        return hits

    def commit_full_blocks(self, table: list[int], tokens: list[int], num_committed: int, num_hashed: int) -> int:
        """Register blocks [num_hashed, num_committed // block_size) of a sequence as cacheable; returns the new
        number of hashed blocks. `tokens` are the sequence's token ids from position 0."""
        if not self.enable_prefix_caching:
            return num_hashed
        full = num_committed // self.block_size
        parent = self.hash_of.get(table[num_hashed - 1]) if num_hashed > 0 else None
        for i in range(num_hashed, full):
            h = self.chain_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            block = table[i]
            if h not in self.block_of:
                self.block_of[h] = block
            self.hash_of[block] = h
            parent = h
        return max(full, num_hashed)
