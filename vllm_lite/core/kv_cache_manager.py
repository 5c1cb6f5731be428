"""KVCacheManager: which blocks each request holds, prefix-cache lookups, swap space.

The scheduler asks it for room for a step's tokens (`allocate_slots`, None when
the pool is short) and tells it when tokens are computed (`cache_blocks`) and
when a request leaves (`free`). Blocks become prefix-cache entries only after
their KV has been written, so a request preempted mid-step never leaves
unwritten blocks behind in the cache.

Sliding window (a model whose every layer attends to keys in (p - W, p]): when
a step starts, the request's blocks wholly before the window of its first new
token are freed and replaced by the pool's null block in its list, as vLLM's
sliding-window manager does, so a sequence holds about W / block_size blocks.
The worker's block table keeps the stale ids; attention never reads them.
Models that mix window and full layers (Gemma 2) keep one KV layout for all
layers and free nothing early: the full layers need every block.

Prefix caching stays correct: a freed block keeps its hash until evicted, and
a lookup takes only an unbroken chain of cached blocks from the first one. A
block's KV depends only on the tokens up to it (the hash chain), never on what
was freed later, so a hit returns the same KV a recompute would.
"""

from __future__ import annotations

from typing import Optional, Sequence

from vllm_lite.core.block_pool import BlockPool
from vllm_lite.core.kv_cache_utils import KVCacheBlock, cdiv, update_request_block_hashes
from vllm_lite.core.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_cpu_blocks: int = 0,
        sliding_window: Optional[int] = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}.")
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be a non-negative integer, got {num_cpu_blocks!r}.")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {sliding_window!r}.")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        # Host swap space: no null block, never cached (its contents only come back to the same request).
        self.host_pool = BlockPool(num_cpu_blocks, enable_caching=False, reserve_null_block=False)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # None where the device list held the null block (freed behind a sliding window): nothing to copy.
        self.req_to_host_blocks: dict[str, list[Optional[KVCacheBlock]]] = {}
        # How many of a request's leading blocks are already registered in (or taken from) the cache.
        self.num_cached_block: dict[str, int] = {}
        # Prefix-cache counters (tokens) since the last `take_prefix_cache_stats`.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ sizes
    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_blocks_in_use(self, request_id: str) -> int:
        """Blocks the request really holds (freed out-of-window ones, now the null block, excluded)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, []) if not b.is_null)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no future query can see: all keys before num_computed_tokens - W + 1.

        No-op without a uniform sliding window."""
        if self.sliding_window is None:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_useful = max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size
        null = self.block_pool.null_block
        assert null is not None  # the device pool always reserves it
        freed = []
        for i in range(min(first_useful, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before was freed at an earlier step
            freed.append(blocks[i])
            blocks[i] = null
        # Tail first: the chain's later blocks are evicted before its prefix.
        self.block_pool.free_blocks(freed)

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of `request` in full blocks, and its length in tokens.

        Never covers the last token: at least one token must run so the request can sample.
        Takes no references: `allocate_slots` touches the blocks when the request is admitted,
        so a failed admission leaves nothing to undo. Requests asking for prompt logprobs skip
        the cache (cached positions produce no logits).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = update_request_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_cache_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Counted by the scheduler once per admission, so a request stuck in the queue is not recounted."""
        if self.enable_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    def take_prefix_cache_stats(self, reset: bool = True) -> tuple[int, int]:
        """(queries, hits) in tokens since the last reset."""
        out = (self.prefix_cache_queries, self.prefix_cache_hits)
        if reset:
            self.prefix_cache_queries = self.prefix_cache_hits = 0
        return out

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full and computed (their KV is written)."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_full = num_computed_tokens // self.block_size
        if num_full > len(blocks):
            num_full = len(blocks)
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_full <= num_cached:
            return
        hashes = update_request_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(blocks, hashes, num_cached, num_full)
        self.num_cached_block[request.request_id] = num_full

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.num_cached_block.clear()
        return ok

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[Sequence[KVCacheBlock]] = None,
    ) -> Optional[list[KVCacheBlock]]:
        """Make room for `num_new_tokens` more tokens after the computed ones; the new blocks, or None if short.

        `new_computed_blocks` (a prefix-cache hit of `num_new_computed_tokens` tokens) are taken too.
        On None nothing has changed.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens!r}.")
        rid = request.request_id
        if self.sliding_window is not None:  # (a call the scheduler's decode steps make for every new block)
            self.remove_skipped_blocks(rid, request.num_computed_tokens)
        req_blocks = self.req_to_blocks.get(rid)
        num_held = len(req_blocks) if req_blocks is not None else 0
        if not new_computed_blocks:
            if num_new_computed_tokens:
                raise ValueError(f"num_new_computed_tokens={num_new_computed_tokens} given without computed blocks")
            # Hot path (decodes, later chunks): usually nothing to allocate.
            num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - num_held
            if num_needed <= 0:
                return []
            pool = self.block_pool
            if num_needed > pool.free_block_queue.num_free_blocks:
                return None
            new_blocks = pool.get_new_blocks(num_needed)
            if req_blocks is None:
                self.req_to_blocks[rid] = new_blocks[:]
            else:
                req_blocks.extend(new_blocks)
            return new_blocks

        computed_blocks = list(new_computed_blocks)
        if len(computed_blocks) * self.block_size != num_new_computed_tokens:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                f"{len(computed_blocks)} computed blocks of {self.block_size} tokens"
            )
        if num_held:
            raise ValueError(f"request {rid!r} already holds blocks; prefix hits apply only on admission")
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = max(cdiv(num_tokens_after, self.block_size) - len(computed_blocks), 0)
        # Hit blocks that sit in the free list stop being free once touched.
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None
        self.block_pool.touch(computed_blocks)
        self.num_cached_block[rid] = len(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        self.req_to_blocks[rid] = computed_blocks + new_blocks
        # Hit blocks already behind the window are not needed by any query of this request.
        self.remove_skipped_blocks(rid, request.num_computed_tokens + num_new_computed_tokens)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's device blocks (tail first, for LRU order) and any host swap blocks."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(b for b in reversed(blocks) if not b.is_null)
        self.num_cached_block.pop(rid, None)
        host = self.req_to_host_blocks.pop(rid, None)
        if host:
            self.host_pool.free_blocks(h for h in host if h is not None)

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, request: Request) -> bool:
        return self.num_blocks_in_use(request.request_id) <= self.host_pool.get_num_free_blocks()

    def swap_out(self, request: Request) -> Optional[list[tuple[int, int]]]:
        """Move the request's blocks to host swap space: (device, host) pairs, or None if the host is full.

        The device blocks are freed at once (the worker copies them out before this step's forward
        pass); their prefix-cache entries stay valid until evicted.
        """
        rid = request.request_id
        if rid in self.req_to_host_blocks:
            raise ValueError(f"request {rid!r} is already swapped out")
        if not self.can_swap_out(request):
            return None
        blocks = self.req_to_blocks.pop(rid, [])
        real = [b for b in blocks if not b.is_null]
        host_real = iter(self.host_pool.get_new_blocks(len(real)))
        host = [None if b.is_null else next(host_real) for b in blocks]
        self.req_to_host_blocks[rid] = host
        self.num_cached_block.pop(rid, None)
        pairs = [(d.block_id, h.block_id) for d, h in zip(blocks, host) if h is not None]
        self.block_pool.free_blocks(reversed(real))
        return pairs

    def swap_in(self, request: Request, num_new_tokens: int) -> Optional[list[tuple[int, int]]]:
        """Bring a swapped request back with room for `num_new_tokens`: (host, device) pairs, or None if short."""
        rid = request.request_id
        host = self.req_to_host_blocks.get(rid)
        if host is None:
            raise ValueError(f"request {rid!r} is not swapped out")
        real = [h for h in host if h is not None]
        growth = max(cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(host), 0)
        if len(real) + growth > self.block_pool.get_num_free_blocks():
            return None
        device_real = iter(self.block_pool.get_new_blocks(len(real)))
        null = self.block_pool.null_block
        assert null is not None  # the device pool always reserves it
        device = [null if h is None else next(device_real) for h in host]
        self.req_to_blocks[rid] = device
        del self.req_to_host_blocks[rid]
        pairs = [(h.block_id, d.block_id) for h, d in zip(host, device) if h is not None]
        self.host_pool.free_blocks(real)
        extra = self.allocate_slots(request, num_new_tokens)
        assert extra is not None  # room was checked above
        return pairs

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.req_to_host_blocks
