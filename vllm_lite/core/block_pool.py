"""BlockPool: every KV block's bookkeeping, the LRU free list and the prefix-cache index.

Blocks are created once. A block is either in use (ref_cnt > 0, not in the
free list) or free (ref_cnt == 0, in the free list). A free block may still
hold a cached prefix (block_hash set): it is reused, and its hash dropped,
only when it reaches the head of the free list (LRU eviction).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from vllm_lite.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    """Owns `num_blocks` blocks; with `reserve_null_block`, block 0 is a placeholder never handed out."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, reserve_null_block: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < (2 if reserve_null_block else 0):
            need = "at least 2 (block 0 is the null block)" if reserve_null_block else "non-negative"
            raise ValueError(f"num_blocks must be an integer, {need}, got {num_blocks!r}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block: Optional[KVCacheBlock] = None
        if reserve_null_block:
            self.null_block = self.free_block_queue.popleft()
            self.null_block.is_null = True
        # Prefix cache: hash of a full block -> the block holding it (one block per hash).
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    # ------------------------------------------------------------------ sizes
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - (1 if self.null_block is not None else 0)

    def get_num_free_blocks(self) -> int:
        """Free blocks, including evictable cached ones."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks in use (0..1)."""
        total = self.num_usable_blocks
        return 0.0 if total == 0 else 1.0 - self.get_num_free_blocks() / total

    # ------------------------------------------------------------------ allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free list (least recently used), evicting their cached hashes."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be non-negative, got {num_blocks!r}.")
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} are free")
        out = self.free_block_queue.popleft_n(num_blocks)
        for block in out:
            self._evict_hash(block)
            block.ref_cnt += 1
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (cache-hit) blocks, pulling free ones out of the eviction list."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks reaching zero join the free list's tail in the given order.

        Callers pass a request's blocks tail first, so a chain's last blocks are evicted before its prefix.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id} (ref_cnt={block.ref_cnt})")
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.append(block)

    # ------------------------------------------------------------------ prefix cache
    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash], num_cached: int, num_full: int
    ) -> None:
        """Register blocks[num_cached:num_full] (full, computed) under their hashes.

        A hash already held by another block is left to that block: this one stays uncached and is
        recycled normally when freed.
        """
        if not self.enable_caching:
            return
        if num_full > len(block_hashes) or num_full > len(blocks):
            raise ValueError(
                f"cannot cache {num_full} blocks: request has {len(blocks)} blocks and {len(block_hashes)} hashes"
            )
        index = self.cached_block_hash_to_block
        for i in range(num_cached, num_full):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            h = block_hashes[i]
            if h in index:
                continue
            block.block_hash = h
            index[h] = block

    def _evict_hash(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is None:
            return
        if self.cached_block_hash_to_block.get(h) is block:
            del self.cached_block_hash_to_block[h]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, as in vLLM.

        Blocks in use may be mid-computation for requests that will cache them next step;
        dropping hashes under them would only race with that, so we wait for an idle pool.
        """
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
